//! Adapters of ddo's ports to real platforms.
//!
//! - [`linux`]: host-memory observation and admission from `/proc`, cgroup v2 and rlimits, read
//!   under an injectable root directory so every decision is testable on fixture trees.
//!
//! Adapters are values: a host builds them once and puts them in a [`ddo_core::Platform`].
#![forbid(unsafe_code)]

pub mod linux;

pub use linux::{DEFAULT_SAFETY_MARGIN, LinuxAdmissionProbe};
