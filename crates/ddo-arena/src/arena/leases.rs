//! Leases: a unit handed out for work on a consumer stream after its upload, and given back
//! with the fence that gates reuse of its memory.

use std::time::Instant;

use ddo_core::{DeviceRange, StreamId, UnitId};

use super::Arena;
use super::state::State;
use super::upload::Need;
use crate::ArenaError;
use crate::error::device;

/// Proof that a unit's bytes are on the device for a consumer stream. Give it back with
/// [`Arena::release`]; a lease that is never released keeps its memory from reuse forever.
#[derive(Debug)]
#[must_use = "a lease must be released, or its slot is never reused"]
pub struct Lease {
    unit: UnitId,
    range: DeviceRange,
    /// The arena that handed it out.
    arena: u64,
}

impl Lease {
    /// The unit.
    pub fn unit(&self) -> UnitId {
        self.unit
    }

    /// The unit's device range (the same on every acquisition).
    pub fn range(&self) -> DeviceRange {
        self.range
    }
}

impl Arena {
    /// Ensures `unit` is on the device for work enqueued on `consumer` after this call: uploads
    /// it if needed (waiting on the device for the slot's previous consumers), makes `consumer`
    /// wait for the upload, and prefetches the next units in the learned order.
    pub fn acquire(&self, unit: UnitId, consumer: StreamId) -> Result<Lease, ArenaError> {
        let t = Instant::now();
        let range = self.unit_range(unit)?;
        let mut state = self.lock();
        state.wait_for_fill();
        if state.closed {
            return Err(ArenaError::Closed);
        }
        let on_track = self.observe(&mut state, unit);
        let fence = self.ensure_loaded(&mut state, unit, Need::Demand)?;
        if let Some(f) = fence {
            self.platform
                .fences
                .stream_wait(consumer, f)
                .map_err(device("make the consumer wait for the upload"))?;
        }
        self.holder_mut(&mut state, unit).leases += 1;
        if on_track
            && state.order.lookahead
            && let Err(e) = self.prefetch_after(&mut state, unit)
        {
            self.holder_mut(&mut state, unit).leases -= 1;
            return Err(e);
        }
        state.stats.acquires += 1;
        state.stats.acquire_seconds += t.elapsed().as_secs_f64();
        Ok(Lease { unit, range, arena: self.id })
    }

    /// Leases resident `units` for a whole pass on `consumer`, without tracking them in the
    /// execution order: work on `consumer` may read them until the leases are given back (with
    /// [`release_all`](Arena::release_all), after the pass). The pass tells the arena when it
    /// reaches each with [`reached`](Arena::reached). A unit the plan streams is refused.
    pub fn lease_for_pass(
        &self,
        units: &[UnitId],
        consumer: StreamId,
    ) -> Result<Vec<Lease>, ArenaError> {
        let t = Instant::now();
        let mut state = self.lock();
        if state.closed {
            return Err(ArenaError::Closed);
        }
        let mut leases = Vec::with_capacity(units.len());
        let mut granted = || -> Result<(), ArenaError> {
            for &unit in units {
                let range = self.unit_range(unit)?;
                if self.plan.slot_of[unit.0 as usize].is_some() {
                    return Err(ArenaError::InvalidUnits(format!(
                        "unit {} streams through a slot: it cannot be leased for a whole pass",
                        self.layout.units[unit.0 as usize].name
                    )));
                }
                if let Some(f) = self.ensure_loaded(&mut state, unit, Need::Demand)? {
                    self.platform
                        .fences
                        .stream_wait(consumer, f)
                        .map_err(device("make the consumer wait for the upload"))?;
                }
                state.residents[unit.0 as usize].holder.leases += 1;
                leases.push(Lease { unit, range, arena: self.id });
            }
            Ok(())
        };
        if let Err(e) = granted() {
            for l in &leases {
                let h = &mut state.residents[l.unit.0 as usize].holder;
                h.leases = h.leases.saturating_sub(1);
            }
            return Err(e);
        }
        state.stats.acquires += leases.len() as u64;
        state.stats.acquire_seconds += t.elapsed().as_secs_f64();
        Ok(leases)
    }

    /// The pass reached `unit`, which it holds by a pass lease: the order is tracked and the
    /// next units prefetched as [`acquire`](Arena::acquire) does, without a lease or a fence.
    pub fn reached(&self, unit: UnitId) -> Result<(), ArenaError> {
        let t = Instant::now();
        self.unit_range(unit)?;
        let mut state = self.lock();
        state.wait_for_fill();
        if state.closed {
            return Err(ArenaError::Closed);
        }
        let i = unit.0 as usize;
        if self.plan.slot_of[i].is_some() || state.residents[i].holder.leases == 0 {
            return Err(ArenaError::InvalidUnits(format!(
                "unit {} is not held by a pass lease: acquire it",
                self.layout.units[i].name
            )));
        }
        if self.observe(&mut state, unit) && state.order.lookahead {
            self.prefetch_after(&mut state, unit)?;
        }
        state.stats.acquire_seconds += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Gives a lease back: records a fence on `consumer` after the work that used the unit; the
    /// unit's memory is reused only after that fence. If recording fails, the memory is retained
    /// as unsafe (never reused; close refuses) and the error is returned. A lease this arena did
    /// not grant is refused and handed back inside [`ArenaError::ForeignLease`].
    pub fn release(&self, lease: Lease, consumer: StreamId) -> Result<(), ArenaError> {
        if lease.arena != self.id {
            return Err(ArenaError::ForeignLease { lease });
        }
        self.give_back(&[lease], consumer)
    }

    /// Gives `leases` back with one fence recorded on `consumer` after the work that used them,
    /// as [`release`](Arena::release) does for one. If recording fails, all their memory is
    /// retained as unsafe. Leases of other arenas are refused and handed back, every one, inside
    /// [`ArenaError::ForeignLeases`] (this arena's leases are given back first).
    pub fn release_all(&self, leases: Vec<Lease>, consumer: StreamId) -> Result<(), ArenaError> {
        let (leases, foreign): (Vec<Lease>, Vec<Lease>) =
            leases.into_iter().partition(|l| l.arena == self.id);
        self.give_back(&leases, consumer)?;
        if foreign.is_empty() { Ok(()) } else { Err(ArenaError::ForeignLeases { leases: foreign }) }
    }

    /// The one release path: gives this arena's `leases` back on one fence recorded on
    /// `consumer`. If recording fails, the memory of each is retained unsafe, its bytes counted
    /// once however many of its leases fail.
    fn give_back(&self, leases: &[Lease], consumer: StreamId) -> Result<(), ArenaError> {
        if leases.is_empty() {
            return Ok(());
        }
        let t = Instant::now();
        let mut state = self.lock();
        match self.platform.fences.record(consumer) {
            Ok(f) => {
                for l in leases {
                    let h = self.holder_mut(&mut state, l.unit);
                    h.leases = h.leases.saturating_sub(1);
                    h.released_on(consumer, f);
                }
            }
            Err(e) => {
                for l in leases {
                    let retained = self.holder_len(l.unit);
                    if self.holder_mut(&mut state, l.unit).retain_unsafe() {
                        state.stats.unsafe_retained_bytes += retained;
                    }
                }
                return Err(device("record the consumer's completion fence")(e));
            }
        }
        state.stats.releases += leases.len() as u64;
        state.stats.release_seconds += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Leases live on the arena's slots and resident units.
    pub(super) fn live_leases(state: &State) -> u32 {
        state
            .slots
            .iter()
            .map(|s| s.holder.leases)
            .chain(state.residents.iter().map(|r| r.holder.leases))
            .sum()
    }
}
