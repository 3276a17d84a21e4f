//! The admission port: may the host take more retained, staged or registered bytes?

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ByteSize;

/// What kind of host growth is asked for. They are separate ceilings: retained storage and
/// staging consume host RAM (and commit); registration page-locks bytes that already exist.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GrowthKind {
    /// Host bytes retained independently of any loader tensor (the retained source store).
    Retained,
    /// Staging buffers (allocated and registered).
    Staging,
    /// Page-locking existing bytes for DMA.
    Registration,
}

impl GrowthKind {
    fn describe(self) -> &'static str {
        match self {
            GrowthKind::Retained => "retained host storage",
            GrowthKind::Staging => "host staging",
            GrowthKind::Registration => "host registration",
        }
    }

    /// Whether the growth allocates new host memory (as opposed to locking existing memory).
    pub fn allocates(self) -> bool {
        matches!(self, GrowthKind::Retained | GrowthKind::Staging)
    }

    /// Whether the growth page-locks memory.
    pub fn locks(self) -> bool {
        matches!(self, GrowthKind::Staging | GrowthKind::Registration)
    }
}

/// A request to grow host usage by `bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GrowthRequest {
    /// What grows.
    pub kind: GrowthKind,
    /// By how many bytes.
    pub bytes: u64,
    /// Bytes this process already holds registered (page-locked) through ddo, for the
    /// RLIMIT_MEMLOCK bound (the kernel does not always show them as locked).
    pub registered_bytes: u64,
}

/// Why growth was refused. Each variant carries the observation that decided it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum RefusalReason {
    /// `MemAvailable` minus the safety margin is smaller than the request.
    MemAvailable {
        /// MemAvailable in bytes.
        available: u64,
        /// Safety margin kept free.
        margin: u64,
    },
    /// Strict overcommit (mode 2): `CommitLimit - Committed_AS` minus the margin is too small.
    Commit {
        /// CommitLimit.
        commit_limit: u64,
        /// Committed_AS.
        committed: u64,
        /// Safety margin.
        margin: u64,
    },
    /// A cgroup v2 memory limit (`memory.max` or `memory.high`) leaves too little headroom.
    Cgroup {
        /// The cgroup path.
        cgroup: String,
        /// The tighter of memory.max and memory.high.
        limit: u64,
        /// What the level holds: memory.current less its inactive file cache.
        current: u64,
        /// Safety margin.
        margin: u64,
    },
    /// RLIMIT_AS would be exceeded.
    AddressSpace {
        /// The soft limit.
        limit: u64,
        /// Current VmSize.
        vm_size: u64,
    },
    /// RLIMIT_MEMLOCK would be exceeded (and the process lacks CAP_IPC_LOCK).
    Memlock {
        /// The soft limit.
        limit: u64,
        /// Bytes already locked (VmLck plus ddo's registrations).
        locked: u64,
    },
    /// An observation that should exist could not be read; growth is refused until it can be.
    ObservationUnavailable {
        /// What could not be read (`/proc/meminfo MemAvailable`).
        what: String,
        /// Why.
        error: String,
    },
}

/// A refused growth request and its reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, thiserror::Error)]
pub struct Refusal {
    /// The request.
    pub request: GrowthRequest,
    /// Why it was refused.
    pub reason: RefusalReason,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let want = ByteSize(self.request.bytes);
        let what = self.request.kind.describe();
        match &self.reason {
            RefusalReason::MemAvailable { available, margin } => write!(
                f,
                "{what} of {want} refused: MemAvailable is {} and {} is kept free; free host memory or lower the {what} ceiling",
                ByteSize(*available),
                ByteSize(*margin)
            ),
            RefusalReason::Commit { commit_limit, committed, margin } => write!(
                f,
                "{what} of {want} refused: strict overcommit (vm.overcommit_memory=2) leaves {} of commit (CommitLimit {} - Committed_AS {}, {} kept free); lower the {what} ceiling",
                ByteSize(commit_limit.saturating_sub(*committed)),
                ByteSize(*commit_limit),
                ByteSize(*committed),
                ByteSize(*margin)
            ),
            RefusalReason::Cgroup { cgroup, limit, current, margin } => write!(
                f,
                "{what} of {want} refused: cgroup {cgroup} allows {} and uses {} ({} kept free); raise the cgroup's memory limit or lower the {what} ceiling",
                ByteSize(*limit),
                ByteSize(*current),
                ByteSize(*margin)
            ),
            RefusalReason::AddressSpace { limit, vm_size } => write!(
                f,
                "{what} of {want} refused: RLIMIT_AS is {} and the process already maps {}; raise `ulimit -v` or lower the {what} ceiling",
                ByteSize(*limit),
                ByteSize(*vm_size)
            ),
            RefusalReason::Memlock { limit, locked } => write!(
                f,
                "{what} of {want} refused: RLIMIT_MEMLOCK is {} and {} is already locked; raise `ulimit -l` or lower the registration ceiling",
                ByteSize(*limit),
                ByteSize(*locked)
            ),
            RefusalReason::ObservationUnavailable { what: observed, error } => write!(
                f,
                "{what} of {want} refused: {observed} could not be read ({error}); growth is refused while host memory cannot be observed"
            ),
        }
    }
}

/// The answer to a [`GrowthRequest`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Admission {
    /// Granted; `headroom` is the tightest remaining room (bytes) after the request.
    Granted {
        /// Room left under the tightest bound after this growth.
        headroom: u64,
    },
    /// Refused.
    Refused(Refusal),
}

impl Admission {
    /// `Ok(headroom)` when granted, the refusal otherwise.
    pub fn into_result(self) -> Result<u64, Refusal> {
        match self {
            Admission::Granted { headroom } => Ok(headroom),
            Admission::Refused(r) => Err(r),
        }
    }
}

/// The kernel's overcommit policy (`/proc/sys/vm/overcommit_memory`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OvercommitMode {
    /// 0: heuristic overcommit.
    Heuristic,
    /// 1: always overcommit.
    Always,
    /// 2: strict accounting against CommitLimit.
    Strict,
}

/// Memory accounting of one cgroup level that has a memory controller (cgroup v2, or the v1
/// memory hierarchy: `memory.limit_in_bytes` as `max`, `memory.usage_in_bytes` as `current`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CgroupMemory {
    /// The cgroup path (`/user.slice/...`).
    pub path: String,
    /// memory.max (`None` = "max", no limit).
    pub max: Option<u64>,
    /// memory.high (`None` = "max").
    pub high: Option<u64>,
    /// memory.current: every page charged to the level, page cache included.
    pub current: u64,
    /// Inactive file cache charged to the level (`inactive_file` of memory.stat), which the
    /// kernel reclaims before it refuses or kills: `current` less this is what the level holds.
    #[serde(default)]
    pub reclaimable: u64,
}

impl CgroupMemory {
    /// The tighter of `max` and `high`, if any.
    pub fn limit(&self) -> Option<u64> {
        match (self.max, self.high) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The bytes the level holds and cannot drop: `current` less its reclaimable file cache.
    pub fn held(&self) -> u64 {
        self.current.saturating_sub(self.reclaimable)
    }
}

/// A snapshot of the host's memory as seen by this process. A field is `None` when it could not
/// be observed (never zero in its place).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HostMemoryObservation {
    /// Resident set size of this process (VmRSS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss_bytes: Option<u64>,
    /// Peak resident set size (VmHWM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes: Option<u64>,
    /// Locked memory of this process (VmLck).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locked_bytes: Option<u64>,
    /// MemTotal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_total_bytes: Option<u64>,
    /// MemAvailable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_available_bytes: Option<u64>,
    /// CommitLimit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit_limit_bytes: Option<u64>,
    /// Committed_AS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub committed_bytes: Option<u64>,
    /// The overcommit mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overcommit_mode: Option<OvercommitMode>,
    /// Every cgroup level with a memory controller, innermost first. Empty when there is none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cgroups: Vec<CgroupMemory>,
    /// RLIMIT_AS soft limit (`None` with `rlimits_observed` = unlimited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rlimit_as_bytes: Option<u64>,
    /// RLIMIT_MEMLOCK soft limit (`None` with `rlimits_observed` = unlimited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rlimit_memlock_bytes: Option<u64>,
    /// Whether the rlimits were read (so `None` above means unlimited).
    pub rlimits_observed: bool,
}

/// Decides whether the host can take more memory. Implementations read fresh observations on
/// every call and never change OS memory policy.
///
/// Contract:
/// - An observation that should exist but cannot be read refuses growth
///   ([`RefusalReason::ObservationUnavailable`]); a limit that does not exist (no cgroup memory
///   controller, an unlimited rlimit) is no limit.
/// - A refusal changes nothing; the caller keeps its state as it was.
#[cfg_attr(feature = "mocks", mockall::automock)]
pub trait AdmissionProbe: Send + Sync {
    /// Decides one growth request on fresh observations.
    fn admit(&self, request: &GrowthRequest) -> Admission;
    /// Observes host memory for metrics.
    fn observe(&self) -> HostMemoryObservation;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GIB;

    #[test]
    fn refusal_messages_say_what_to_change() {
        let r = Refusal {
            request: GrowthRequest {
                kind: GrowthKind::Registration,
                bytes: GIB,
                registered_bytes: 0,
            },
            reason: RefusalReason::Memlock { limit: 8 << 20, locked: 0 },
        };
        assert_eq!(
            r.to_string(),
            "host registration of 1.00 GiB refused: RLIMIT_MEMLOCK is 8.00 MiB and 0 B is already locked; raise `ulimit -l` or lower the registration ceiling"
        );
        let c = CgroupMemory {
            path: "/a".into(),
            max: Some(10),
            high: Some(5),
            current: 4,
            reclaimable: 3,
        };
        assert_eq!(c.held(), 1);
        assert_eq!(c.limit(), Some(5));
        assert_eq!(CgroupMemory { high: None, ..c }.limit(), Some(10));
    }
}
