//! Where a component runs: a CUDA device or the host backend, and the platform for it.

use std::sync::Arc;

use ddo_core::{AdmissionProbe, Platform};
use ddo_platform::LinuxAdmissionProbe;
use ddo_platform::cuda::CudaDevice;
use ddo_platform::host::HostDevice;

use crate::SessionError;

/// The device a session runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecutionDevice {
    /// CUDA device `ordinal`.
    Cuda(u32),
    /// The host backend: CPU memory with the arena's semantics, synchronous copies.
    Host,
}

impl ExecutionDevice {
    /// Parses `cuda`, `cuda:N` or `cpu`; the error names the setting.
    pub fn parse(value: &str) -> Result<ExecutionDevice, SessionError> {
        let v = value.trim().to_ascii_lowercase();
        let invalid = || SessionError::Config {
            setting: "execution_device",
            message: format!("{value:?} is not a device; use cuda, cuda:N or cpu"),
        };
        match v.as_str() {
            "cpu" => Ok(ExecutionDevice::Host),
            "cuda" => Ok(ExecutionDevice::Cuda(0)),
            _ => {
                let n = v.strip_prefix("cuda:").ok_or_else(invalid)?;
                n.parse().map(ExecutionDevice::Cuda).map_err(|_| invalid())
            }
        }
    }

    /// The device for a setting: as given, except that a default `cuda` on a machine without a
    /// CUDA driver runs on the host backend (the user asked for nothing in particular).
    pub fn choose(value: &str, from_default: bool) -> Result<ExecutionDevice, SessionError> {
        let device = Self::parse(value)?;
        if from_default
            && matches!(device, ExecutionDevice::Cuda(_))
            && !ddo_platform::cuda::driver_present()
        {
            return Ok(ExecutionDevice::Host);
        }
        Ok(device)
    }

    /// The PyTorch name (`cuda:0`, `cpu`).
    pub fn torch_name(self) -> String {
        match self {
            ExecutionDevice::Cuda(n) => format!("cuda:{n}"),
            ExecutionDevice::Host => "cpu".to_owned(),
        }
    }
}

/// The adapters of one device.
#[derive(Clone)]
pub(crate) struct DevicePlatform {
    pub(crate) platform: Platform,
    pub(crate) cuda: Option<Arc<CudaDevice>>,
}

impl DevicePlatform {
    /// Opens `device` with host admission through `probe`, or this host's keeping `ram_margin`
    /// bytes free.
    pub(crate) fn open(
        device: ExecutionDevice,
        ram_margin: u64,
        probe: Option<Arc<dyn AdmissionProbe>>,
    ) -> Result<Self, SessionError> {
        let admission = probe.unwrap_or_else(|| {
            Arc::new(LinuxAdmissionProbe::system().with_safety_margin(ram_margin))
        });
        Ok(match device {
            ExecutionDevice::Cuda(ordinal) => {
                let (platform, cuda) = ddo_platform::cuda_platform(ordinal)?;
                DevicePlatform { platform: Platform { admission, ..platform }, cuda: Some(cuda) }
            }
            ExecutionDevice::Host => {
                let host = Arc::new(HostDevice::new());
                let platform = ddo_platform::host_platform(host);
                DevicePlatform { platform: Platform { admission, ..platform }, cuda: None }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_strings() {
        assert_eq!(ExecutionDevice::parse("cuda:1").unwrap(), ExecutionDevice::Cuda(1));
        assert_eq!(ExecutionDevice::parse("CUDA").unwrap(), ExecutionDevice::Cuda(0));
        assert_eq!(ExecutionDevice::parse("cpu").unwrap(), ExecutionDevice::Host);
        let err = ExecutionDevice::parse("abc").unwrap_err().to_string();
        assert_eq!(err, "execution_device: \"abc\" is not a device; use cuda, cuda:N or cpu");
        assert!(ExecutionDevice::parse("cuda:x").is_err());
        assert_eq!(ExecutionDevice::choose("cpu", true).unwrap(), ExecutionDevice::Host);
    }

    #[test]
    fn an_explicit_cuda_device_is_kept() {
        // Without a driver the explicit choice fails later, when the device is opened.
        assert_eq!(ExecutionDevice::choose("cuda:0", false).unwrap(), ExecutionDevice::Cuda(0));
    }
}
