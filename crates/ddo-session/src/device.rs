//! Where a component runs: the device a session names, and the target a composition root builds
//! for it (the device's ports and what was measured of its link).

use ddo_core::{DeviceOrdinal, Platform};

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

    /// The PyTorch name (`cuda:0`, `cpu`).
    pub fn torch_name(self) -> String {
        match self {
            ExecutionDevice::Cuda(n) => format!("cuda:{n}"),
            ExecutionDevice::Host => "cpu".to_owned(),
        }
    }
}

/// Measures the link from device `own`'s memory to device `peer`'s, bytes per second (`None`
/// when it cannot be measured).
pub type PeerLinkProbe = fn(own: DeviceOrdinal, peer: DeviceOrdinal) -> Option<f64>;

/// Where a session runs, as a composition root builds it: the device, its adapters as a
/// [`Platform`] value, and what the root measured of the device. The session decides nothing
/// about the hardware beyond what this value says.
#[derive(Debug, Clone)]
pub struct ExecutionTarget {
    /// The device the platform drives.
    pub device: ExecutionDevice,
    /// The device's ports: residency, fences, host-memory admission.
    pub platform: Platform,
    /// The host-to-device link speed, bytes per second, when measured (a GPU's); the copy
    /// floor of a pass and `vmm_weight_encoding = auto` weigh against it.
    pub link_bytes_per_second: Option<f64>,
    /// Measures a peer weight store's link (two GPUs); `None` where there is no peer link.
    pub peer_link: Option<PeerLinkProbe>,
    /// The encoded-file folder `vmm_weight_encoding` uses when `vmm_encoded_cache_dir` is empty
    /// (the composition root resolves it from the environment:
    /// [`ddo_policy::encoded_cache::default_encoded_cache_dir`]); `None`: no default folder.
    pub encoded_cache: Option<EncodedCacheFolder>,
}

/// A default encoded-file folder and the bytes of encoded files it keeps at most (the least
/// recently used go beyond them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedCacheFolder {
    /// The folder (made when first written).
    pub path: std::path::PathBuf,
    /// The most bytes of encoded files it keeps.
    pub cap_bytes: u64,
}

impl ExecutionTarget {
    /// A target on `platform` with nothing measured: no link speed, no peer link.
    pub fn unmeasured(device: ExecutionDevice, platform: Platform) -> ExecutionTarget {
        ExecutionTarget {
            device,
            platform,
            link_bytes_per_second: None,
            peer_link: None,
            encoded_cache: None,
        }
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
        assert_eq!(ExecutionDevice::Cuda(2).torch_name(), "cuda:2");
        assert_eq!(ExecutionDevice::Host.torch_name(), "cpu");
    }
}
