//! Uploading a unit: deciding under the lock where its bytes go and what gates the reuse of that
//! memory, then reading the source and enqueuing the copies (and conversions) with the lock
//! released, then committing the upload's fence under the lock again.

use std::sync::Arc;
use std::time::Instant;

use ddo_core::{
    DeviceAddress, DeviceRange, FenceValue, HostSlice, PeerBuffer, ReadRequest, UnitId,
};

use super::Arena;
use super::state::{Locked, StagingCursor};
use crate::error::device;
use crate::layout::{DeviceWork, Extent};
use crate::{ArenaError, UnitLayout};

/// Why a unit is needed on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Need {
    /// A consumer acquires it: counted as a prefetch hit or miss; waits for another upload.
    Demand,
    /// Look-ahead: skipped when its memory is busy (leased, or another upload runs).
    Prefetch,
    /// The peer weight store copies it: waits for another upload, never counted.
    Store,
}

impl Arena {
    /// The upload fence of `unit`'s bytes, uploading them first if they are not on the device
    /// (`None` when they are known complete, or when a prefetch skips a busy slot).
    pub(super) fn ensure_loaded(
        &self,
        state: &mut Locked<'_>,
        unit: UnitId,
        need: Need,
    ) -> Result<Option<FenceValue>, ArenaError> {
        let i = unit.0 as usize;
        // Decided afresh after every wait: another upload may have changed anything, and a
        // close meanwhile ends it.
        loop {
            let Some(slot) = self.plan.slot_of[i] else {
                let r = &state.residents[i];
                if r.holder.unsafe_ {
                    return Err(ArenaError::Unsafe {
                        what: format!("unit {}", self.layout.units[i].name),
                        retained: self.layout.units[i].len,
                    });
                }
                match (r.holder.upload, r.holder.upload_done) {
                    (Some(_), true) => return Ok(None),
                    (Some(f), false) => {
                        // Once the upload is seen complete, later acquisitions skip the wait.
                        let done = self
                            .platform
                            .fences
                            .query(f)
                            .map_err(device("query a resident unit's upload"))?;
                        state.residents[i].holder.upload_done = done;
                        return Ok((!done).then_some(f));
                    }
                    (None, _) => {}
                }
                if r.holder.loading || state.uploading {
                    if need == Need::Prefetch {
                        return Ok(None);
                    }
                    state.wait_open()?;
                    continue;
                }
                let f = self.upload(state, unit)?;
                state.residents[i].holder.upload = Some(f);
                return Ok(Some(f));
            };
            let s = slot.0 as usize;
            let st = &mut state.slots[s];
            if st.holder.unsafe_ {
                return Err(ArenaError::Unsafe {
                    what: format!("slot {s}"),
                    retained: self.plan.slot_len,
                });
            }
            if st.holder.loading {
                if need == Need::Prefetch {
                    return Ok(None);
                }
                state.wait_open()?;
                continue;
            }
            if st.occupant == Some(unit) && st.holder.upload.is_some() {
                let upload = st.holder.upload;
                if need == Need::Demand {
                    // Already on the device: uploaded ahead by prefetch or still there.
                    st.prefetched = false;
                    state.stats.prefetch_hits += 1;
                }
                return Ok(upload);
            }
            if st.holder.leases > 0 {
                if need == Need::Prefetch {
                    return Ok(None);
                }
                return Err(ArenaError::SlotBusy {
                    unit,
                    slot: slot.0,
                    holder: st.occupant.map_or(u32::MAX, |u| u.0),
                    slots: self.plan.slots,
                });
            }
            if state.uploading {
                if need == Need::Prefetch {
                    return Ok(None);
                }
                state.wait_open()?;
                continue;
            }
            if need == Need::Demand {
                state.stats.prefetch_misses += 1;
            }
            if state.slots[s].backing.is_none() {
                Self::create_slot_backing(
                    &self.platform,
                    &self.layout,
                    &self.plan,
                    &self.reservation,
                    state,
                    s,
                )?;
                state.stats.backing_restores += 1;
            }
            if state.slots[s].occupant.is_some_and(|o| o != unit) {
                state.stats.evictions += 1;
            }
            let st = &mut state.slots[s];
            // Reuse only after the last upload (its conversions run on their own stream, and a
            // prefetched unit may never have been consumed) and every consumer since: the copy
            // stream waits on the device for their fences.
            if let Some(f) = st.holder.upload
                && let Err(e) = self.platform.fences.stream_wait(self.copy_stream, f)
            {
                return Err(device("make the copy stream wait for the slot's last upload")(e));
            }
            // Every fence stays recorded until the copy stream waits on all of them: a failed
            // wait leaves the slot guarded by each consumer's fence, never by fewer.
            for &(_, f) in &st.holder.releases {
                if let Err(e) = self.platform.fences.stream_wait(self.copy_stream, f) {
                    return Err(device("make the copy stream wait for the slot's consumers")(e));
                }
            }
            st.holder.releases.clear();
            st.occupant = None;
            st.holder.upload = None;
            st.prefetched = false;
            let f = self.upload(state, unit)?;
            let st = &mut state.slots[s];
            st.occupant = Some(unit);
            st.holder.upload = Some(f);
            st.prefetched = need != Need::Demand;
            return Ok(Some(f));
        }
    }

    /// Enqueues the copies of `unit` on the copy stream and records their fence. The caller
    /// holds the lock with the copy lane free, and has made `unit`'s memory ready for the bytes.
    ///
    /// Under the lock, the upload takes the copy lane, marks `unit`'s holder loading and takes
    /// the staging cursor and the peer store's offset; it reads the source and enqueues the
    /// copies with the lock released (file reads never run under the lock); it commits the
    /// cursor, the counters and the lane under the lock again. While the holder is loading,
    /// every other path waits for it or skips it, so nothing it decided can change meanwhile.
    pub(super) fn upload(
        &self,
        state: &mut Locked<'_>,
        unit: UnitId,
    ) -> Result<FenceValue, ArenaError> {
        debug_assert!(!state.uploading, "the copy lane is free");
        let t = Instant::now();
        state.uploading = true;
        self.holder_mut(state, unit).loading = true;
        let mut cursor = state.staging_cursor;
        let peer = Self::peer_offset(state, unit);
        let result = state.unlocked(|| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.source.check_in_use()?;
                let result = self.enqueue_upload(&mut cursor, peer, unit);
                if result.is_err() {
                    // Copies or conversions enqueued before the failure may still write into
                    // the unit's memory and read the staging buffer, and no fence covers them:
                    // wait for them here, so both are idle when the error reaches the caller.
                    let fences = &self.platform.fences;
                    for stream in std::iter::once(self.copy_stream).chain(self.convert_stream) {
                        if let Ok(f) = fences.record(stream) {
                            let _ = fences.wait(f);
                        }
                    }
                }
                result
            }))
        });
        state.staging_cursor = cursor;
        state.uploading = false;
        self.holder_mut(state, unit).loading = false;
        state.notify();
        let (f, copies) = match result {
            Ok(result) => result?,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        let u = &self.layout.units[unit.0 as usize];
        state.stats.uploads += 1;
        if peer.is_some() {
            state.stats.peer_uploads += 1;
            state.stats.peer_upload_bytes += u.len;
            state.stats.upload_seconds += t.elapsed().as_secs_f64();
            return Ok(f);
        }
        state.stats.upload_bytes += u.link_bytes();
        let (decodes, encoded, decoded) = u.decoded();
        state.stats.device_conversions += u.conversions.len() as u64 - decodes;
        state.stats.device_decodes += decodes;
        state.stats.encoded_upload_bytes += encoded;
        state.stats.decoded_bytes += decoded;
        state.stats.upload_copies += copies;
        state.stats.upload_seconds += t.elapsed().as_secs_f64();
        Ok(f)
    }

    /// Enqueues `unit`'s copies (and conversions) and records the fence that covers them, with
    /// the copies it took: from the peer store at `peer` when it holds the unit, else from the
    /// source, its staged bytes through the staging buffers `cursor` points at.
    fn enqueue_upload(
        &self,
        cursor: &mut StagingCursor,
        peer: Option<(PeerBuffer, u64)>,
        unit: UnitId,
    ) -> Result<(FenceValue, u64), ArenaError> {
        let u = &self.layout.units[unit.0 as usize];
        let base = self.reservation.range.start.offset(u.offset);
        let fences = &self.platform.fences;
        if let Some((buffer, at)) = peer {
            // The unit's bytes as uploaded (converted and decoded) wait in the peer's memory.
            self.platform
                .residency
                .copy_from_peer(
                    buffer,
                    at,
                    DeviceRange { start: base, len: u.len },
                    self.copy_stream,
                )
                .map_err(device("copy a unit from the peer weight store"))?;
            let f = fences.record(self.copy_stream).map_err(device("record the upload fence"))?;
            return Ok((f, 1));
        }
        let mut copies = 0;
        // The unit's own bytes first, then its staged bytes round by round: each round's
        // kernels run on the conversion stream while the next round crosses the link.
        copies += self.copy_extents(u, base, |e| !e.staged)?;
        let mut last = None;
        if let Some(convert) = self.convert_stream {
            for round in 0..u.rounds() {
                // A round's bytes go to a staging buffer after its last kernels have read it.
                let b = cursor.next;
                let staging = self
                    .reservation
                    .range
                    .start
                    .offset(self.layout.staging_offset + b as u64 * self.layout.staging_buffer);
                if let Some(f) = cursor.read[b].take()
                    && let Err(e) = fences.stream_wait(self.copy_stream, f)
                {
                    cursor.read[b] = Some(f);
                    return Err(device("make the copy stream wait for the staging buffer")(e));
                }
                cursor.next = 1 - b;
                copies += self.copy_extents(u, staging, |e| e.staged && e.round == round)?;
                let copied =
                    fences.record(self.copy_stream).map_err(device("record the upload fence"))?;
                fences
                    .stream_wait(convert, copied)
                    .map_err(device("make the conversion stream wait for the copies"))?;
                for c in u.conversions.iter().filter(|c| c.round == round) {
                    let t =
                        u.tensors.iter().find(|t| t.slice == c.slice).expect("a converted tensor");
                    let src = DeviceRange { start: staging.offset(c.staging), len: c.staged_len };
                    let dst = DeviceRange { start: base.offset(t.offset), len: t.len };
                    let residency = &self.platform.residency;
                    match c.work {
                        DeviceWork::Convert { from, to } => residency
                            .convert(src, from, dst, to, convert)
                            .map_err(device("enqueue a weight conversion"))?,
                        DeviceWork::Decode => residency
                            .decode(src, dst, convert)
                            .map_err(device("enqueue a weight decode"))?,
                    }
                }
                let f = fences.record(convert).map_err(device("record the conversion fence"))?;
                cursor.read[b] = Some(f);
                last = Some(f);
            }
        }
        // Host-side copies (the host backend, pageable memory) have read the source by now: a
        // file that changed under them is noticed before the unit is used.
        self.source.check_in_use()?;
        // The conversion stream waited for every copy before its last round, so its last fence
        // covers the whole unit.
        let f = match last {
            Some(f) => f,
            None => fences.record(self.copy_stream).map_err(device("record the upload fence"))?,
        };
        Ok((f, copies))
    }

    /// Enqueues the copies of `u`'s extents that `which` picks, each landing at its offset from
    /// `to`; returns how many copies it took.
    fn copy_extents(
        &self,
        u: &UnitLayout,
        to: DeviceAddress,
        which: impl Fn(&Extent) -> bool,
    ) -> Result<u64, ArenaError> {
        let mut copies = 0;
        for e in u.extents.iter().filter(|e| which(e)) {
            if let Some(pieces) = self.source.host_pieces(e.file, e.file_offset, e.len) {
                copies += self.copy_pieces(to.offset(e.offset), pieces)?;
                continue;
            }
            // Run by run of adjacent tensors, for a source that holds the tensors but not the
            // gaps between them (retained windows) or lends a staging buffer per range. Each
            // run is copied before the next is asked for: a staged source lends its few
            // buffers again only once the copies from them are retired. A run the source does
            // not hold is read with the rest of the extent in one batch; an extent of one run
            // was just asked for whole and is not asked again.
            let runs = Self::tensor_runs(u, e);
            let whole = runs.len() == 1 && runs[0] == (0, e.len);
            for (at, len) in runs {
                let lent = if whole {
                    None
                } else {
                    self.source.host_pieces(e.file, e.file_offset + at, len)
                };
                let Some(pieces) = lent else {
                    let rest = self.read_run(u, e, at, e.len - at)?;
                    copies += self.copy_pieces(to.offset(e.offset + at), vec![(0, rest)])?;
                    break;
                };
                copies += self.copy_pieces(to.offset(e.offset + at), pieces)?;
            }
        }
        Ok(copies)
    }

    /// Enqueues one copy per host piece, each landing at its offset from `to`.
    fn copy_pieces(
        &self,
        to: DeviceAddress,
        pieces: Vec<(u64, HostSlice)>,
    ) -> Result<u64, ArenaError> {
        let copies = pieces.len() as u64;
        for (at, host) in pieces {
            let dst = DeviceRange { start: to.offset(at), len: host.len() as u64 };
            self.platform
                .residency
                .copy_to_device(host, dst, self.copy_stream)
                .map_err(device("enqueue a weight upload"))?;
        }
        Ok(copies)
    }

    /// The runs of adjacent stored tensors in extent `e`, as (offset in the extent, length).
    fn tensor_runs(u: &UnitLayout, e: &Extent) -> Vec<(u64, u64)> {
        let mut tensors: Vec<(u64, u64)> = u
            .stored()
            .filter(|&(_, round, at, len)| {
                round == e.staged.then_some(e.round)
                    && at >= e.offset
                    && at + len <= e.offset + e.len
            })
            .map(|(_, _, at, len)| (at - e.offset, len))
            .collect();
        tensors.sort_unstable();
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (at, len) in tensors {
            match runs.last_mut() {
                Some(run) if run.0 + run.1 == at => run.1 += len,
                _ => runs.push((at, len)),
            }
        }
        runs
    }

    /// Reads the tensors in the `len` bytes at `at` in extent `e` into a new host buffer
    /// (sources without host-resident bytes).
    fn read_run(
        &self,
        u: &UnitLayout,
        e: &Extent,
        at: u64,
        len: u64,
    ) -> Result<HostSlice, ArenaError> {
        let (start, end) = (e.offset + at, e.offset + at + len);
        let requests: Vec<ReadRequest> = u
            .stored()
            .filter(|&(_, round, t, tlen)| {
                round == e.staged.then_some(e.round) && t >= start && t + tlen <= end
            })
            .map(|(slice, _, t, _)| ReadRequest { slice, dst_offset: t - start })
            .collect();
        // A tensor's encoding is only in the source's host memory; reading the tensor would
        // put its decoded bytes where the decoder expects the encoding.
        if let Some(c) = u
            .conversions
            .iter()
            .find(|c| c.work == DeviceWork::Decode && requests.iter().any(|r| r.slice == c.slice))
        {
            return Err(ArenaError::Source(ddo_core::SourceError::InvalidBatch(format!(
                "the source no longer holds the encoding of tensor {:?} in host memory",
                self.source.slices()[c.slice].name
            ))));
        }
        let mut buf = vec![0u8; len as usize];
        self.source.read_batch(&requests, &mut buf)?;
        Ok(HostSlice::whole(Arc::new(ddo_core::HostBytes::from(buf))))
    }
}
