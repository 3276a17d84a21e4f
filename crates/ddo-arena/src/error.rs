//! Arena errors.

use ddo_core::{ByteSize, DeviceError, SourceError, UnitId};

use crate::Lease;

/// What went wrong in the arena. Every variant says what to change where the user can.
#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    /// The budget cannot hold the pinned units plus two execution slots (and the staging
    /// buffers of device conversions and decodes).
    #[error(
        "GPU budget of {} ({} after {} of headroom) is too small: the resident units{} need at least {} (largest unit {}); raise the budget to {} or more",
        ByteSize(*budget), ByteSize(budget.saturating_sub(*headroom)), ByteSize(*headroom), besides(*streams, *staging), ByteSize(*needed), ByteSize(*largest_unit), ByteSize(needed.saturating_add(*headroom))
    )]
    BudgetTooSmall {
        /// The budget.
        budget: u64,
        /// Headroom declared inside it.
        headroom: u64,
        /// The smallest working set.
        needed: u64,
        /// The largest unit (mapped size).
        largest_unit: u64,
        /// Bytes of the staging buffers inside `needed`.
        staging: u64,
        /// Some unit can stream (two execution slots are inside `needed`).
        streams: bool,
    },
    /// A unit specification that cannot be laid out.
    #[error("invalid units: {0}")]
    InvalidUnits(String),
    /// A unit id outside the arena.
    #[error("unit {} does not exist; the arena has {count} units", .unit.0)]
    NoSuchUnit {
        /// The id.
        unit: UnitId,
        /// Units in the arena.
        count: usize,
    },
    /// Every slot a unit can use holds a live lease.
    #[error(
        "unit {} needs slot {slot}, which is leased by unit {holder}; release leases in execution order (at most {slots} streamed units can be held at once)",
        .unit.0
    )]
    SlotBusy {
        /// The unit asked for.
        unit: UnitId,
        /// Its slot.
        slot: u32,
        /// The unit holding it.
        holder: u32,
        /// Slots in the arena.
        slots: u32,
    },
    /// Memory whose release could not be proven safe; it is kept and never reused.
    #[error("{what}: {} is retained unsafe after a failed release and cannot be used", ByteSize(*retained))]
    Unsafe {
        /// What is unsafe.
        what: String,
        /// Bytes retained.
        retained: u64,
    },
    /// Close refused: live leases or unsafe memory.
    #[error(
        "close refused: {live_leases} live lease(s), {} retained unsafe; release every lease first (retained memory is never freed by force)",
        ByteSize(*retained)
    )]
    CloseRefused {
        /// Leases not released.
        live_leases: u32,
        /// Bytes retained unsafe.
        retained: u64,
    },
    /// A lease given back to an arena that did not grant it; the lease is returned unchanged
    /// ([`ArenaError::into_foreign_lease`]) so it can still be released to its own arena.
    #[error(
        "a lease of unit {} from another arena was given back here; release it to the arena that granted it",
        .lease.unit().0
    )]
    ForeignLease {
        /// The lease, still live in the arena that granted it.
        lease: Lease,
    },
    /// Leases of other arenas given back together ([`Arena::release_all`](crate::Arena::release_all));
    /// every one is returned unchanged ([`ArenaError::into_foreign_leases`]).
    #[error(
        "{} lease(s) from another arena were given back here (the first of unit {}); release them to the arena that granted them",
        .leases.len(),
        .leases.first().map_or(0, |l| l.unit().0)
    )]
    ForeignLeases {
        /// The leases, still live in the arena that granted them.
        leases: Vec<Lease>,
    },
    /// The arena is closed.
    #[error("the arena is closed")]
    Closed,
    /// A device port failed during `op`.
    #[error("{op}: {source}")]
    Device {
        /// What the arena was doing.
        op: &'static str,
        /// The port's error.
        #[source]
        source: DeviceError,
    },
    /// The weight source failed.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// An error whose cleanup also failed; the original error comes first and is the source.
    #[error("{error} (cleanup also failed: {cleanup})")]
    WithCleanup {
        /// The original error.
        #[source]
        error: Box<ArenaError>,
        /// The cleanup's error, attached.
        cleanup: Box<ArenaError>,
    },
}

impl ArenaError {
    /// The original error (for [`ArenaError::WithCleanup`], the one before cleanup).
    pub fn original(&self) -> &ArenaError {
        match self {
            ArenaError::WithCleanup { error, .. } => error.original(),
            e => e,
        }
    }

    /// The lease of a refused [`ArenaError::ForeignLease`], to release to the arena that
    /// granted it; `None` for every other error.
    pub fn into_foreign_lease(self) -> Option<Lease> {
        match self {
            ArenaError::ForeignLease { lease } => Some(lease),
            _ => None,
        }
    }

    /// Every lease a refused [`ArenaError::ForeignLease`] or [`ArenaError::ForeignLeases`]
    /// hands back; empty for every other error.
    pub fn into_foreign_leases(self) -> Vec<Lease> {
        match self {
            ArenaError::ForeignLease { lease } => vec![lease],
            ArenaError::ForeignLeases { leases } => leases,
            _ => Vec::new(),
        }
    }
}

/// What the working set holds besides the resident units, for [`ArenaError::BudgetTooSmall`].
fn besides(streams: bool, staging: u64) -> String {
    let slots = if streams { "two execution slots" } else { "" };
    if staging == 0 {
        return if streams { format!(" and {slots}") } else { String::new() };
    }
    let staging = format!(
        "{} of staging buffers (for tensors converted or decoded on the device)",
        ByteSize(staging)
    );
    if streams { format!(", {slots} and {staging}") } else { format!(" and {staging}") }
}

/// Wraps a port error with what the arena was doing.
pub(crate) fn device(op: &'static str) -> impl FnOnce(DeviceError) -> ArenaError {
    move |source| ArenaError::Device { op, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_message_with_a_huge_headroom_does_not_wrap() {
        let e = ArenaError::BudgetTooSmall {
            budget: 10 << 20,
            headroom: u64::MAX - 1,
            needed: 5 << 20,
            largest_unit: 1 << 20,
            staging: 0,
            streams: true,
        };
        // Saturates at the largest byte count instead of wrapping to a small one.
        assert!(e.to_string().ends_with("raise the budget to 17179869184.00 GiB or more"), "{e}");
    }
}
