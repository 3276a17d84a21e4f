//! [`CudaDevice`] when ddo-platform is built without its `cuda` feature: the same API, but no
//! device can be opened. Every constructor answers [`not_built`]; since no value of the type can
//! exist, its methods are never reached.

use std::convert::Infallible;
use std::sync::Arc;

use ddo_core::{
    BackingId, Copies, DeviceError, DeviceMemory, DeviceOrdinal, DeviceRange, Fence, FenceValue,
    HostRegistration, HostSlice, PeerStore, PlatformError, Registration, Reservation, StreamId,
    Streams, Transforms,
};

/// Why no CUDA device can be opened: this build has no CUDA adapter.
fn not_built(ordinal: u32) -> DeviceError {
    DeviceError::Platform(PlatformError::new(
        format!("open CUDA device {ordinal}"),
        "ddo was built without CUDA support (the `cuda` feature of ddo-platform is off); \
         rebuild with default features (or `--features ddo-platform/cuda`)",
    ))
}

/// Always fails: this build has no CUDA adapter.
pub fn topology() -> Result<ddo_core::DeviceTopology, DeviceError> {
    Err(not_built(0))
}

/// Always fails: this build has no CUDA adapter.
pub fn measure_peer_link(
    dst: u32,
    _src: u32,
    _bytes: usize,
) -> Result<ddo_core::LinkMeasurement, DeviceError> {
    Err(not_built(dst))
}

/// Always fails: this build has no CUDA adapter.
pub fn measure_host_link(
    dst: u32,
    _bytes: usize,
) -> Result<ddo_core::LinkMeasurement, DeviceError> {
    Err(not_built(dst))
}

/// A CUDA device, which this build cannot open (ddo-platform's `cuda` feature is off).
///
/// [`CudaDevice::new`] always fails, saying ddo was built without CUDA, so no value of this type
/// exists and its port implementations are never called.
#[derive(Debug)]
pub struct CudaDevice {
    never: Infallible,
}

impl CudaDevice {
    /// Always fails: ddo-platform was built without its `cuda` feature. The error says so and
    /// how to get CUDA (rebuild with default features).
    pub fn new(ordinal: u32) -> Result<Arc<CudaDevice>, DeviceError> {
        Err(not_built(ordinal))
    }

    /// Introduces a stream created elsewhere (PyTorch's current stream) so ports accept it.
    ///
    /// # Safety
    /// 1. `raw` is a live `CUstream` of this device's primary context.
    /// 2. It stays alive while any port call uses it.
    pub unsafe fn adopt_stream(&self, raw: u64) -> StreamId {
        let _ = raw;
        match self.never {}
    }

    /// The raw `CUstream` of `stream`, for other CUDA libraries in the same process.
    pub fn raw_stream(&self, stream: StreamId) -> u64 {
        let _ = stream;
        match self.never {}
    }

    /// Free and total device memory in bytes.
    pub fn memory_info(&self) -> Result<(u64, u64), DeviceError> {
        match self.never {}
    }

    /// Waits for all work on the device (tests and phase boundaries only).
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        match self.never {}
    }
}

impl DeviceMemory for CudaDevice {
    fn device(&self) -> DeviceOrdinal {
        match self.never {}
    }

    fn granularity(&self) -> Result<u64, DeviceError> {
        match self.never {}
    }

    fn reserve(&self, _len: u64) -> Result<Reservation, DeviceError> {
        match self.never {}
    }

    fn release_reservation(&self, _reservation: Reservation) -> Result<(), DeviceError> {
        match self.never {}
    }

    fn create_backing(&self, _len: u64) -> Result<BackingId, DeviceError> {
        match self.never {}
    }

    fn map(&self, _range: DeviceRange, _backing: BackingId) -> Result<(), DeviceError> {
        match self.never {}
    }

    fn unmap(&self, _range: DeviceRange) -> Result<(), DeviceError> {
        match self.never {}
    }

    fn release_backing(&self, _backing: BackingId) -> Result<(), DeviceError> {
        match self.never {}
    }

    fn read_back(&self, _src: DeviceRange, _dst: &mut [u8]) -> Result<(), DeviceError> {
        match self.never {}
    }
}

impl Streams for CudaDevice {
    fn create_stream(&self) -> Result<StreamId, DeviceError> {
        match self.never {}
    }

    fn release_stream(&self, _stream: StreamId) -> Result<(), DeviceError> {
        match self.never {}
    }
}

impl Copies for CudaDevice {
    fn copy_to_device(
        &self,
        _src: HostSlice,
        _dst: DeviceRange,
        _stream: StreamId,
    ) -> Result<(), DeviceError> {
        match self.never {}
    }
}

impl HostRegistration for CudaDevice {
    fn register_host(
        &self,
        _slice: HostSlice,
        _read_only: bool,
    ) -> Result<Registration, DeviceError> {
        match self.never {}
    }

    fn unregister_host(&self, _registration: &Registration) -> Result<(), DeviceError> {
        match self.never {}
    }
}

impl PeerStore for CudaDevice {}

impl Transforms for CudaDevice {}

impl Fence for CudaDevice {
    fn record(&self, _stream: StreamId) -> Result<FenceValue, DeviceError> {
        match self.never {}
    }

    fn query(&self, _value: FenceValue) -> Result<bool, DeviceError> {
        match self.never {}
    }

    fn wait(&self, _value: FenceValue) -> Result<(), DeviceError> {
        match self.never {}
    }

    fn stream_wait(&self, _stream: StreamId, _value: FenceValue) -> Result<(), DeviceError> {
        match self.never {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opening_a_device_says_cuda_was_not_built() {
        let e = CudaDevice::new(0).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, DeviceError::Platform(_)), "{e:?}");
        assert!(text.contains("built without CUDA support"), "{text}");
        assert!(text.contains("`cuda` feature"), "{text}");
        assert!(text.contains("rebuild with default features"), "{text}");
        assert!(!crate::cuda::driver_present());
    }

    #[test]
    fn the_cuda_platform_says_cuda_was_not_built() {
        let Err(e) = crate::cuda_platform(3) else { panic!("a CUDA platform without CUDA") };
        let text = e.to_string();
        assert!(
            text.starts_with("open CUDA device 3 failed: ddo was built without CUDA"),
            "{text}"
        );
    }
}
