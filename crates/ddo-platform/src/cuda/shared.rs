//! Host registrations shared by every device of the process.
//!
//! `cuMemHostRegister` with `PORTABLE` page-locks memory for every context of the process, and
//! the driver refuses to register the same memory twice. So the first device to register a range
//! registers it, later devices (and later sessions on the same device) hold the same
//! registration, and the last holder unregisters it: one page-locked host copy of a checkpoint
//! feeds every GPU and component of the process. Each registration keeps a retain on the
//! primary context that made it, so it outlives that device's own handle.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::driver::result::{self as driver};

use ddo_core::DeviceError;

use super::error::{CudaError, Named};
use super::result::host_memory;
use super::sys;

#[derive(Debug)]
struct Shared {
    len: usize,
    read_only: bool,
    holders: u32,
    /// The device whose primary context registered the range (retained for the registration's
    /// life) and that context.
    dev: sys::CUdevice,
    ctx: usize,
}

/// Live registrations by start address.
static REGISTRATIONS: Mutex<BTreeMap<u64, Shared>> = Mutex::new(BTreeMap::new());

fn registrations() -> std::sync::MutexGuard<'static, BTreeMap<u64, Shared>> {
    REGISTRATIONS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How [`hold`] met the range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Held {
    /// Registered now, by the calling device.
    Registered,
    /// Already registered in this process (by this or another device): one more holder.
    Shared,
}

/// Registers `len` bytes at `ptr` for the process, or joins the registration of exactly that
/// range made earlier. A range overlapping a different live registration is refused (the driver
/// cannot register it, and sharing a part would pin more than asked).
///
/// # Safety
/// 1. `ptr..ptr+len` is mapped host memory that stays mapped until the matching [`let_go`].
/// 2. `dev` is the device of the primary context current on the calling thread.
pub(crate) unsafe fn hold(
    ptr: u64,
    len: usize,
    read_only: bool,
    dev: sys::CUdevice,
) -> Result<Held, DeviceError> {
    let mut all = registrations();
    if let Some(s) = all.get_mut(&ptr)
        && s.len == len
        && (s.read_only == read_only || !s.read_only)
    {
        s.holders += 1;
        return Ok(Held::Shared);
    }
    let end = ptr.saturating_add(len as u64);
    let overlap = all
        .range(..end)
        .next_back()
        .filter(|(start, s)| **start + s.len as u64 > ptr)
        .map(|(start, s)| (*start, s.len, s.read_only));
    if let Some((start, other, ro)) = overlap {
        return Err(DeviceError::InvalidUse(format!(
            "host memory {ptr:#x}+{len} overlaps {start:#x}+{other}, which this process already \
             registered{} (another session registered its ranges of the same file differently)",
            if ro { " read-only" } else { "" }
        )));
    }
    // The registration keeps its context alive: retain it first.
    // SAFETY: `dev` is a device handle from cuDeviceGet (the caller's contract); released in
    // `let_go` or below on failure.
    let ctx = unsafe { driver::primary_ctx::retain(dev) }.named("cuDevicePrimaryCtxRetain")?;
    // SAFETY: forwarded from this function's contract.
    if let Err(e) = unsafe { host_memory::register(ptr as *mut c_void, len, read_only) } {
        // SAFETY: the retain just made.
        let _ = unsafe { driver::primary_ctx::release(dev) };
        return Err(CudaError { call: "cuMemHostRegister", code: e.0 }.into());
    }
    all.insert(ptr, Shared { len, read_only, holders: 1, dev, ctx: ctx as usize });
    Ok(Held::Registered)
}

/// Gives up one hold of the registration at `ptr`; the last holder unregisters it (in the
/// context that registered it) and releases that context. Returns whether the memory was
/// unregistered. A failed unregistration keeps the hold, so the memory stays registered and
/// allocated, and the error says why.
///
/// # Safety
/// 1. The caller holds the registration at `ptr` (a [`hold`] not yet let go).
/// 2. No device work reads the range after this hold ends, unless another holder remains.
pub(crate) unsafe fn let_go(ptr: u64) -> Result<bool, DeviceError> {
    let mut all = registrations();
    let Some(s) = all.get_mut(&ptr) else {
        return Err(DeviceError::InvalidUse(format!("host memory at {ptr:#x} is not registered")));
    };
    if s.holders > 1 {
        s.holders -= 1;
        return Ok(false);
    }
    let (dev, ctx) = (s.dev, s.ctx);
    // Unregistered in the context that registered it; the caller's context is current again after.
    let current = driver::ctx::get_current().named("cuCtxGetCurrent")?;
    // SAFETY: `ctx` is retained by this registration.
    unsafe { driver::ctx::set_current(ctx as sys::CUcontext) }.named("cuCtxSetCurrent")?;
    // SAFETY: registered by `hold` and still held, by the last holder (the caller).
    let unregistered =
        unsafe { host_memory::unregister(ptr as *mut c_void) }.named("cuMemHostUnregister");
    if let Some(c) = current {
        // SAFETY: the context current before, which the caller holds.
        let _ = unsafe { driver::ctx::set_current(c) };
    }
    unregistered?;
    all.remove(&ptr);
    // SAFETY: the retain made when the range was registered.
    let _ = unsafe { driver::primary_ctx::release(dev) };
    Ok(true)
}

/// Holders of the process's registration at `ptr` (0 when none).
pub fn holders(ptr: u64) -> u32 {
    registrations().get(&ptr).map_or(0, |s| s.holders)
}

/// Whether exactly `len` bytes at `ptr` are registered in this process.
pub(crate) fn registered(ptr: u64, len: usize) -> bool {
    registrations().get(&ptr).is_some_and(|s| s.len == len)
}
