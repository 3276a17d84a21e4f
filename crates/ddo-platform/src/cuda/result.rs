//! The checked driver calls that cudarc's `driver::result` lacks (cudarc 0.19 has them only as
//! raw [`sys`] bindings): virtual memory management ([`vmm`]) and host-memory registration
//! ([`host_memory`]). Every other call the adapter makes goes through cudarc's result layer.
//!
//! Each function wraps one driver call in cudarc's style and returns cudarc's [`DriverError`],
//! so both layers share one error type; [`super::CudaError`] names the call where the adapter
//! uses it. `unsafe` functions list what the caller must guarantee. Every function needs the
//! driver library to be present ([`super::driver_present`]) and a current context.
//!
//! Reference: the CUDA Driver API, <https://docs.nvidia.com/cuda/cuda-driver-api/>.

pub use cudarc::driver::result::DriverError;

use super::sys;

pub mod vmm {
    //! Virtual memory management: address reservations, physical allocations, mappings.
    //!
    //! See [cuda docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html).

    use super::{DriverError, sys};

    /// Pinned device memory on device `ordinal`.
    fn device_prop(ordinal: i32) -> sys::CUmemAllocationProp {
        // SAFETY: the struct is plain data for which all-zero bytes are a valid value.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = ordinal;
        prop
    }

    /// `cuMemGetAllocationGranularity` (minimum) of device memory on `ordinal`.
    pub fn granularity(ordinal: i32) -> Result<usize, DriverError> {
        let prop = device_prop(ordinal);
        let mut granularity = 0usize;
        // SAFETY: `prop` is a valid property struct; writes one size.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        }
        .result()?;
        Ok(granularity)
    }

    /// `cuMemAddressReserve`: `len` bytes of addresses aligned to `align`.
    pub fn address_reserve(len: usize, align: usize) -> Result<sys::CUdeviceptr, DriverError> {
        let mut ptr = 0;
        // SAFETY: writes one device pointer; reserves addresses only.
        unsafe { sys::cuMemAddressReserve(&mut ptr, len, align, 0, 0) }.result()?;
        Ok(ptr)
    }

    /// `cuMemAddressFree`.
    ///
    /// # Safety
    /// 1. `ptr..ptr+len` is a reservation made by [`address_reserve`] with nothing mapped in it.
    pub unsafe fn address_free(ptr: sys::CUdeviceptr, len: usize) -> Result<(), DriverError> {
        // SAFETY: forwarded.
        unsafe { sys::cuMemAddressFree(ptr, len) }.result()
    }

    /// `cuMemCreate`: `len` bytes of physical memory on `ordinal`.
    pub fn create(
        len: usize,
        ordinal: i32,
    ) -> Result<sys::CUmemGenericAllocationHandle, DriverError> {
        let prop = device_prop(ordinal);
        let mut handle = 0;
        // SAFETY: `prop` is valid; writes one handle.
        unsafe { sys::cuMemCreate(&mut handle, len, &prop, 0) }.result()?;
        Ok(handle)
    }

    /// `cuMemRelease`.
    ///
    /// # Safety
    /// 1. `handle` came from [`create`] and is mapped nowhere.
    pub unsafe fn release(handle: sys::CUmemGenericAllocationHandle) -> Result<(), DriverError> {
        // SAFETY: forwarded.
        unsafe { sys::cuMemRelease(handle) }.result()
    }

    /// `cuMemMap`: maps all of `handle` at `ptr`. The range is not accessible until
    /// [`set_access`].
    ///
    /// # Safety
    /// 1. `ptr..ptr+len` lies inside a live reservation and is not mapped.
    /// 2. `handle` is a live allocation of exactly `len` bytes.
    pub unsafe fn map(
        ptr: sys::CUdeviceptr,
        len: usize,
        handle: sys::CUmemGenericAllocationHandle,
    ) -> Result<(), DriverError> {
        // SAFETY: forwarded.
        unsafe { sys::cuMemMap(ptr, len, 0, handle, 0) }.result()
    }

    /// `cuMemSetAccess`: read/write access for device `ordinal`.
    ///
    /// # Safety
    /// 1. `ptr..ptr+len` is wholly mapped by [`map`].
    pub unsafe fn set_access(
        ptr: sys::CUdeviceptr,
        len: usize,
        ordinal: i32,
    ) -> Result<(), DriverError> {
        // SAFETY: all-zero is a valid access descriptor before the fields are set.
        let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = ordinal;
        desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: forwarded; one descriptor.
        unsafe { sys::cuMemSetAccess(ptr, len, &desc, 1) }.result()
    }

    /// `cuMemUnmap`.
    ///
    /// # Safety
    /// 1. `ptr..ptr+len` is exactly one mapping made by [`map`].
    /// 2. No enqueued or running work uses it.
    pub unsafe fn unmap(ptr: sys::CUdeviceptr, len: usize) -> Result<(), DriverError> {
        // SAFETY: forwarded.
        unsafe { sys::cuMemUnmap(ptr, len) }.result()
    }
}

pub mod host_memory {
    //! Page-locking existing host memory for the device.
    //!
    //! See [cuda docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html).

    use std::ffi::c_void;

    use super::{DriverError, sys};

    /// `cuMemHostRegister` with `PORTABLE` (and `READ_ONLY` when asked).
    ///
    /// # Safety
    /// 1. `ptr..ptr+len` is mapped host memory that stays mapped until [`unregister`].
    pub unsafe fn register(
        ptr: *mut c_void,
        len: usize,
        read_only: bool,
    ) -> Result<(), DriverError> {
        let mut flags = sys::CU_MEMHOSTREGISTER_PORTABLE;
        if read_only {
            flags |= sys::CU_MEMHOSTREGISTER_READ_ONLY;
        }
        // SAFETY: forwarded.
        unsafe { sys::cuMemHostRegister_v2(ptr, len, flags) }.result()
    }

    /// `cuMemHostUnregister`. Waits for all device work (a device-wide synchronization).
    ///
    /// # Safety
    /// 1. `ptr` was registered by [`register`].
    pub unsafe fn unregister(ptr: *mut c_void) -> Result<(), DriverError> {
        // SAFETY: forwarded.
        unsafe { sys::cuMemHostUnregister(ptr) }.result()
    }
}

pub mod peer {
    //! Peer access between devices.
    //!
    //! See [cuda docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PEER__ACCESS.html).

    use super::{DriverError, sys};

    /// `cuDeviceCanAccessPeer`: whether `dev` can access `peer`'s memory directly.
    pub fn can_access(dev: sys::CUdevice, peer: sys::CUdevice) -> Result<bool, DriverError> {
        let mut allowed = 0;
        // SAFETY: writes one int; the driver checks both handles.
        unsafe { sys::cuDeviceCanAccessPeer(&mut allowed, dev, peer) }.result()?;
        Ok(allowed != 0)
    }

    /// `cuCtxEnablePeerAccess` from the current context to `peer`'s; already enabled is success.
    ///
    /// # Safety
    /// 1. `peer` is a live context of another device.
    pub unsafe fn enable(peer: sys::CUcontext) -> Result<(), DriverError> {
        // SAFETY: forwarded.
        match unsafe { sys::cuCtxEnablePeerAccess(peer, 0) } {
            sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            status => status.result(),
        }
    }
}
