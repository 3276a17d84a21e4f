//! One checked function per driver call. Each returns the driver's status as a [`CudaError`]
//! naming the call; `unsafe` ones list what the caller must guarantee.
//!
//! Reference: the CUDA Driver API, <https://docs.nvidia.com/cuda/cuda-driver-api/>.

use std::ffi::{CStr, c_void};

use ddo_core::{DeviceError, PlatformError};

use super::sys::{self, CUresult};

/// A failed driver call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaError {
    /// The driver function.
    pub call: &'static str,
    /// Its status.
    pub code: CUresult,
}

impl CudaError {
    /// The status name and description (`CUDA_ERROR_OUT_OF_MEMORY: out of memory`).
    pub fn describe(&self) -> String {
        let mut name: *const std::ffi::c_char = std::ptr::null();
        let mut text: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: both calls only write a pointer to a static string (or leave it null).
        unsafe {
            sys::cuGetErrorName(self.code, &mut name);
            sys::cuGetErrorString(self.code, &mut text);
        }
        let read = |p: *const std::ffi::c_char| {
            // SAFETY: non-null pointers from the driver point to static NUL-terminated strings.
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        };
        match (read(name), read(text)) {
            (Some(n), Some(t)) => format!("{n}: {t}"),
            (Some(n), None) => n,
            _ => format!("{:?}", self.code),
        }
    }

    /// The port error: out-of-memory becomes [`DeviceError::OutOfMemory`], everything else a
    /// platform error naming the call.
    pub fn into_device(self, requested: u64) -> DeviceError {
        match self.code {
            CUresult::CUDA_ERROR_OUT_OF_MEMORY => DeviceError::OutOfMemory { requested },
            CUresult::CUDA_ERROR_NO_DEVICE => DeviceError::InvalidDevice { ordinal: 0, count: 0 },
            _ => DeviceError::Platform(PlatformError::new(self.call, self.describe())),
        }
    }
}

impl From<CudaError> for DeviceError {
    fn from(e: CudaError) -> Self {
        e.into_device(0)
    }
}

fn check(call: &'static str, code: CUresult) -> Result<(), CudaError> {
    if code == CUresult::CUDA_SUCCESS { Ok(()) } else { Err(CudaError { call, code }) }
}

/// [`cuInit`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__INITIALIZE.html).
/// The driver library must be present ([`super::driver_present`]).
pub fn init() -> Result<(), CudaError> {
    // SAFETY: cuInit has no pointer arguments.
    check("cuInit", unsafe { sys::cuInit(0) })
}

/// `cuDeviceGetCount`.
pub fn device_count() -> Result<i32, CudaError> {
    let mut n = 0;
    // SAFETY: writes one int.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(n)
}

/// `cuDeviceGet`.
pub fn device_get(ordinal: i32) -> Result<sys::CUdevice, CudaError> {
    let mut dev = 0;
    // SAFETY: writes one device handle.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
    Ok(dev)
}

/// `cuDevicePrimaryCtxRetain`: the device's primary context (the one PyTorch uses).
pub fn primary_ctx_retain(dev: sys::CUdevice) -> Result<sys::CUcontext, CudaError> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: writes one context handle; `dev` came from cuDeviceGet.
    check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) })?;
    Ok(ctx)
}

/// `cuDevicePrimaryCtxRelease`.
///
/// # Safety
/// 1. Balances one successful [`primary_ctx_retain`] of `dev`.
pub unsafe fn primary_ctx_release(dev: sys::CUdevice) -> Result<(), CudaError> {
    // SAFETY: forwarded.
    check("cuDevicePrimaryCtxRelease", unsafe { sys::cuDevicePrimaryCtxRelease_v2(dev) })
}

/// `cuCtxSetCurrent`.
///
/// # Safety
/// 1. `ctx` is a live context.
pub unsafe fn ctx_set_current(ctx: sys::CUcontext) -> Result<(), CudaError> {
    // SAFETY: forwarded.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })
}

/// `cuCtxSynchronize`: waits for all work of the current context.
pub fn ctx_synchronize() -> Result<(), CudaError> {
    // SAFETY: no arguments.
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

fn device_prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: the struct is plain data for which all-zero bytes are a valid value.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    prop
}

/// `cuMemGetAllocationGranularity` (minimum) of device memory on `ordinal`.
pub fn mem_granularity(ordinal: i32) -> Result<usize, CudaError> {
    let prop = device_prop(ordinal);
    let mut g = 0usize;
    // SAFETY: `prop` is a valid property struct; writes one size.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(g)
}

/// `cuMemAddressReserve`: `len` bytes of addresses aligned to `align`.
pub fn mem_address_reserve(len: usize, align: usize) -> Result<sys::CUdeviceptr, CudaError> {
    let mut ptr = 0;
    // SAFETY: writes one device pointer; reserves addresses only.
    check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut ptr, len, align, 0, 0) })?;
    Ok(ptr)
}

/// `cuMemAddressFree`.
///
/// # Safety
/// 1. `ptr..ptr+len` is a reservation made by [`mem_address_reserve`] with nothing mapped in it.
pub unsafe fn mem_address_free(ptr: sys::CUdeviceptr, len: usize) -> Result<(), CudaError> {
    // SAFETY: forwarded.
    check("cuMemAddressFree", unsafe { sys::cuMemAddressFree(ptr, len) })
}

/// `cuMemCreate`: `len` bytes of physical memory on `ordinal`.
pub fn mem_create(
    len: usize,
    ordinal: i32,
) -> Result<sys::CUmemGenericAllocationHandle, CudaError> {
    let prop = device_prop(ordinal);
    let mut handle = 0;
    // SAFETY: `prop` is valid; writes one handle.
    check("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, len, &prop, 0) })?;
    Ok(handle)
}

/// `cuMemRelease`.
///
/// # Safety
/// 1. `handle` came from [`mem_create`] and is mapped nowhere.
pub unsafe fn mem_release(handle: sys::CUmemGenericAllocationHandle) -> Result<(), CudaError> {
    // SAFETY: forwarded.
    check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
}

/// `cuMemMap` then `cuMemSetAccess` (read/write for `ordinal`).
///
/// # Safety
/// 1. `ptr..ptr+len` lies inside a live reservation and is not mapped.
/// 2. `handle` is a live allocation of exactly `len` bytes.
pub unsafe fn mem_map(
    ptr: sys::CUdeviceptr,
    len: usize,
    handle: sys::CUmemGenericAllocationHandle,
    ordinal: i32,
) -> Result<(), CudaError> {
    // SAFETY: forwarded.
    check("cuMemMap", unsafe { sys::cuMemMap(ptr, len, 0, handle, 0) })?;
    // SAFETY: all-zero is a valid access descriptor before the fields are set.
    let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = ordinal;
    desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    // SAFETY: the range was just mapped; one descriptor.
    let access = check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(ptr, len, &desc, 1) });
    if access.is_err() {
        // SAFETY: undo the mapping made above; nothing used it.
        unsafe { sys::cuMemUnmap(ptr, len) };
    }
    access
}

/// `cuMemUnmap`.
///
/// # Safety
/// 1. `ptr..ptr+len` is exactly one mapping made by [`mem_map`].
/// 2. No enqueued or running work uses it.
pub unsafe fn mem_unmap(ptr: sys::CUdeviceptr, len: usize) -> Result<(), CudaError> {
    // SAFETY: forwarded.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, len) })
}

/// `cuStreamCreate` with `CU_STREAM_NON_BLOCKING`.
pub fn stream_create() -> Result<sys::CUstream, CudaError> {
    let mut s = std::ptr::null_mut();
    // SAFETY: writes one stream handle.
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
    })?;
    Ok(s)
}

/// `cuStreamDestroy`.
///
/// # Safety
/// 1. `s` came from [`stream_create`] and is not used after this call.
pub unsafe fn stream_destroy(s: sys::CUstream) -> Result<(), CudaError> {
    // SAFETY: forwarded.
    check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(s) })
}

/// `cuMemcpyHtoDAsync`.
///
/// # Safety
/// 1. `dst..dst+len` is mapped device memory.
/// 2. `src..src+len` is host memory that stays valid and unchanged until the copy completes.
/// 3. `stream` is a live stream of the current context.
pub unsafe fn memcpy_htod_async(
    dst: sys::CUdeviceptr,
    src: *const c_void,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), CudaError> {
    // SAFETY: forwarded.
    check("cuMemcpyHtoDAsync", unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src, len, stream) })
}

/// `cuMemcpyDtoH` (synchronous).
///
/// # Safety
/// 1. `src..src+len` is mapped device memory; `dst` is `len` writable host bytes.
pub unsafe fn memcpy_dtoh(
    dst: *mut c_void,
    src: sys::CUdeviceptr,
    len: usize,
) -> Result<(), CudaError> {
    // SAFETY: forwarded.
    check("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(dst, src, len) })
}

/// `cuEventCreate` with `CU_EVENT_DISABLE_TIMING`.
pub fn event_create() -> Result<sys::CUevent, CudaError> {
    let mut e = std::ptr::null_mut();
    // SAFETY: writes one event handle.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
    })?;
    Ok(e)
}

/// `cuEventDestroy`.
///
/// # Safety
/// 1. `e` came from [`event_create`] and is not used after this call.
pub unsafe fn event_destroy(e: sys::CUevent) -> Result<(), CudaError> {
    // SAFETY: forwarded.
    check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(e) })
}

/// `cuEventRecord`.
///
/// # Safety
/// 1. `e` and `stream` are live handles of the current context.
pub unsafe fn event_record(e: sys::CUevent, stream: sys::CUstream) -> Result<(), CudaError> {
    // SAFETY: forwarded.
    check("cuEventRecord", unsafe { sys::cuEventRecord(e, stream) })
}

/// `cuEventQuery`: `Ok(true)` when complete, `Ok(false)` when not ready.
///
/// # Safety
/// 1. `e` is a live event.
pub unsafe fn event_query(e: sys::CUevent) -> Result<bool, CudaError> {
    // SAFETY: forwarded.
    match unsafe { sys::cuEventQuery(e) } {
        CUresult::CUDA_SUCCESS => Ok(true),
        CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        code => Err(CudaError { call: "cuEventQuery", code }),
    }
}

/// `cuEventSynchronize`.
///
/// # Safety
/// 1. `e` is a live event.
pub unsafe fn event_synchronize(e: sys::CUevent) -> Result<(), CudaError> {
    // SAFETY: forwarded.
    check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(e) })
}

/// `cuStreamWaitEvent`.
///
/// # Safety
/// 1. `stream` and `e` are live handles of the current context.
pub unsafe fn stream_wait_event(stream: sys::CUstream, e: sys::CUevent) -> Result<(), CudaError> {
    // SAFETY: forwarded.
    check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(stream, e, 0) })
}

/// `cuMemHostRegister` with `PORTABLE` (and `READ_ONLY` when asked).
///
/// # Safety
/// 1. `ptr..ptr+len` is mapped host memory that stays mapped until [`mem_host_unregister`].
pub unsafe fn mem_host_register(
    ptr: *mut c_void,
    len: usize,
    read_only: bool,
) -> Result<(), CudaError> {
    let mut flags = sys::CU_MEMHOSTREGISTER_PORTABLE;
    if read_only {
        flags |= sys::CU_MEMHOSTREGISTER_READ_ONLY;
    }
    // SAFETY: forwarded.
    check("cuMemHostRegister", unsafe { sys::cuMemHostRegister_v2(ptr, len, flags) })
}

/// `cuMemHostUnregister`. Waits for all device work (a device-wide synchronization).
///
/// # Safety
/// 1. `ptr` was registered by [`mem_host_register`].
pub unsafe fn mem_host_unregister(ptr: *mut c_void) -> Result<(), CudaError> {
    // SAFETY: forwarded.
    check("cuMemHostUnregister", unsafe { sys::cuMemHostUnregister(ptr) })
}

/// `cuMemGetInfo`: (free, total) bytes of the current context's device.
pub fn mem_get_info() -> Result<(usize, usize), CudaError> {
    let (mut free, mut total) = (0, 0);
    // SAFETY: writes two sizes.
    check("cuMemGetInfo", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
    Ok((free, total))
}
