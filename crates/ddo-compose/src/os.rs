//! What the operating system says: WSL, and host memory through the Linux probe.

use std::sync::Arc;

use ddo_core::{Admission, AdmissionProbe, GrowthKind, GrowthRequest, HostMemoryObservation};
use ddo_platform::LinuxAdmissionProbe;

/// Whether this Linux kernel is WSL's (`/proc/version` names Microsoft or WSL).
pub fn running_on_wsl() -> bool {
    std::fs::read_to_string("/proc/version").is_ok_and(|v| names_wsl(&v))
}

/// Whether a `/proc/version` line names Microsoft or WSL.
fn names_wsl(version: &str) -> bool {
    let v = version.to_ascii_lowercase();
    v.contains("microsoft") || v.contains("wsl")
}

/// This host's admission probe (`/proc`, cgroup v2, rlimits), keeping `margin` bytes free, or
/// the probe's default margin when `None`.
pub fn host_admission(margin: Option<u64>) -> Arc<dyn AdmissionProbe> {
    let probe = LinuxAdmissionProbe::system();
    match margin {
        Some(margin) => Arc::new(probe.with_safety_margin(margin)),
        None => Arc::new(probe),
    }
}

/// Host bytes this process may still take keeping `margin` free (available memory, strict
/// overcommit, cgroup limits), as the admission probe decides now; `None` when host memory
/// cannot be observed.
pub fn host_room(margin: u64) -> Option<u64> {
    let request = GrowthRequest { kind: GrowthKind::Retained, bytes: 0, registered_bytes: 0 };
    match host_admission(Some(margin)).admit(&request) {
        Admission::Granted { headroom } => Some(headroom),
        Admission::Refused(_) => None,
    }
}

/// This host's memory as the admission probe observes it now.
pub fn observe_host_memory() -> HostMemoryObservation {
    LinuxAdmissionProbe::system().observe()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wsl_kernels_are_named_by_their_version_line() {
        assert!(names_wsl("Linux version 5.15.167.4-microsoft-standard-WSL2 (root@...)"));
        assert!(names_wsl("Linux version 4.4.0-19041-Microsoft"));
        assert!(!names_wsl("Linux version 6.8.0-49-generic (buildd@lcy02-amd64-103)"));
    }
}
