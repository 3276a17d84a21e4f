//! The CUDA adapter, in three layers as in cudarc: raw bindings ([`sys`], cudarc's, loaded at
//! run time), one checked function per driver call ([`result`]), and [`CudaDevice`], which owns
//! the handles and implements the device ports.
//!
//! It uses the device's primary context, so memory, streams and events interoperate with PyTorch
//! in the same process. Before any driver call it checks that the driver library exists; without
//! it every entry point answers [`ddo_core::DeviceError::DriverNotFound`] instead of panicking.

mod device;
pub mod result;

pub use cudarc::driver::sys;
pub use device::CudaDevice;

/// Whether a CUDA driver library can be loaded on this machine. Never panics.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library by its usual names; no symbol is called.
    unsafe { sys::is_culib_present() }
}
