//! The composition root of ddo: everything that looks at the machine before a component session
//! runs. It chooses the device a plan names (a default `cuda` without a driver runs on the host
//! backend), builds that device's adapters into a [`ddo_core::Platform`] value (the CUDA adapter
//! or the host backend, with host-memory admission through the Linux probe and the plan's RAM
//! margin), measures the host-to-device link, and detects WSL for the plan's resolution.
//!
//! The session ([`ddo_session::ComponentSession`]) is the use case and decides nothing about
//! the hardware: it takes the [`ddo_session::ExecutionTarget`] a [`Machine`] hands it. A host
//! (the Python package, xtask, a Rust program) builds the machine here, keeps the concrete
//! handle it truly needs (the CUDA device, to adopt its own streams) and opens the session on
//! the machine's target; [`open`] does both for a host that needs no handle.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("model.safetensors");
//! # ddo_session::testing::write_blocks(&path, 3, 1024)?;
//! use ddo_session::{ComponentSession, SessionSpec, Weights};
//!
//! let plan = ddo_session::resolve("transformer", &[
//!     ("backend", "vmm"), ("execution_device", "cpu"), ("vmm_resident_weight_budget_gb", "0.01"),
//! ])?;
//! let machine = ddo_compose::Machine::for_plan(&plan)?;
//! assert!(machine.cuda().is_none(), "the host backend has no CUDA handle");
//! let weights = Weights::Checkpoint { path, mmap: ddo_session::source::MmapChoice::never() };
//! let session = ComponentSession::open(SessionSpec { plan, weights, tree: None }, machine.target())?;
//! assert_eq!(session.device(), machine.device());
//! session.close()?;
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

mod device;
mod link;
mod machine;
mod os;
mod profile;
mod read_ahead;

pub use device::{choose_device, plan_device};
pub use link::measure_host_link;
pub use machine::{Machine, open, open_with_admission};
pub use os::{host_admission, host_room, observe_host_memory, running_on_wsl};
pub use profile::{MachineProfile, PROFILE_MAX_AGE, cache_dir};
pub use read_ahead::read_ahead;

/// The CUDA adapter's handle, for hosts that adopt their own streams ([`Machine::cuda`]).
pub use ddo_platform::cuda::CudaDevice;

/// Whether a CUDA driver library can be loaded here.
pub fn cuda_driver_present() -> bool {
    ddo_platform::cuda::driver_present()
}
