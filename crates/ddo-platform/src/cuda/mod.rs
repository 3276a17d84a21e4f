//! The CUDA adapter, in three layers as in cudarc: raw bindings (`sys`, cudarc's, loaded at run
//! time), checked driver calls (cudarc's `driver::result`, plus `result` for the virtual-memory
//! and host-registration calls cudarc has only as raw bindings), and [`CudaDevice`], which owns
//! the handles and implements the device ports. Every failed call becomes one `CudaError` naming
//! the driver function, mapped in one place to a [`ddo_core::DeviceError`].
//!
//! It uses the device's primary context, so memory, streams and events interoperate with PyTorch
//! in the same process. Before any driver call it checks that the driver library exists; without
//! it every entry point answers [`ddo_core::DeviceError::DriverNotFound`] instead of panicking.
//!
//! Built without the `cuda` feature (on by default), this module keeps [`CudaDevice`] and
//! [`driver_present`] with the same API, but no device can be opened: every constructor answers
//! that ddo was built without CUDA, and [`driver_present`] is false. The raw layers (`sys`,
//! `result`, `CudaError`) exist only with the feature.

#[cfg(feature = "cuda")]
mod convert;
#[cfg(feature = "cuda")]
mod decode;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod error;
#[cfg(not(feature = "cuda"))]
mod not_built;
#[cfg(feature = "cuda")]
pub mod result;
#[cfg(feature = "cuda")]
mod shared;
#[cfg(feature = "cuda")]
mod topology;

#[cfg(feature = "cuda")]
pub use cudarc::driver::sys;
#[cfg(feature = "cuda")]
pub use device::CudaDevice;
#[cfg(feature = "cuda")]
pub use error::CudaError;
#[cfg(not(feature = "cuda"))]
pub use not_built::CudaDevice;
#[cfg(not(feature = "cuda"))]
pub use not_built::{measure_host_link, measure_peer_link, topology};
#[cfg(feature = "cuda")]
pub use shared::holders as registration_holders;
#[cfg(feature = "cuda")]
pub use topology::{measure_host_link, measure_peer_link, topology};

/// Whether a CUDA driver library can be loaded on this machine. Never panics. Always false when
/// ddo-platform is built without its `cuda` feature.
pub fn driver_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: only tries to open the library by its usual names; no symbol is called.
        unsafe { sys::is_culib_present() }
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}
