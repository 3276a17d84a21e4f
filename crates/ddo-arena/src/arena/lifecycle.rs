//! The end of memory's use: idle slots reclaimed between passes, the arena closed (or, failing
//! that, what it keeps reported), never freeing what a fence has not proven idle.

use std::time::Instant;

use ddo_core::{DeviceRange, FenceValue};

use super::Arena;
use crate::ArenaError;
use crate::error::device;

/// What [`Arena::reclaim_idle`] released.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReclaimReport {
    /// Slots whose backing was released.
    pub slots: u32,
    /// Device bytes released.
    pub bytes: u64,
}

impl Arena {
    /// Releases the physical backing of every idle slot (no lease, no upload running, every
    /// fence proven complete on the host), keeping its addresses; the next acquisition
    /// recreates the backing and uploads again before use. A fence that cannot be queried or an unmap/release that fails
    /// retains the slot as unsafe.
    pub fn reclaim_idle(&self) -> Result<ReclaimReport, ArenaError> {
        let mut state = self.lock();
        if state.closed {
            return Err(ArenaError::Closed);
        }
        let mut report = ReclaimReport::default();
        let start = self.reservation.range.start;
        for s in 0..state.slots.len() {
            let slot = &state.slots[s];
            if slot.backing.is_none()
                || slot.holder.leases > 0
                || slot.holder.unsafe_
                || slot.holder.loading
            {
                continue;
            }
            let fences: Vec<FenceValue> =
                slot.holder.upload.into_iter().chain(slot.holder.release_fences()).collect();
            let mut idle = true;
            for f in fences {
                match self.platform.fences.query(f) {
                    Ok(true) => {}
                    Ok(false) => {
                        idle = false;
                        break;
                    }
                    Err(e) => {
                        state.slots[s].holder.unsafe_ = true;
                        state.stats.unsafe_retained_bytes += self.plan.slot_len;
                        return Err(device("query a slot's fence before reclaim")(e));
                    }
                }
            }
            if !idle {
                continue;
            }
            let slot = &mut state.slots[s];
            while let Some(&u) = slot.mapped.last() {
                let unit = &self.layout.units[u.0 as usize];
                let range =
                    DeviceRange { start: start.offset(unit.offset), len: self.plan.slot_len };
                if let Err(e) = self.platform.residency.unmap(range) {
                    slot.holder.unsafe_ = true;
                    state.stats.unsafe_retained_bytes += self.plan.slot_len;
                    return Err(device("unmap slot memory for reclaim")(e));
                }
                slot.mapped.pop();
            }
            let b = slot.backing.expect("backing");
            if let Err(e) = self.platform.residency.release_backing(b) {
                slot.holder.unsafe_ = true;
                state.stats.unsafe_retained_bytes += self.plan.slot_len;
                return Err(device("release slot memory for reclaim")(e));
            }
            slot.backing = None;
            slot.occupant = None;
            slot.prefetched = false;
            slot.holder.upload = None;
            slot.holder.releases.clear();
            state.stats.slot_bytes -= self.plan.slot_len;
            state.stats.reclaim_cycles += 1;
            report.slots += 1;
            report.bytes += self.plan.slot_len;
        }
        Ok(report)
    }

    /// Waits for every outstanding fence, then releases all memory and the reservation.
    /// Refused (nothing freed) while leases are live or memory is retained unsafe. Once the
    /// memory is released the arena is closed: an error releasing its streams after that is
    /// noted ([`ddo_core::note_drop_failure`]), not returned.
    pub fn close(&self) -> Result<(), ArenaError> {
        let result = self.close_now();
        if let Err(e) = &result {
            self.lock().close_failure.get_or_insert_with(|| e.to_string());
        }
        result
    }

    /// The first error [`close`](Arena::close) returned, if one did.
    pub fn close_failure(&self) -> Option<String> {
        self.lock().close_failure.clone()
    }

    /// Bytes a failed close keeps: those retained unsafe, else all the arena holds.
    pub fn kept_bytes(&self) -> u64 {
        let state = self.lock();
        match state.stats.unsafe_retained_bytes {
            0 => state.stats.resident_bytes + state.stats.slot_bytes,
            unsafe_bytes => unsafe_bytes,
        }
    }

    fn close_now(&self) -> Result<(), ArenaError> {
        let mut state = self.lock();
        // An upload's copies are fenced only once it commits; a fill copies into its store.
        while state.uploading || state.filling {
            state.wait();
        }
        if state.closed {
            return Ok(());
        }
        let live = Self::live_leases(&state);
        let retained = state.stats.unsafe_retained_bytes;
        let any_unsafe = state.slots.iter().any(|s| s.holder.unsafe_)
            || state.residents.iter().any(|r| r.holder.unsafe_);
        if live > 0 || any_unsafe {
            return Err(ArenaError::CloseRefused { live_leases: live, retained });
        }
        let t = Instant::now();
        let holders: Vec<FenceValue> = state
            .slots
            .iter()
            .map(|s| &s.holder)
            .chain(state.residents.iter().map(|r| &r.holder))
            .flat_map(|h| h.upload.into_iter().chain(h.release_fences()))
            .collect();
        for f in holders {
            if let Err(e) = self.platform.fences.wait(f) {
                for s in &mut state.slots {
                    s.holder.unsafe_ = true;
                }
                for r in &mut state.residents {
                    r.holder.unsafe_ = true;
                }
                state.stats.unsafe_retained_bytes =
                    state.stats.resident_bytes + state.stats.slot_bytes;
                return Err(device("wait for outstanding work before close")(e));
            }
        }
        state.stats.wait_seconds += t.elapsed().as_secs_f64();
        if let Some(store) = state.peer.take() {
            if let Err(e) = self.platform.residency.release_peer_buffer(store.buffer) {
                // Kept allocated (never force-freed); the copies from it stop here.
                state.peer = Some(store);
                return Err(device("release the peer weight store")(e));
            }
            state.stats.peer_store_bytes = 0;
        }
        let result = Self::teardown(
            &self.platform,
            &self.layout,
            self.plan.slot_len,
            self.reservation,
            &mut state,
        );
        match result {
            Ok(()) => {
                state.closed = true;
                state.stats.resident_bytes = 0;
                state.stats.slot_bytes = 0;
                // The device forgets a released stream's decode totals: kept for the stats.
                if let Some(stream) = self.convert_stream {
                    state.stats.decode_seconds = self.platform.residency.decode_totals(stream).1;
                }
                // Every fence was waited for: no work is left on the arena's own streams. The
                // memory is gone and the arena closed, so a stream that fails to go is noted for
                // the host to show, never returned as a close that did not happen.
                for stream in std::iter::once(self.copy_stream).chain(self.convert_stream) {
                    if let Err(e) = self.platform.residency.release_stream(stream) {
                        ddo_core::note_drop_failure(ddo_core::DropFailure {
                            what: "arena's stream",
                            message: format!("releasing it at close: {e}"),
                            retained_bytes: None,
                        });
                    }
                }
                Ok(())
            }
            Err(e) => {
                state.stats.unsafe_retained_bytes = state
                    .slots
                    .iter()
                    .filter(|s| s.backing.is_some())
                    .map(|_| self.plan.slot_len)
                    .sum::<u64>()
                    + state
                        .residents
                        .iter()
                        .zip(&self.layout.units)
                        .filter(|(r, _)| r.backing.is_some())
                        .map(|(_, u)| u.len)
                        .sum::<u64>();
                Err(e)
            }
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // On failure everything not released stays owned (never force-freed), and the failure
        // is noted for the host to show.
        let reported = self.close_failure().is_some();
        if let Err(e) = self.close()
            && !reported
        {
            ddo_core::note_drop_failure(drop_failure(&e, self.kept_bytes()));
        }
    }
}

/// The note for an arena that could not close when it was dropped.
pub fn drop_failure(e: &ArenaError, kept: u64) -> ddo_core::DropFailure {
    let message = match e.original() {
        ArenaError::CloseRefused { retained, .. } if *retained > 0 => {
            "memory retained unsafe after a failed release cannot be proven idle".to_owned()
        }
        ArenaError::CloseRefused { live_leases, .. } => format!(
            "{live_leases} lease(s) were never released, so the arena cannot prove its memory idle"
        ),
        other => other.to_string(),
    };
    ddo_core::DropFailure { what: "arena", message, retained_bytes: Some(kept) }
}
