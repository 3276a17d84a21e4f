//! Passes and leases: the units, their views and bytes, a pass's leases of the resident units,
//! and leases taken per unit on the caller's streams.

use std::time::Instant;

use ddo_arena::Lease;
use ddo_core::{StreamId, UnitId};

use super::state::Attached;
use super::{ComponentSession, LeaseId, TensorView, UnitInfo};
use crate::SessionError;

impl ComponentSession {
    /// The units of the current attach, in arena id order.
    pub fn units(&self) -> Result<Vec<UnitInfo>, SessionError> {
        let mut g = self.lock();
        Ok(Self::attached(&mut g)?.units.clone())
    }

    /// Where parameter `name` (any alias) lives for this attach.
    pub fn tensor(&self, name: &str) -> Result<TensorView, SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        let &i = a.slices.get(name).ok_or_else(|| {
            SessionError::Weights(format!("no parameter {name:?} in this session"))
        })?;
        let (_, range) =
            a.memory.arena.tensor_range(i).ok_or_else(|| {
                SessionError::Weights(format!("parameter {name:?} is in no unit"))
            })?;
        let slice = &a.source.slices()[i];
        Ok(TensorView {
            address: range.start.0,
            len: range.len,
            dtype: a.host.device_conversions.get(&i).copied().unwrap_or(slice.dtype),
            shape: slice.shape.clone(),
            owner: a.memory.clone(),
        })
    }

    /// The device bytes of parameter `name` now (waits for all device work; verification only).
    /// A streamed unit's bytes are meaningful only while a lease on it is live.
    pub fn read_tensor(&self, name: &str) -> Result<Vec<u8>, SessionError> {
        let view = self.tensor(name)?;
        let mut out = vec![0u8; view.len as usize];
        let range =
            ddo_core::DeviceRange { start: ddo_core::DeviceAddress(view.address), len: view.len };
        self.target.platform.residency.read_back(range, &mut out)?;
        Ok(out)
    }

    /// The bytes of parameter `name` as its source holds them (the checkpoint, or the module's
    /// host tensors): what the parameter is, whatever unit its slot holds now.
    pub fn source_tensor(&self, name: &str) -> Result<Vec<u8>, SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        let &i = a.slices.get(name).ok_or_else(|| {
            SessionError::Weights(format!("no parameter {name:?} in this session"))
        })?;
        let mut out = vec![0u8; a.source.slices()[i].len as usize];
        a.source.read(i, &mut out)?;
        if let Some(&to) = a.host.device_conversions.get(&i) {
            let from = a.source.slices()[i].dtype;
            let mut served =
                vec![0u8; out.len() / from.size_bytes() as usize * to.size_bytes() as usize];
            ddo_core::convert(from, to, &out, &mut served);
            return Ok(served);
        }
        Ok(out)
    }

    /// Starts a forward pass on `stream`: the pass leases of a pass that never ended are given
    /// back (after the work already enqueued on `stream`), the order of the first pass is
    /// learned, and the pinned units and the units the plan keeps resident are leased for the
    /// pass. Returns the latter: the pass calls [`reached`](Self::reached) for them instead of
    /// acquiring them (work on `stream` only; other streams acquire as usual). Leases taken with
    /// [`acquire`](Self::acquire) belong to whoever took them, on whatever stream or thread:
    /// no pass gives them back, so another stream's work never loses its memory at a pass
    /// boundary.
    pub fn begin_pass(&self, stream: StreamId) -> Result<Vec<UnitId>, SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        Self::release_pass(a, stream)?;
        // Uploads check the files' status on their open descriptors; a path renamed over is
        // noticed here, once per pass.
        a.memory.arena.check_source()?;
        if let Some(link) = self.target.link_bytes_per_second {
            let streamed = a.memory.arena.plan().streamed_bytes;
            if let Some(auto) =
                self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()).as_mut()
            {
                auto.pass_begins(Instant::now(), streamed as f64 / link);
            }
            // `auto` decided to encode: the encodings are written in the background.
            self.start_decided_encoding();
        }
        a.memory.arena.begin_pass();
        let resident: Vec<UnitId> =
            a.units.iter().filter(|u| u.resident && !u.pinned).map(|u| u.id).collect();
        let leased = (|| -> Result<(), SessionError> {
            for u in a.units.iter().filter(|u| u.pinned) {
                let lease = a.memory.arena.acquire(u.id, stream)?;
                a.pass.push(lease);
            }
            a.pass.extend(a.memory.arena.lease_for_pass(&resident, stream)?);
            Ok(())
        })();
        if let Err(e) = leased {
            // Nothing stays leased by a pass that did not begin.
            a.memory.arena.abandon_pass();
            return Err(e.with_cleanup(Self::release_pass(a, stream)));
        }
        Ok(resident)
    }

    /// The pass reached `unit`, which [`begin_pass`](Self::begin_pass) leased for it: the
    /// order is tracked and what comes next prefetched.
    pub fn reached(&self, unit: UnitId) -> Result<(), SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        a.memory.arena.reached(unit)?;
        Ok(())
    }

    /// Refused while a pass holds leases: `what` (a change made between passes) says what.
    pub(super) fn between_passes(a: &Attached, what: &str) -> Result<(), SessionError> {
        let live = a.leases.len() + a.pass.len();
        if live == 0 {
            return Ok(());
        }
        Err(SessionError::Lifecycle(format!(
            "{what} ({live} lease(s) live): end the pass and release every acquired lease first"
        )))
    }

    /// Gives the pass leases back after one fence on `stream`; a failed record keeps their
    /// memory unsafe (the arena's contract).
    pub(super) fn release_pass(a: &mut Attached, stream: StreamId) -> Result<(), SessionError> {
        let pass: Vec<Lease> = a.pass.drain(..).collect();
        a.memory.arena.release_all(pass, stream).map_err(SessionError::Arena)
    }

    /// Ends a forward pass: gives back the pinned and plan-resident units after the work
    /// enqueued on `stream`. Leases taken with [`acquire`](Self::acquire) stay live until
    /// released.
    pub fn end_pass(&self, stream: StreamId) -> Result<(), SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        Self::release_pass(a, stream)
    }

    /// Gives back every live lease, the pass's and every [`acquire`](Self::acquire)'s, after
    /// one fence on `stream`: for a teardown once the device's work is complete and nothing
    /// enqueues more with them (before [`unload`](Self::unload), which refuses live leases).
    pub fn release_leases(&self, stream: StreamId) -> Result<(), SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        let all: Vec<Lease> = a.pass.drain(..).chain(a.leases.drain().map(|(_, l)| l)).collect();
        a.memory.arena.release_all(all, stream).map_err(SessionError::Arena)
    }

    /// Ends a pass that was interrupted (an exception inside the forward): gives back the pass
    /// leases after the work enqueued on `stream`, and the order seen is not learned. The caller
    /// releases the leases its own blocks acquired, on their streams.
    pub fn abort_pass(&self, stream: StreamId) -> Result<(), SessionError> {
        if let Some(auto) = self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            auto.interrupted();
        }
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        a.memory.arena.abandon_pass();
        Self::release_pass(a, stream)
    }

    /// Ensures `unit` is on the device for work enqueued on `stream` after this call.
    pub fn acquire(&self, unit: UnitId, stream: StreamId) -> Result<LeaseId, SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        let lease = a.memory.arena.acquire(unit, stream)?;
        let id = a.next_lease;
        a.next_lease += 1;
        a.leases.insert(id, lease);
        Ok(LeaseId(id))
    }

    /// Gives `lease` back after the work enqueued on `stream` that used it.
    pub fn release(&self, lease: LeaseId, stream: StreamId) -> Result<(), SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        let l = a
            .leases
            .remove(&lease.0)
            .ok_or_else(|| SessionError::Lifecycle(format!("lease {} is not live", lease.0)))?;
        a.memory.arena.release(l, stream)?;
        Ok(())
    }
}
