//! Reads from a mapped file that shrinks must not kill the process.
//!
//! A read of a mapped page past the end of its (truncated) file raises SIGBUS. For the address
//! ranges of ddo's own mappings, a process-wide handler maps a zero page over the faulting page
//! and notes the fault; the read then completes (with zeros) and the mapping's owner turns the
//! note into an error before the bytes are used. A SIGBUS anywhere else goes to the handler that
//! was installed before, or kills the process as it would have.

use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Guarded ranges at once (a mapping beyond them is read unguarded, as before).
const SLOTS: usize = 256;

struct Slot {
    start: AtomicUsize,
    len: AtomicUsize,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot =
    Slot { start: AtomicUsize::new(0), len: AtomicUsize::new(0), faulted: AtomicBool::new(false) };
static RANGES: [Slot; SLOTS] = [EMPTY; SLOTS];
static PAGE: AtomicUsize = AtomicUsize::new(4096);
static INSTALL: Once = Once::new();
/// The action SIGBUS had before ours; written once, before ours is installed.
static mut PREVIOUS: Option<libc::sigaction> = None;

/// A guarded address range; dropping it ends the guard.
#[derive(Debug)]
pub(crate) struct FaultGuard {
    slot: Option<usize>,
}

impl FaultGuard {
    /// Guards the `len` bytes at `start` (a mapping this process owns for the guard's life).
    pub(crate) fn new(start: *const u8, len: usize) -> FaultGuard {
        if len == 0 {
            return FaultGuard { slot: None };
        }
        INSTALL.call_once(install);
        for (i, s) in RANGES.iter().enumerate() {
            if s.start.load(Ordering::Acquire) == 0 && s.len.load(Ordering::Acquire) == 0 {
                // Claim by length first; the handler only matches a slot once its start is set.
                if s.len.compare_exchange(0, len, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    s.faulted.store(false, Ordering::Release);
                    s.start.store(start as usize, Ordering::Release);
                    return FaultGuard { slot: Some(i) };
                }
            }
        }
        FaultGuard { slot: None }
    }

    /// Whether a read faulted in the range (its file shrank) since the guard began.
    pub(crate) fn faulted(&self) -> bool {
        self.slot.is_some_and(|i| RANGES[i].faulted.load(Ordering::Acquire))
    }
}

impl Drop for FaultGuard {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            RANGES[i].start.store(0, Ordering::Release);
            RANGES[i].len.store(0, Ordering::Release);
        }
    }
}

fn install() {
    // SAFETY: sysconf and sigaction are called with valid arguments; PREVIOUS is written here,
    // once, before the handler that reads it is installed.
    unsafe {
        let page = libc::sysconf(libc::_SC_PAGESIZE);
        if page > 0 {
            PAGE.store(page as usize, Ordering::Relaxed);
        }
        let mut old: libc::sigaction = std::mem::zeroed();
        let mut new: libc::sigaction = std::mem::zeroed();
        new.sa_sigaction = on_sigbus as *const () as usize;
        new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut new.sa_mask);
        if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) == 0 {
            PREVIOUS = Some(old);
            libc::sigaction(libc::SIGBUS, &new, std::ptr::null_mut());
        }
    }
}

/// The SIGBUS handler: async-signal-safe (atomics, mmap, sigaction).
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    for s in &RANGES {
        let start = s.start.load(Ordering::Acquire);
        let len = s.len.load(Ordering::Acquire);
        if start != 0 && addr >= start && addr < start + len {
            let page = PAGE.load(Ordering::Relaxed);
            let at = addr & !(page - 1);
            // SAFETY: the page lies in a mapping the guard's owner holds; a zero page replaces
            // the lost file page, so the faulting read completes.
            let mapped = unsafe {
                libc::mmap(
                    at as *mut libc::c_void,
                    page,
                    libc::PROT_READ,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if mapped != libc::MAP_FAILED {
                s.faulted.store(true, Ordering::Release);
                return;
            }
        }
    }
    // Not ours: the handler before ours, or the default action (the read faults again and the
    // process ends as it would have).
    // SAFETY: PREVIOUS was written before this handler was installed and never again.
    let previous = unsafe { *std::ptr::addr_of!(PREVIOUS) };
    match previous {
        Some(p) if p.sa_sigaction != libc::SIG_DFL && p.sa_sigaction != libc::SIG_IGN => {
            if p.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: a SA_SIGINFO handler takes these three arguments.
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    unsafe { std::mem::transmute(p.sa_sigaction) };
                f(sig, info, ctx);
            } else {
                // SAFETY: a plain handler takes the signal number.
                let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(p.sa_sigaction) };
                f(sig);
            }
        }
        _ => {
            // SAFETY: restoring the default action for SIGBUS.
            unsafe {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            }
        }
    }
}
