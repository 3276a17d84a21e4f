//! The Linux [`AdmissionProbe`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ddo_core::{
    Admission, AdmissionProbe, GIB, GrowthRequest, HostMemoryObservation, OvercommitMode, Refusal,
    RefusalReason,
};

use super::cgroup::memory_levels;
use super::procfs::{Limits, Status, parse_limits, parse_meminfo, parse_overcommit, parse_status};

/// Host memory kept free by default when admitting growth: 1 GiB.
pub const DEFAULT_SAFETY_MARGIN: u64 = GIB;

/// Admits host growth on fresh observations of `/proc`, cgroups (v2, or the v1 memory
/// hierarchy) and rlimits.
///
/// Decisions, for a request of `bytes`:
/// - memory growth (retained storage, staging): `MemAvailable - margin >= bytes` in every
///   overcommit mode (modes 0 and 1 keep this finite bound); in mode 2 also
///   `CommitLimit - Committed_AS - margin >= bytes`; for every cgroup level with a memory
///   controller, `min(memory.max, memory.high) - (memory.current - inactive_file) - margin >= bytes`
///   (the margin capped at an eighth of the limit); with a finite
///   RLIMIT_AS, `VmSize + bytes <= limit`;
/// - page-locking (staging, registration): with a finite RLIMIT_MEMLOCK and no CAP_IPC_LOCK,
///   `VmLck + registered_bytes + bytes <= limit`.
///
/// A required file that cannot be read refuses with [`RefusalReason::ObservationUnavailable`];
/// a missing cgroup memory controller or an unlimited rlimit is no limit.
#[derive(Debug, Clone)]
pub struct LinuxAdmissionProbe {
    root: PathBuf,
    margin: u64,
}

impl LinuxAdmissionProbe {
    /// A probe of this machine (root `/`) with the default margin.
    pub fn system() -> Self {
        Self::with_root("/")
    }

    /// A probe reading every file under `root` (a fixture tree in tests).
    pub fn with_root(root: impl Into<PathBuf>) -> Self {
        LinuxAdmissionProbe { root: root.into(), margin: DEFAULT_SAFETY_MARGIN }
    }

    /// Sets the bytes kept free under every memory bound.
    pub fn with_safety_margin(mut self, margin: u64) -> Self {
        self.margin = margin;
        self
    }

    /// The safety margin in bytes.
    pub fn safety_margin(&self) -> u64 {
        self.margin
    }

    /// The root directory files are read under.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn read(&self, rel: &str) -> Result<String, (String, String)> {
        std::fs::read_to_string(self.root.join(rel)).map_err(|e| (format!("/{rel}"), e.to_string()))
    }

    fn meminfo(&self) -> Result<HashMap<String, u64>, (String, String)> {
        self.read("proc/meminfo").map(|t| parse_meminfo(&t))
    }

    fn overcommit(&self) -> Result<OvercommitMode, (String, String)> {
        let text = self.read("proc/sys/vm/overcommit_memory")?;
        parse_overcommit(&text).map_err(|e| ("/proc/sys/vm/overcommit_memory".into(), e))
    }

    fn status(&self) -> Result<Status, (String, String)> {
        self.read("proc/self/status").map(|t| parse_status(&t))
    }

    fn limits(&self) -> Result<Limits, (String, String)> {
        let text = self.read("proc/self/limits")?;
        parse_limits(&text).map_err(|e| ("/proc/self/limits".into(), e))
    }

    /// The bounds a request must fit, as `(room before the request, reason if exceeded)`.
    fn bounds(
        &self,
        request: &GrowthRequest,
    ) -> Result<Vec<(u64, RefusalReason)>, (String, String)> {
        let margin = self.margin;
        let mut bounds = Vec::new();
        if request.kind.allocates() {
            let meminfo = self.meminfo()?;
            let field = |name: &str| {
                meminfo
                    .get(name)
                    .copied()
                    .ok_or_else(|| (format!("/proc/meminfo {name}"), "field missing".to_owned()))
            };
            let available = field("MemAvailable")?;
            bounds.push((
                available.saturating_sub(margin),
                RefusalReason::MemAvailable { available, margin },
            ));
            if self.overcommit()? == OvercommitMode::Strict {
                let commit_limit = field("CommitLimit")?;
                let committed = field("Committed_AS")?;
                bounds.push((
                    commit_limit.saturating_sub(committed).saturating_sub(margin),
                    RefusalReason::Commit { commit_limit, committed, margin },
                ));
            }
            for level in memory_levels(&self.root)? {
                if let Some(limit) = level.limit() {
                    // A small cgroup keeps an eighth of its limit free, not the host's margin.
                    let margin = margin.min(limit / 8);
                    // Inactive page cache (a checkpoint read through the cache) is reclaimed
                    // before the kernel refuses; it is room, not use.
                    let held = level.held();
                    let room = limit.saturating_sub(held).saturating_sub(margin);
                    bounds.push((
                        room,
                        RefusalReason::Cgroup { cgroup: level.path, limit, current: held, margin },
                    ));
                }
            }
            if let Some(limit) = self.limits()?.address_space {
                let vm_size = self.status()?.vm_size.ok_or_else(|| {
                    ("/proc/self/status VmSize".to_owned(), "field missing".to_owned())
                })?;
                bounds.push((
                    limit.saturating_sub(vm_size),
                    RefusalReason::AddressSpace { limit, vm_size },
                ));
            }
        }
        if request.kind.locks()
            && let Some(limit) = self.limits()?.locked_memory
        {
            let status = self.status()?;
            if !status.can_lock_without_limit() {
                let vm_lck = status.vm_lck.ok_or_else(|| {
                    ("/proc/self/status VmLck".to_owned(), "field missing".to_owned())
                })?;
                let locked = vm_lck.saturating_add(request.registered_bytes);
                bounds
                    .push((limit.saturating_sub(locked), RefusalReason::Memlock { limit, locked }));
            }
        }
        Ok(bounds)
    }
}

impl AdmissionProbe for LinuxAdmissionProbe {
    fn admit(&self, request: &GrowthRequest) -> Admission {
        let refuse = |reason| Admission::Refused(Refusal { request: *request, reason });
        match self.bounds(request) {
            Err((what, error)) => refuse(RefusalReason::ObservationUnavailable { what, error }),
            Ok(bounds) => {
                if let Some((_, reason)) = bounds.iter().find(|(room, _)| *room < request.bytes) {
                    return refuse(reason.clone());
                }
                let headroom =
                    bounds.iter().map(|(room, _)| room - request.bytes).min().unwrap_or(u64::MAX);
                Admission::Granted { headroom }
            }
        }
    }

    fn observe(&self) -> HostMemoryObservation {
        let meminfo = self.meminfo().unwrap_or_default();
        let status = self.status().ok();
        let limits = self.limits().ok();
        HostMemoryObservation {
            rss_bytes: status.as_ref().and_then(|s| s.vm_rss),
            peak_rss_bytes: status.as_ref().and_then(|s| s.vm_hwm),
            locked_bytes: status.as_ref().and_then(|s| s.vm_lck),
            mem_total_bytes: meminfo.get("MemTotal").copied(),
            mem_available_bytes: meminfo.get("MemAvailable").copied(),
            commit_limit_bytes: meminfo.get("CommitLimit").copied(),
            committed_bytes: meminfo.get("Committed_AS").copied(),
            overcommit_mode: self.overcommit().ok(),
            cgroups: memory_levels(&self.root).unwrap_or_default(),
            rlimit_as_bytes: limits.and_then(|l| l.address_space),
            rlimit_memlock_bytes: limits.and_then(|l| l.locked_memory),
            rlimits_observed: limits.is_some(),
        }
    }
}
