//! The host tier of a checkpoint no setting places: its mapping, retained windows with the
//! rest read from disk, or the disk alone, from what host memory admits.

use std::collections::HashSet;

use ddo_core::{Admission, ByteSize, GrowthKind, GrowthRequest, RefusalReason};
use ddo_source::Checkpoint;

use super::{ComponentSession, gib};
use crate::SessionError;

/// Retained windows of the automatic host tier hold at least this much (or a quarter of the
/// checkpoint), else the disk serves it all.
const MIN_RETAINED: u64 = 1 << 30;

/// Host memory the automatic retained tier leaves beside its windows and staging (or an
/// eighth of the checkpoint, when smaller).
const TIER_SLACK: u64 = 256 << 20;

/// The host tier a checkpoint no setting places is served from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HostTier {
    /// The checkpoint's mapping, page-locked.
    Mapping,
    /// Retained windows of this many bytes, the rest read from disk into `staging` bytes of
    /// staging.
    Retained {
        /// Bytes of retained windows.
        windows: u64,
        /// Bytes of staging for the rest.
        staging: u64,
    },
    /// Every pass read from disk into two staging buffers of `buffer` bytes.
    Disk {
        /// Bytes of one staging buffer.
        buffer: u64,
    },
}

/// The host-memory bound a refusal met, in a few words.
fn host_bound(reason: &RefusalReason) -> String {
    match reason {
        RefusalReason::MemAvailable { available, margin } => {
            format!("MemAvailable ({}, {} kept free)", ByteSize(*available), ByteSize(*margin))
        }
        RefusalReason::Commit { commit_limit, committed, margin } => format!(
            "the commit limit leaves ({} of {}, {} kept free)",
            ByteSize(commit_limit.saturating_sub(*committed)),
            ByteSize(*commit_limit),
            ByteSize(*margin)
        ),
        RefusalReason::Cgroup { cgroup, limit, current, margin } => format!(
            "cgroup {cgroup} allows ({} with {} in use, {} kept free)",
            ByteSize(*limit),
            ByteSize(*current),
            ByteSize(*margin)
        ),
        RefusalReason::AddressSpace { limit, vm_size } => {
            format!("RLIMIT_AS leaves ({} with {} mapped)", ByteSize(*limit), ByteSize(*vm_size))
        }
        RefusalReason::Memlock { limit, locked } => format!(
            "RLIMIT_MEMLOCK leaves ({} with {} locked)",
            ByteSize(*limit),
            ByteSize(*locked)
        ),
        RefusalReason::ObservationUnavailable { what, error } => format!("{what}: {error}"),
    }
}

/// The host tier chosen, and the reason the profile shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct TierChoice {
    pub(super) tier: HostTier,
    pub(super) why: String,
}

/// What host memory leaves once the whole checkpoint was refused: asked of the host only then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TierRoom {
    /// Room the host admits with nothing more asked.
    pub(super) room: u64,
    /// Bytes of one staging buffer: the larger of `vmm_staging_buffer_gb` and the largest unit.
    pub(super) buffer: u64,
}

/// The host tier of a checkpoint no setting places, from what host memory admits now (`whole`:
/// the answer for its `bytes` streamed as stored; `rest`: what is left, asked only when `whole`
/// was refused):
/// - the **mapping**, page-locked whole, when the host can hold the bytes streamed as stored
///   (pinned file pages leave the page cache's reclaimable memory, so they are asked for
///   like retained bytes);
/// - else **retained windows** of what the host can hold beside staging (two buffers) and a
///   slack, the rest read from disk into staging every pass, when that holds at least
///   [`MIN_RETAINED`] (or a quarter of the bytes);
/// - else the **disk**: every pass read into those two staging buffers.
///
/// A host whose memory cannot be observed keeps the mapping, and says so.
pub(super) fn choose_host_tier(
    bytes: u64,
    whole: Admission,
    rest: impl FnOnce() -> Result<TierRoom, SessionError>,
) -> Result<TierChoice, SessionError> {
    let shown = ByteSize(bytes);
    let refusal = match whole {
        Admission::Granted { headroom } => {
            return Ok(TierChoice {
                tier: HostTier::Mapping,
                why: format!(
                    "mapping: the host can hold the checkpoint's {shown} page-locked ({} left beside it)",
                    ByteSize(headroom)
                ),
            });
        }
        Admission::Refused(r) => r,
    };
    let bound = host_bound(&refusal.reason);
    if matches!(refusal.reason, RefusalReason::ObservationUnavailable { .. }) {
        return Ok(TierChoice {
            tier: HostTier::Mapping,
            why: format!(
                "mapping: host memory cannot be observed ({bound}); set vmm_source_cache_gb, or preset nvme_baseline, to bound host memory"
            ),
        });
    }
    let TierRoom { room, buffer } = rest()?;
    // Staging of two buffers, each holding the largest unit, so reads run ahead of uploads.
    let staging = buffer.saturating_mul(2);
    let windows = room.saturating_sub(staging).saturating_sub(TIER_SLACK.min(bytes / 8));
    if windows >= MIN_RETAINED.min(bytes / 4) && windows > 0 {
        return Ok(TierChoice {
            tier: HostTier::Retained { windows, staging },
            why: format!(
                "retained windows of {} + disk: page-locking the checkpoint's {shown} mapping needs more host memory than {bound}; {} is retained and the rest read from disk into {} of staging every pass",
                ByteSize(windows),
                ByteSize(windows),
                ByteSize(staging)
            ),
        });
    }
    Ok(TierChoice {
        tier: HostTier::Disk { buffer },
        why: format!(
            "disk: page-locking the checkpoint's {shown} mapping needs more host memory than {bound}, and the {} it leaves holds no retained window beside staging; every pass reads the checkpoint from disk into {} of staging",
            ByteSize(room),
            ByteSize(staging)
        ),
    })
}

impl ComponentSession {
    /// The host tier of `checkpoint` (the tensors not in `skip`), as [`choose_host_tier`]
    /// decides from this host's admission now.
    pub(super) fn host_tier(
        &self,
        checkpoint: &Checkpoint,
        skip: &HashSet<usize>,
    ) -> Result<TierChoice, SessionError> {
        let p = &self.target.platform;
        let s = &self.plan.settings;
        let bytes: u64 = checkpoint
            .slices()
            .iter()
            .enumerate()
            .filter(|(i, _)| !skip.contains(i))
            .map(|(_, t)| t.len)
            .sum();
        let ask = |bytes| {
            p.admission.admit(&GrowthRequest {
                kind: GrowthKind::Retained,
                bytes,
                registered_bytes: 0,
            })
        };
        choose_host_tier(bytes, ask(bytes), || {
            let room = match ask(0) {
                Admission::Granted { headroom } => headroom,
                Admission::Refused(_) => 0,
            };
            let setting = gib("vmm_staging_buffer_gb", s.vmm_staging_buffer_gb)?;
            let buffer = setting.max(self.largest_unit(checkpoint)?.next_multiple_of(1 << 20));
            Ok(TierRoom { room, buffer })
        })
    }
}

#[cfg(test)]
mod tests {
    use ddo_core::{Refusal, RefusalReason};

    use super::*;

    const GIB: u64 = 1 << 30;

    fn refused(reason: RefusalReason) -> Admission {
        let request = GrowthRequest { kind: GrowthKind::Retained, bytes: 1, registered_bytes: 0 };
        Admission::Refused(Refusal { request, reason })
    }

    fn short() -> Admission {
        refused(RefusalReason::MemAvailable { available: GIB, margin: 0 })
    }

    fn unasked() -> Result<TierRoom, SessionError> {
        panic!("the room is asked for only after a refusal")
    }

    #[test]
    fn a_host_that_holds_the_checkpoint_maps_it() {
        let c = choose_host_tier(8 * GIB, Admission::Granted { headroom: GIB }, unasked).unwrap();
        assert_eq!(c.tier, HostTier::Mapping);
        assert!(c.why.starts_with("mapping: the host can hold"), "{}", c.why);
    }

    #[test]
    fn a_host_that_cannot_be_observed_keeps_the_mapping() {
        let whole = refused(RefusalReason::ObservationUnavailable {
            what: "/proc/meminfo MemAvailable".into(),
            error: "gone".into(),
        });
        let c = choose_host_tier(8 * GIB, whole, unasked).unwrap();
        assert_eq!(c.tier, HostTier::Mapping);
        assert!(c.why.contains("cannot be observed"), "{}", c.why);
    }

    #[test]
    fn room_beside_staging_is_retained_and_the_rest_read_from_disk() {
        let room = TierRoom { room: 6 * GIB, buffer: GIB / 2 };
        let c = choose_host_tier(8 * GIB, short(), || Ok(room)).unwrap();
        // 6 GiB less two 512 MiB buffers less the 256 MiB slack.
        let windows = 6 * GIB - GIB - (256 << 20);
        assert_eq!(c.tier, HostTier::Retained { windows, staging: GIB });
        assert!(c.why.contains("MemAvailable"), "{}", c.why);
    }

    #[test]
    fn too_little_room_for_a_window_reads_every_pass_from_disk() {
        // A quarter of 8 GiB is more than 1 GiB: windows need at least 1 GiB.
        let room = TierRoom { room: 2 * GIB, buffer: GIB / 2 };
        let c = choose_host_tier(8 * GIB, short(), || Ok(room)).unwrap();
        assert_eq!(c.tier, HostTier::Disk { buffer: GIB / 2 });
        let nothing = TierRoom { room: 0, buffer: GIB / 2 };
        let c = choose_host_tier(8 * GIB, short(), || Ok(nothing)).unwrap();
        assert_eq!(c.tier, HostTier::Disk { buffer: GIB / 2 });
    }

    #[test]
    fn a_small_checkpoint_needs_only_a_quarter_of_itself_retained() {
        // 400 MiB: slack of 50 MiB, a window of at least 100 MiB.
        let bytes = 400 << 20;
        let room = TierRoom { room: (64 + 50 + 100) << 20, buffer: 32 << 20 };
        let c = choose_host_tier(bytes, short(), || Ok(room)).unwrap();
        assert_eq!(c.tier, HostTier::Retained { windows: 100 << 20, staging: 64 << 20 });
    }
}
