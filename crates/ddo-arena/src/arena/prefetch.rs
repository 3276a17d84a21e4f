//! Prefetch: uploads ahead of the consumer in the expected order, the source told which file
//! ranges come next, the first pass primed, resident units settled.

use std::time::Instant;

use ddo_core::{FileRange, UnitId};

use super::Arena;
use super::state::{Locked, State};
use super::upload::Need;
use crate::ArenaError;
use crate::error::device;

impl Arena {
    /// Uploads the next streamed units in the expected order into free slots (at most
    /// `min(prefetch_depth, slots - 1)`), and resident units met on the way. A slot is never
    /// taken from a unit that runs before the one it would receive.
    pub(super) fn prefetch_after(
        &self,
        state: &mut Locked<'_>,
        unit: UnitId,
    ) -> Result<(), ArenaError> {
        let order = self.expected_order(state);
        let Some(pos) = order.iter().position(|&u| u == unit) else { return Ok(()) };
        let next = order[pos + 1..].iter().chain(&order[..pos]).copied();
        let depth = (self.plan.budget.prefetch_depth as usize)
            .min((self.plan.slots as usize).saturating_sub(1));
        self.look_ahead(state, next.clone(), vec![unit], depth)?;
        self.announce(state, next);
        Ok(())
    }

    /// Tells the source which file ranges come next: the extents of the units of `next` (in
    /// order) whose bytes are not on the device or on their way there, up to one unit per slot.
    pub(super) fn announce(&self, state: &mut State, next: impl Iterator<Item = UnitId>) {
        let mut ranges = std::mem::take(&mut state.announced);
        ranges.clear();
        let mut units = 0;
        for unit in next {
            if units >= self.plan.slots as usize {
                break;
            }
            let i = unit.0 as usize;
            let on_device = match self.plan.slot_of[i] {
                Some(s) => {
                    let st = &state.slots[s.0 as usize];
                    st.occupant == Some(unit) && st.holder.upload.is_some()
                }
                None => state.residents[i].holder.upload.is_some(),
            };
            if on_device || Self::peer_offset(state, unit).is_some() {
                continue;
            }
            if self.plan.slot_of[i].is_some() {
                units += 1;
            }
            let u = &self.layout.units[i];
            ranges.extend(u.extents.iter().map(|e| FileRange {
                file: e.file,
                offset: e.file_offset,
                len: e.len,
            }));
        }
        self.source.announce(&ranges);
        state.announced = ranges;
    }

    /// Uploads units of `next` in turn: resident ones not on the device yet, and up to `depth`
    /// streamed ones into their slots (0: none), stopping at a slot held by a unit of `ahead` or
    /// by an upload not used yet.
    fn look_ahead(
        &self,
        state: &mut Locked<'_>,
        next: impl IntoIterator<Item = UnitId>,
        mut ahead: Vec<UnitId>,
        depth: usize,
    ) -> Result<(), ArenaError> {
        let mut streamed = 0;
        for next in next {
            if streamed >= depth && depth > 0 {
                break;
            }
            let i = next.0 as usize;
            let Some(slot) = self.plan.slot_of[i] else {
                self.upload_resident(state, next, Need::Prefetch)?;
                continue;
            };
            if depth == 0 {
                break;
            }
            streamed += 1;
            let st = &state.slots[slot.0 as usize];
            let present = st.occupant == Some(next) && st.holder.upload.is_some();
            if present || st.holder.unsafe_ || st.holder.leases > 0 || st.holder.loading {
                ahead.push(next);
                continue;
            }
            if st.occupant.is_some_and(|o| ahead.contains(&o) || st.prefetched) {
                // The occupant runs first; `next` waits for a later look-ahead.
                break;
            }
            ahead.push(next);
            if self.ensure_loaded(state, next, Need::Prefetch)?.is_some() {
                state.stats.prefetch_issued += 1;
            }
        }
        Ok(())
    }

    /// Starts the first pass warm: enqueues the uploads of every resident unit and of the first
    /// streamed units in the expected order (one per slot), without waiting for them. Acquisitions
    /// wait for these uploads on the device like for any other. Returns the bytes enqueued.
    pub fn prime(&self) -> Result<u64, ArenaError> {
        let mut state = self.lock();
        state.wait_for_fill();
        if state.closed {
            return Err(ArenaError::Closed);
        }
        let before = state.stats.upload_bytes;
        let order = self.expected_order(&state);
        // Reads of the first units start before the first of them uploads.
        self.announce(&mut state, order.iter().copied());
        self.look_ahead(&mut state, order.iter().copied(), Vec::new(), self.plan.slots as usize)?;
        // Resident units after the last streamed unit primed.
        for &unit in order.iter().filter(|u| self.plan.slot_of[u.0 as usize].is_none()) {
            self.upload_resident(&mut state, unit, Need::Prefetch)?;
        }
        self.announce(&mut state, order.iter().copied());
        Ok(state.stats.upload_bytes - before)
    }

    /// Waits on the host until every resident unit's upload completed (uploading those not
    /// uploaded yet), so resident weights may be read by work that never acquires them (a
    /// component method called outside its forward). Resident units are never evicted.
    pub fn settle_resident(&self) -> Result<(), ArenaError> {
        let mut state = self.lock();
        if state.closed {
            return Err(ArenaError::Closed);
        }
        let t = Instant::now();
        for i in 0..state.residents.len() {
            if !self.plan.resident[i] {
                continue;
            }
            self.upload_resident(&mut state, UnitId(i as u32), Need::Demand)?;
            let holder = &state.residents[i].holder;
            if let (Some(f), false) = (holder.upload, holder.upload_done) {
                self.platform
                    .fences
                    .wait(f)
                    .map_err(device("wait for the resident units' uploads"))?;
                state.residents[i].holder.upload_done = true;
            }
        }
        state.stats.wait_seconds += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Uploads resident `unit` unless it is on the device (or retained unsafe). While another
    /// upload runs, a prefetch skips it; any other need waits for that upload to commit.
    fn upload_resident(
        &self,
        state: &mut Locked<'_>,
        unit: UnitId,
        need: Need,
    ) -> Result<(), ArenaError> {
        let i = unit.0 as usize;
        loop {
            let holder = &state.residents[i].holder;
            if holder.upload.is_some() || holder.unsafe_ {
                return Ok(());
            }
            if !(holder.loading || state.uploading) {
                break;
            }
            if need == Need::Prefetch {
                return Ok(());
            }
            state.wait_open()?;
        }
        let f = self.upload(state, unit)?;
        state.residents[i].holder.upload = Some(f);
        Ok(())
    }
}
