//! Adapters of ddo's ports to real platforms.
//!
//! - [`cuda`]: NVIDIA GPUs through the CUDA driver, loaded at run time (no toolkit is needed to
//!   build; a machine without a driver gets [`ddo_core::DeviceError::DriverNotFound`]). It needs
//!   the `cuda` feature, on by default; without it the module keeps its API and opening a device
//!   fails with an error that says ddo was built without CUDA.
//! - [`host`]: the host backend, real host memory with the same virtual-memory semantics, for
//!   machines without a GPU and for tests.
//! - [`linux`]: host-memory observation and admission from `/proc`, cgroups (v2, or the v1
//!   memory hierarchy) and rlimits, read under an injectable root directory so every decision is
//!   testable on fixture trees.
//! - [`samples`]: weight-like bytes for probes and benchmarks of the device.
//!
//! Adapters are values: a host builds them once and puts them in a [`ddo_core::Platform`]
//! ([`host_platform`], [`cuda_platform`]). `unsafe` here is confined to FFI and raw memory, each
//! block with its `SAFETY` reasoning.

mod book;
pub mod cuda;
pub mod host;
pub mod linux;
pub mod samples;

use std::sync::Arc;

use ddo_core::{DeviceError, Platform};

pub use linux::{DEFAULT_SAFETY_MARGIN, LinuxAdmissionProbe};

/// The host backend as a [`Platform`], with the Linux admission probe.
pub fn host_platform(device: Arc<host::HostDevice>) -> Platform {
    Platform {
        name: "host",
        residency: device.clone(),
        fences: device,
        admission: Arc::new(LinuxAdmissionProbe::system()),
    }
}

/// The CUDA device `ordinal` as a [`Platform`] (primary context), with the Linux admission
/// probe. Fails with [`DeviceError::DriverNotFound`] where no driver is installed, and with a
/// platform error saying ddo was built without CUDA when the `cuda` feature is off.
pub fn cuda_platform(ordinal: u32) -> Result<(Platform, Arc<cuda::CudaDevice>), DeviceError> {
    let device = cuda::CudaDevice::new(ordinal)?;
    let platform = Platform {
        name: "cuda",
        residency: device.clone(),
        fences: device.clone(),
        admission: Arc::new(LinuxAdmissionProbe::system()),
    };
    Ok((platform, device))
}
