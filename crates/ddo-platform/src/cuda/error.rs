//! [`CudaError`]: a failed driver call, and the one place where driver statuses become port
//! errors.
//!
//! cudarc's `driver::result` and this crate's [`super::result`] both return cudarc's
//! [`DriverError`] (the bare status); [`Named::named`] attaches the driver function's name, and
//! [`CudaError::into_device`] maps it to a [`DeviceError`].

use cudarc::driver::result::DriverError;
use ddo_core::{DeviceError, PlatformError};

use super::sys::CUresult;

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
        let status = DriverError(self.code);
        match (status.error_name(), status.error_string()) {
            (Ok(name), Ok(text)) => {
                format!("{}: {}", name.to_string_lossy(), text.to_string_lossy())
            }
            (Ok(name), Err(_)) => name.to_string_lossy().into_owned(),
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

/// Names the driver function behind a checked call's status.
pub(crate) trait Named<T> {
    /// The result with a failure turned into a [`CudaError`] of `call`.
    fn named(self, call: &'static str) -> Result<T, CudaError>;
}

impl<T> Named<T> for Result<T, DriverError> {
    fn named(self, call: &'static str) -> Result<T, CudaError> {
        self.map_err(|DriverError(code)| CudaError { call, code })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_is_named_after_its_call() {
        assert_eq!(Ok::<_, DriverError>(7).named("cuDeviceGetCount"), Ok(7));
        let e = Err::<(), _>(DriverError(CUresult::CUDA_ERROR_INVALID_VALUE)).named("cuMemMap");
        assert_eq!(
            e,
            Err(CudaError { call: "cuMemMap", code: CUresult::CUDA_ERROR_INVALID_VALUE })
        );
    }

    #[test]
    fn out_of_memory_is_the_port_error_with_the_request() {
        let e = Err::<(), _>(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY))
            .named("cuMemCreate")
            .unwrap_err();
        assert!(matches!(e.into_device(2 << 20), DeviceError::OutOfMemory { requested: 2097152 }));
        assert!(matches!(DeviceError::from(e), DeviceError::OutOfMemory { requested: 0 }));
    }

    #[test]
    fn no_device_is_an_invalid_device() {
        let e = CudaError { call: "cuInit", code: CUresult::CUDA_ERROR_NO_DEVICE };
        assert!(matches!(e.into_device(0), DeviceError::InvalidDevice { ordinal: 0, count: 0 }));
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn other_statuses_name_the_call_and_the_status() {
        let e = CudaError { call: "cuMemMap", code: CUresult::CUDA_ERROR_INVALID_VALUE };
        let text = DeviceError::from(e).to_string();
        assert!(text.starts_with("cuMemMap failed: CUDA_ERROR_INVALID_VALUE"), "{text}");
    }
}
