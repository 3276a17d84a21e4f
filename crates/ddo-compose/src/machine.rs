//! The machine a session runs on: the device's adapters built into a platform, the link
//! measured, and the concrete handle a host may need.

use std::sync::Arc;

use ddo_core::{AdmissionProbe, DeviceOrdinal, GIB};
use ddo_platform::cuda::CudaDevice;
use ddo_platform::host::HostDevice;
use ddo_policy::Plan;
use ddo_session::{
    ComponentSession, EncodedCacheFolder, ExecutionDevice, ExecutionTarget, SessionError,
    SessionRoute, SessionSpec,
};

use crate::device::plan_device;

/// Bytes per copy of the peer-link probe.
const PEER_PROBE_BYTES: usize = 256 << 20;

/// One device opened for sessions: the [`ExecutionTarget`] they take, and the CUDA handle
/// (`None` on the host backend) for a host that adopts its own streams.
#[derive(Debug, Clone)]
pub struct Machine {
    target: ExecutionTarget,
    cuda: Option<Arc<CudaDevice>>,
}

impl Machine {
    /// The machine `plan` runs on: its `execution_device` ([`plan_device`]), host memory
    /// admitted through this host's probe keeping `system_ram_headroom_gb` free.
    pub fn for_plan(plan: &Plan) -> Result<Machine, SessionError> {
        let margin = gib("system_ram_headroom_gb", plan.settings.system_ram_headroom_gb)?;
        Self::open(plan_device(plan)?, crate::host_admission(Some(margin)))
    }

    /// [`for_plan`](Self::for_plan) with host memory observed through `admission` instead of
    /// this host's `/proc` and cgroups: an embedding program's own policy, or an observation tree
    /// (`LinuxAdmissionProbe::with_root`). Its safety margin replaces `system_ram_headroom_gb`.
    pub fn for_plan_with_admission(
        plan: &Plan,
        admission: Arc<dyn AdmissionProbe>,
    ) -> Result<Machine, SessionError> {
        Self::open(plan_device(plan)?, admission)
    }

    /// Opens `device` with host admission through `admission`; a CUDA device's link is
    /// measured (a failed measurement leaves it unmeasured).
    pub fn open(
        device: ExecutionDevice,
        admission: Arc<dyn AdmissionProbe>,
    ) -> Result<Machine, SessionError> {
        Ok(match device {
            ExecutionDevice::Cuda(ordinal) => {
                let (platform, cuda) = ddo_platform::cuda_platform(ordinal)?;
                let platform = ddo_core::Platform { admission, ..platform };
                let link_bytes_per_second = crate::measure_host_link(&platform).ok();
                let target = ExecutionTarget {
                    device,
                    platform,
                    link_bytes_per_second,
                    peer_link: Some(measure_peer_link),
                    encoded_cache: default_encoded_cache(),
                };
                Machine { target, cuda: Some(cuda) }
            }
            ExecutionDevice::Host => {
                let platform = ddo_platform::host_platform(Arc::new(HostDevice::new()));
                let platform = ddo_core::Platform { admission, ..platform };
                let target = ExecutionTarget {
                    encoded_cache: default_encoded_cache(),
                    ..ExecutionTarget::unmeasured(device, platform)
                };
                Machine { target, cuda: None }
            }
        })
    }

    /// What a session opens on (a clone: sessions of one machine share its adapters).
    pub fn target(&self) -> ExecutionTarget {
        self.target.clone()
    }

    /// The device.
    pub fn device(&self) -> ExecutionDevice {
        self.target.device
    }

    /// The CUDA device, to adopt a host's streams (`None` on the host backend).
    pub fn cuda(&self) -> Option<&Arc<CudaDevice>> {
        self.cuda.as_ref()
    }
}

/// The default encoded-file folder, from this process's environment
/// ([`ddo_policy::encoded_cache::default_encoded_cache_dir`]), kept within
/// [`DEFAULT_ENCODED_CACHE_BYTES`](ddo_policy::encoded_cache::DEFAULT_ENCODED_CACHE_BYTES).
fn default_encoded_cache() -> Option<EncodedCacheFolder> {
    let path = ddo_policy::encoded_cache::default_encoded_cache_dir(|v| std::env::var(v).ok())?;
    Some(EncodedCacheFolder {
        path,
        cap_bytes: ddo_policy::encoded_cache::DEFAULT_ENCODED_CACHE_BYTES,
    })
}

/// The peer link between two CUDA devices, bytes per second.
fn measure_peer_link(own: DeviceOrdinal, peer: DeviceOrdinal) -> Option<f64> {
    ddo_platform::cuda::measure_peer_link(own.0, peer.0, PEER_PROBE_BYTES)
        .ok()
        .map(|m| m.bytes_per_second)
}

/// Opens a session on the machine its plan names ([`Machine::for_plan`]), for a host that
/// needs no device handle. A route no session runs is refused before any device is opened.
pub fn open(spec: SessionSpec) -> Result<ComponentSession, SessionError> {
    SessionRoute::of(&spec.plan.route)?;
    let machine = Machine::for_plan(&spec.plan)?;
    ComponentSession::open(spec, machine.target())
}

/// [`open`] with host memory observed through `admission` ([`Machine::for_plan_with_admission`]).
pub fn open_with_admission(
    spec: SessionSpec,
    admission: Arc<dyn AdmissionProbe>,
) -> Result<ComponentSession, SessionError> {
    SessionRoute::of(&spec.plan.route)?;
    let machine = Machine::for_plan_with_admission(&spec.plan, admission)?;
    ComponentSession::open(spec, machine.target())
}

/// Bytes of `value` GiB; the error names `setting`.
pub(crate) fn gib(setting: &'static str, value: f64) -> Result<u64, SessionError> {
    let bytes = value * GIB as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
        return Err(SessionError::Config {
            setting,
            message: format!("{value} GiB is not a usable size"),
        });
    }
    Ok(bytes as u64)
}
