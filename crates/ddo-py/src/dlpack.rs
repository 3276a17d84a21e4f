//! DLPack capsules over arena memory: PyTorch imports them without copying. Each carries an owner
//! (the attach's memory) in `manager_ctx`; the deleter drops it, so the memory lives as long as
//! the last tensor viewing it, whatever happens to the offload.

use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;

use ddo_session::core::Dtype;
use pyo3::ffi;
use pyo3::prelude::*;

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// DLPack device type of CUDA memory.
pub(crate) const K_DL_CUDA: i32 = 2;
/// DLPack device type of host memory.
pub(crate) const K_DL_CPU: i32 = 1;
const CAPSULE_NAME: &std::ffi::CStr = c"dltensor";

/// DLPack `(type code, bits)` of a dtype. fp8 tensors travel as their bytes (`uint8`): DLPack
/// consumers differ on fp8 codes, and the package views the bytes as the parameter's dtype.
pub(crate) fn dtype_code(d: Dtype) -> Option<(u8, u8)> {
    // Codes: 0 int, 1 uint, 2 float, 4 bfloat, 6 bool.
    Some(match d {
        Dtype::Bool => (6, 8),
        Dtype::U8 => (1, 8),
        Dtype::I8 => (0, 8),
        Dtype::I16 => (0, 16),
        Dtype::U16 => (1, 16),
        Dtype::I32 => (0, 32),
        Dtype::U32 => (1, 32),
        Dtype::I64 => (0, 64),
        Dtype::U64 => (1, 64),
        Dtype::F16 => (2, 16),
        Dtype::BF16 => (4, 16),
        Dtype::F32 => (2, 32),
        Dtype::F64 => (2, 64),
        Dtype::F8E4M3 | Dtype::F8E5M2 => (1, 8),
    })
}

/// Frees the DLPack structure and its shape array (not the data).
unsafe extern "C" fn delete_managed(m: *mut DLManagedTensor) {
    if m.is_null() {
        return;
    }
    // SAFETY: `m` and its shape array were created by `capsule` with Box, and the deleter runs
    // exactly once (by the consumer, or by the capsule destructor if never consumed).
    unsafe {
        let managed = Box::from_raw(m);
        if !managed.manager_ctx.is_null() {
            drop(Box::from_raw(managed.manager_ctx.cast::<Owner>()));
        }
        let ndim = managed.dl_tensor.ndim as usize;
        if !managed.dl_tensor.shape.is_null() {
            let slice = std::ptr::slice_from_raw_parts_mut(managed.dl_tensor.shape, ndim);
            drop(Box::from_raw(slice));
        }
    }
}

/// Runs when the capsule is collected: frees the structure only if no consumer took it.
unsafe extern "C" fn destroy_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with our capsule; a consumed capsule is renamed "used_dltensor"
    // and its structure belongs to the consumer.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE_NAME.as_ptr()) == 1 {
            let m =
                ffi::PyCapsule_GetPointer(capsule, CAPSULE_NAME.as_ptr()) as *mut DLManagedTensor;
            delete_managed(m);
        }
    }
}

/// What keeps a view's memory alive: held by the DLPack structure, dropped by its deleter.
type Owner = Arc<dyn Any + Send + Sync>;

/// A `dltensor` capsule for a contiguous tensor at `address` on device `device_id` of
/// `device_type`. `owner` keeps that memory alive until the consumer (or the capsule, if never
/// consumed) deletes the structure.
#[allow(clippy::too_many_arguments)]
pub(crate) fn capsule(
    py: Python<'_>,
    address: u64,
    device_type: i32,
    device_id: i32,
    code: u8,
    bits: u8,
    shape: Vec<i64>,
    owner: Owner,
) -> PyResult<Py<PyAny>> {
    let ndim = shape.len() as i32;
    // A boxed slice has exactly `ndim` elements, so the deleter can rebuild it.
    let shape: *mut i64 = Box::into_raw(shape.into_boxed_slice()).cast();
    let managed = Box::new(DLManagedTensor {
        dl_tensor: DLTensor {
            data: address as *mut c_void,
            device: DLDevice { device_type, device_id },
            ndim,
            dtype: DLDataType { code, bits, lanes: 1 },
            shape,
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
        manager_ctx: Box::into_raw(Box::new(owner)).cast(),
        deleter: Some(delete_managed),
    });
    let raw = Box::into_raw(managed);
    // SAFETY: `raw` is a valid DLManagedTensor; the name is a static C string; the destructor
    // frees it unless a consumer took ownership.
    let obj = unsafe {
        ffi::PyCapsule_New(raw as *mut c_void, CAPSULE_NAME.as_ptr(), Some(destroy_capsule))
    };
    if obj.is_null() {
        // SAFETY: the capsule was not created, so we still own `raw`.
        unsafe { delete_managed(raw) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `obj` is a new strong reference.
    Ok(unsafe { Py::from_owned_ptr(py, obj) })
}
