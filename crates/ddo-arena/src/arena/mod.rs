//! The arena: stable device ranges for every unit, resident units under the budget, streamed
//! units cycled through fenced slots, prefetch in the learned order.
//!
//! One concern per module: `build` lays out, reserves and maps; `leases` hands units out and
//! takes them back; `upload` fills a unit's range (reading the source with the lock released);
//! `prefetch` uploads ahead in the `order` learned; `peer` keeps streamed units in a peer
//! device's memory; `lifecycle` reclaims idle slots and closes; `state` is what the one lock
//! guards.

mod build;
mod leases;
mod lifecycle;
mod order;
mod peer;
mod prefetch;
mod state;
mod upload;

use std::sync::{Arc, Condvar, Mutex};

use ddo_core::{DeviceRange, Platform, Reservation, StreamId, UnitId, WeightSource};

pub use leases::Lease;
pub use lifecycle::{ReclaimReport, drop_failure};
pub use peer::PeerStoreReport;
use state::{Holder, Locked, State};

use crate::{ArenaError, ArenaStats, Layout, ResidencyPlan};

/// A bounded GPU weight arena for one component.
///
/// Every unit owns a fixed device range inside one address reservation for the arena's life, so
/// tensor views are built once. Resident units keep their own physical backing; each streamed
/// unit is assigned one execution slot, whose backing is mapped at the ranges of all units
/// assigned to it, and uploads land there when the unit's turn comes. Reuse of a slot waits, on
/// the device, for every consumer fence recorded since its last upload; freeing or unmapping
/// waits for a host-observed fence; a failure on any release path retains the memory as unsafe.
///
/// One lock guards the arena's state; it is never held while the source is read (an upload
/// takes what it needs under it, reads and enqueues its copies without it, and commits under
/// it again).
pub struct Arena {
    /// This arena's identity (leases carry it).
    id: u64,
    platform: Platform,
    source: Arc<dyn WeightSource>,
    layout: Layout,
    plan: ResidencyPlan,
    reservation: Reservation,
    copy_stream: StreamId,
    /// Where device conversions run (with a staging buffer): on their own stream, so the next
    /// unit's copies start while the last unit's conversions run.
    convert_stream: Option<StreamId>,
    /// Units in attach order: the expected order until one is learned.
    attach_order: Arc<[UnitId]>,
    state: Mutex<State>,
    /// Signalled when an upload or a fill of the peer store commits.
    changed: Condvar,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("platform", &self.platform.name)
            .field("units", &self.layout.units.len())
            .field("plan", &self.plan)
            .finish_non_exhaustive()
    }
}

impl Arena {
    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The residency plan.
    pub fn plan(&self) -> &ResidencyPlan {
        &self.plan
    }

    /// The platform's name.
    pub fn platform_name(&self) -> &'static str {
        self.platform.name
    }

    /// The stream uploads run on.
    pub fn copy_stream(&self) -> StreamId {
        self.copy_stream
    }

    /// The fixed device range of `unit`.
    pub fn unit_range(&self, unit: UnitId) -> Result<DeviceRange, ArenaError> {
        let u = self.unit(unit)?;
        Ok(DeviceRange { start: self.reservation.range.start.offset(u.offset), len: u.len })
    }

    /// The fixed device range of tensor `slice` (an index into the source), if a unit holds it.
    pub fn tensor_range(&self, slice: usize) -> Option<(UnitId, DeviceRange)> {
        self.layout.units.iter().find_map(|u| {
            let t = u.tensors.iter().find(|t| t.slice == slice)?;
            let start = self.reservation.range.start.offset(u.offset + t.offset);
            Some((u.id, DeviceRange { start, len: t.len }))
        })
    }

    /// A copy of the counters.
    pub fn stats(&self) -> ArenaStats {
        let state = self.lock();
        let mut stats = state.stats;
        // Measured by the device while its stream lives; a close keeps the last totals.
        if let Some(stream) = self.convert_stream
            && !state.closed
        {
            stats.decode_seconds = self.platform.residency.decode_totals(stream).1;
        }
        stats
    }

    /// Checks the source's files fully (a path renamed over included): uploads check only
    /// what is cheap (the open files' status), so whoever runs passes calls this once per pass.
    pub fn check_source(&self) -> Result<(), ArenaError> {
        Ok(self.source.check_unchanged()?)
    }

    fn lock(&self) -> Locked<'_> {
        Locked::new(&self.state, &self.changed)
    }

    fn unit(&self, unit: UnitId) -> Result<&crate::UnitLayout, ArenaError> {
        self.layout
            .units
            .get(unit.0 as usize)
            .ok_or(ArenaError::NoSuchUnit { unit, count: self.layout.units.len() })
    }

    /// The device bytes `unit`'s holder keeps: its slot's, or its own when resident.
    fn holder_len(&self, unit: UnitId) -> u64 {
        match self.plan.slot_of[unit.0 as usize] {
            Some(_) => self.plan.slot_len,
            None => self.layout.units[unit.0 as usize].len,
        }
    }

    /// The holder of `unit`'s bytes: its slot's, or its own when resident.
    fn holder_mut<'s>(&self, state: &'s mut State, unit: UnitId) -> &'s mut Holder {
        match self.plan.slot_of[unit.0 as usize] {
            Some(s) => &mut state.slots[s.0 as usize].holder,
            None => &mut state.residents[unit.0 as usize].holder,
        }
    }
}
