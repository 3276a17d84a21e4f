//! The peer weight store: streamed units kept in a peer device's memory (another GPU's, or this
//! one's), copied from there over the peer link instead of from host memory.

use ddo_core::{DeviceOrdinal, PeerBuffer, UnitId};

use super::Arena;
use super::state::{Locked, PeerStore, State};
use super::upload::Need;
use crate::ArenaError;
use crate::error::device;

/// What [`Arena::fill_peer_store`] placed in the peer's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeerStoreReport {
    /// The device holding the store.
    pub device: DeviceOrdinal,
    /// Streamed units stored.
    pub units: u32,
    /// Their bytes.
    pub bytes: u64,
    /// Streamed units left to the host (the store's limit reached).
    pub host_units: u32,
}

impl Arena {
    /// Places streamed units, in the expected order, in `peer`'s memory (another GPU's, or this
    /// one's) up to `limit` bytes (0: every streamed unit): each is uploaded as usual, then its
    /// range is copied into the store, and from then on its uploads copy from there over the
    /// peer link instead of from host memory. Between passes only (no live lease); called
    /// again, it replaces the store. On an error nothing is stored and uploads stay on the host
    /// route. Acquisitions, [`reached`](Arena::reached) and [`prime`](Arena::prime) wait for a
    /// fill to end.
    pub fn fill_peer_store(
        &self,
        peer: DeviceOrdinal,
        limit: u64,
    ) -> Result<PeerStoreReport, ArenaError> {
        let mut state = self.lock();
        // One fill at a time, and the old store goes only once no upload copies from it.
        while state.filling || state.uploading {
            state.wait();
        }
        state.filling = true;
        let result = self.fill(&mut state, peer, limit);
        state.filling = false;
        state.notify();
        result
    }

    fn fill(
        &self,
        state: &mut Locked<'_>,
        peer: DeviceOrdinal,
        limit: u64,
    ) -> Result<PeerStoreReport, ArenaError> {
        if state.closed {
            return Err(ArenaError::Closed);
        }
        let live = Self::live_leases(state);
        if live > 0 {
            return Err(ArenaError::InvalidUnits(format!(
                "the peer weight store is filled between passes: {live} leases are live"
            )));
        }
        let residency = &self.platform.residency;
        if let Some(old) = state.peer.take() {
            if let Err(e) = residency.release_peer_buffer(old.buffer) {
                // Kept (never force-freed): close tries again.
                state.peer = Some(old);
                return Err(device("release the peer weight store")(e));
            }
            state.stats.peer_store_bytes = 0;
        }
        let order = self.expected_order(state);
        let streamed: Vec<UnitId> =
            order.iter().copied().filter(|u| self.plan.slot_of[u.0 as usize].is_some()).collect();
        let mut offsets = vec![None; self.layout.units.len()];
        let mut bytes = 0u64;
        for &u in &streamed {
            let len = self.layout.units[u.0 as usize].len;
            if limit > 0 && bytes + len > limit {
                break;
            }
            offsets[u.0 as usize] = Some(bytes);
            bytes += len;
        }
        let stored = offsets.iter().flatten().count() as u32;
        let report = PeerStoreReport {
            device: peer,
            units: stored,
            bytes,
            host_units: streamed.len() as u32 - stored,
        };
        if bytes == 0 {
            return Ok(report);
        }
        let buffer = residency
            .create_peer_buffer(peer, bytes)
            .map_err(device("create the peer weight store"))?;
        let fences = &self.platform.fences;
        for &u in &streamed {
            let Some(at) = offsets[u.0 as usize] else { continue };
            let filled = self.ensure_loaded(state, u, Need::Store).and_then(|f| {
                if let Some(f) = f {
                    fences.wait(f).map_err(device("wait for an upload filling the peer store"))?;
                }
                residency
                    .copy_into_peer(self.unit_range(u)?, buffer, at, self.copy_stream)
                    .map_err(device("copy a unit into the peer weight store"))?;
                let f =
                    fences.record(self.copy_stream).map_err(device("record the store's fence"))?;
                fences.wait(f).map_err(device("wait for the peer weight store"))
            });
            if let Err(e) = filled {
                for slot in &mut state.slots {
                    slot.prefetched = false;
                }
                if let Err(r) = residency.release_peer_buffer(buffer) {
                    ddo_core::note_drop_failure(ddo_core::DropFailure {
                        what: "peer weight store",
                        message: format!("releasing it after a failed fill: {r}"),
                        retained_bytes: Some(bytes),
                    });
                }
                return Err(e);
            }
        }
        // The units filled last sit in their slots as if prefetched; the next pass's look-ahead
        // may take those slots.
        for slot in &mut state.slots {
            slot.prefetched = false;
        }
        state.peer = Some(PeerStore { buffer, offsets });
        state.stats.peer_store_bytes = bytes;
        Ok(report)
    }

    /// For each unit, whether the peer weight store holds it (all `false` without a store).
    pub fn peer_stored(&self) -> Vec<bool> {
        let state = self.lock();
        match &state.peer {
            Some(store) => store.offsets.iter().map(Option::is_some).collect(),
            None => vec![false; self.layout.units.len()],
        }
    }

    /// The peer buffer and offset `unit` is stored at, when it is.
    pub(super) fn peer_offset(state: &State, unit: UnitId) -> Option<(PeerBuffer, u64)> {
        let store = state.peer.as_ref()?;
        Some((store.buffer, store.offsets[unit.0 as usize]?))
    }
}
