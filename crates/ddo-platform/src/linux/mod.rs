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
