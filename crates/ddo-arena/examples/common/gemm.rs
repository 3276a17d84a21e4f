//! The GEMM the GPU examples run on every streamed weight: `y = W x` in bf16 with fp32
//! accumulation through cuBLAS, on the handle's stream.

use std::ffi::c_void;

use cudarc::cublas::{CudaBlas, sys as cb};

/// `y = W x`: `W` is `width x width`, `x` and `y` are `width x tokens`, all bf16 device memory.
///
/// # Safety
/// 1. `weight`, `x` and `y` are live device allocations of the handle's context, of at least
///    the sizes above, and stay so until the work enqueued on the handle's stream completed.
/// 2. The weight's bytes are on the device for that stream (a lease is held on its unit).
pub(crate) unsafe fn bf16(
    blas: &CudaBlas,
    width: usize,
    tokens: usize,
    weight: u64,
    x: u64,
    y: u64,
) -> Result<(), String> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (w, t) = (width as i32, tokens as i32);
    // SAFETY: forwarded from this function's contract.
    let status = unsafe {
        cb::cublasGemmEx(
            *blas.handle(),
            cb::cublasOperation_t::CUBLAS_OP_N,
            cb::cublasOperation_t::CUBLAS_OP_N,
            w,
            t,
            w,
            &alpha as *const f32 as *const c_void,
            weight as *const c_void,
            cb::cudaDataType::CUDA_R_16BF,
            w,
            x as *const c_void,
            cb::cudaDataType::CUDA_R_16BF,
            w,
            &beta as *const f32 as *const c_void,
            y as *mut c_void,
            cb::cudaDataType::CUDA_R_16BF,
            w,
            cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    if status == cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("cublasGemmEx failed: {status:?}"))
    }
}
