//! Linux host-memory probes.
//!
//! Everything is read from files (`/proc/meminfo`, `/proc/sys/vm/overcommit_memory`,
//! `/proc/self/{status,limits,cgroup,mountinfo}`, the cgroup v2 `memory.*` files) under a root
//! directory that defaults to `/` and can point at a fixture tree. Nothing is ever written: the
//! probe never changes OS memory policy.

mod admission;
mod cgroup;
pub mod maps;
mod procfs;

pub use admission::{DEFAULT_SAFETY_MARGIN, LinuxAdmissionProbe};

/// The host's page size in bytes (4 KiB on most x86 hosts, 64 KiB on some Arm ones).
pub fn page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).ok().filter(|s| s.is_power_of_two()).unwrap_or(4096)
}
