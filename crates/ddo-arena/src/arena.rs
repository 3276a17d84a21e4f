//! The arena: stable device ranges for every unit, resident units under the budget, streamed
//! units cycled through fenced slots, prefetch in the learned order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use ddo_core::{
    BackingId, DeviceRange, FenceValue, FileRange, HostSlice, Platform, ReadRequest, Reservation,
    SlotId, StreamId, UnitId, WeightSource,
};

use crate::error::device;
use crate::layout::DeviceWork;
use crate::{ArenaError, ArenaStats, Budget, Layout, ResidencyPlan, UnitSpec};

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

/// Identities of arenas, so a lease is only ever given back to its own arena.
static NEXT_ARENA: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

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

/// What [`Arena::reclaim_idle`] released.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReclaimReport {
    /// Slots whose backing was released.
    pub slots: u32,
    /// Device bytes released.
    pub bytes: u64,
}

#[derive(Debug, Default)]
struct Holder {
    /// Upload of the bytes now held (device-side completion).
    upload: Option<FenceValue>,
    /// The last fence each consumer stream recorded since the upload (a later fence on a
    /// stream completes after the earlier ones); reuse waits for all of them.
    releases: Vec<(StreamId, FenceValue)>,
    leases: u32,
    /// The upload was observed complete on the host: consumers need not wait for it.
    upload_done: bool,
    /// Retained after a failed release: never reused, close refuses.
    unsafe_: bool,
}

impl Holder {
    /// Records `fence` as `stream`'s last release, replacing the one it recorded before.
    fn released_on(&mut self, stream: StreamId, fence: FenceValue) {
        match self.releases.iter_mut().find(|(s, _)| *s == stream) {
            Some(last) => last.1 = fence,
            None => self.releases.push((stream, fence)),
        }
    }

    fn release_fences(&self) -> impl Iterator<Item = FenceValue> + '_ {
        self.releases.iter().map(|&(_, f)| f)
    }
}

#[derive(Debug, Default)]
struct Slot {
    holder: Holder,
    backing: Option<BackingId>,
    /// Unit whose bytes the slot holds (or is receiving).
    occupant: Option<UnitId>,
    /// The occupant came from prefetch and has not been acquired yet.
    prefetched: bool,
    /// Unit ranges the backing is mapped at now.
    mapped: Vec<UnitId>,
}

#[derive(Debug, Default)]
struct Resident {
    holder: Holder,
    backing: Option<BackingId>,
    mapped: bool,
}

#[derive(Debug, Default)]
struct Order {
    learned: Option<Arc<[UnitId]>>,
    current: Vec<UnitId>,
    position: usize,
    lookahead: bool,
}

#[derive(Debug)]
struct State {
    residents: Vec<Resident>,
    slots: Vec<Slot>,
    /// The staging buffers of device conversions: their backing, and whether it is mapped.
    staging: (Option<BackingId>, bool),
    /// The staging buffer the next upload fills, and per buffer the fence after which its last
    /// conversions have read it.
    staging_next: usize,
    staging_read: [Option<FenceValue>; 2],
    order: Order,
    stats: ArenaStats,
    closed: bool,
    /// The first error [`Arena::close`] returned: reported to its caller, so a drop does not
    /// report it again.
    close_failure: Option<String>,
    /// The ranges announced to the source last (reused, so announcing allocates nothing).
    announced: Vec<FileRange>,
    /// Streamed units held in a peer device's memory, copied from there instead of the host.
    peer: Option<PeerStore>,
}

/// A weight store in a peer device's memory: each stored unit's bytes as its range holds them
/// once uploaded (conversions and decodes done), at an offset of one buffer.
#[derive(Debug)]
struct PeerStore {
    buffer: ddo_core::PeerBuffer,
    /// Per unit: its offset in the buffer, when stored.
    offsets: Vec<Option<u64>>,
}

/// What [`Arena::fill_peer_store`] placed in the peer's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeerStoreReport {
    /// The device holding the store.
    pub device: ddo_core::DeviceOrdinal,
    /// Streamed units stored.
    pub units: u32,
    /// Their bytes.
    pub bytes: u64,
    /// Streamed units left to the host (the store's limit reached).
    pub host_units: u32,
}

/// A bounded GPU weight arena for one component.
///
/// Every unit owns a fixed device range inside one address reservation for the arena's life, so
/// tensor views are built once. Resident units keep their own physical backing; each streamed
/// unit is assigned one execution slot, whose backing is mapped at the ranges of all units
/// assigned to it, and uploads land there when the unit's turn comes. Reuse of a slot waits, on
/// the device, for every consumer fence recorded since its last upload; freeing or unmapping
/// waits for a host-observed fence; a failure on any release path retains the memory as unsafe.
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
    /// Builds an arena over `source` for `units` under `budget`: lays the units out, plans
    /// residency, reserves one address range, creates resident and slot backings and maps them.
    /// Nothing is uploaded yet (the first acquisition or prefetch does it).
    ///
    /// On failure everything created is released once, and the original error is returned with
    /// any cleanup error attached.
    pub fn new(
        platform: &Platform,
        source: Arc<dyn WeightSource>,
        units: &[UnitSpec],
        budget: Budget,
    ) -> Result<Arena, ArenaError> {
        Self::with_conversions(platform, source, units, budget, &HashMap::new())
    }

    /// As [`Arena::new`], with the tensors of `conversions` (slice -> dtype) uploaded in their
    /// stored dtype and converted on the device ([`Residency::convert`]) before their upload's
    /// fence: a unit holds their stored bytes and their converted elements.
    ///
    /// Every other tensor the source holds encoded ([`WeightSource::encoding`]) uploads its
    /// encoding and is decoded on the device ([`Residency::decode`]) before its fence, when the
    /// device decodes; otherwise it uploads as its own bytes.
    ///
    /// [`Residency::convert`]: ddo_core::Residency::convert
    /// [`Residency::decode`]: ddo_core::Residency::decode
    pub fn with_conversions(
        platform: &Platform,
        source: Arc<dyn WeightSource>,
        units: &[UnitSpec],
        budget: Budget,
        conversions: &HashMap<usize, ddo_core::Dtype>,
    ) -> Result<Arena, ArenaError> {
        let residency = &platform.residency;
        let granularity =
            residency.granularity().map_err(device("query the mapping granularity"))?;
        let mut encodings: HashMap<usize, ddo_core::FileRange> = units
            .iter()
            .flat_map(|u| &u.tensors)
            .filter(|t| !conversions.contains_key(t))
            .filter_map(|&t| Some((t, source.encoding(t)?)))
            .collect();
        // Asked only of a source with encodings: they upload as their tensors' own bytes on a
        // device that does not decode.
        if !encodings.is_empty() && !residency.decodes() {
            encodings.clear();
        }
        let mut layout =
            Layout::build_staged(source.slices(), units, granularity, conversions, &encodings)?;
        let plan = ResidencyPlan::new(&layout, budget)?;
        let streamed: Vec<bool> = plan.resident.iter().map(|r| !r).collect();
        layout.place(plan.slot_len, &streamed);
        let reservation =
            residency.reserve(layout.reserved).map_err(device("reserve device addresses"))?;
        let mut state = State {
            residents: layout.units.iter().map(|_| Resident::default()).collect(),
            slots: (0..plan.slots).map(|_| Slot::default()).collect(),
            staging: (None, false),
            staging_next: 0,
            staging_read: [None, None],
            order: Order { lookahead: true, ..Order::default() },
            stats: ArenaStats::default(),
            closed: false,
            close_failure: None,
            announced: Vec::new(),
            peer: None,
        };
        let arena_parts = (platform.clone(), source, layout, plan, reservation);
        let setup = Self::setup(&arena_parts, &mut state);
        let (platform, source, layout, plan, reservation) = arena_parts;
        let (copy_stream, convert_stream) = match setup {
            Ok(streams) => streams,
            Err(error) => {
                let cleanup =
                    Self::teardown(&platform, &layout, plan.slot_len, reservation, &mut state);
                return Err(match cleanup {
                    Ok(()) => error,
                    Err(c) => {
                        ArenaError::WithCleanup { error: Box::new(error), cleanup: Box::new(c) }
                    }
                });
            }
        };
        let attach_order = (0..layout.units.len() as u32).map(UnitId).collect();
        Ok(Arena {
            id: NEXT_ARENA.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            platform,
            source,
            layout,
            plan,
            reservation,
            copy_stream,
            convert_stream,
            attach_order,
            state: Mutex::new(state),
        })
    }

    fn setup(
        (platform, _, layout, plan, reservation): &(
            Platform,
            Arc<dyn WeightSource>,
            Layout,
            ResidencyPlan,
            Reservation,
        ),
        state: &mut State,
    ) -> Result<(StreamId, Option<StreamId>), ArenaError> {
        let residency = &platform.residency;
        let range_of = |u: &crate::UnitLayout| DeviceRange {
            start: reservation.range.start.offset(u.offset),
            len: u.len,
        };
        for (i, u) in layout.units.iter().enumerate() {
            if !plan.resident[i] {
                continue;
            }
            let b =
                residency.create_backing(u.len).map_err(device("create resident unit memory"))?;
            state.residents[i].backing = Some(b);
            residency.map(range_of(u), b).map_err(device("map resident unit memory"))?;
            state.residents[i].mapped = true;
            state.stats.resident_bytes += u.len;
        }
        if layout.staging_len > 0 {
            let len = layout.staging_len;
            let b = residency.create_backing(len).map_err(device("create the staging buffer"))?;
            state.staging.0 = Some(b);
            let range =
                DeviceRange { start: reservation.range.start.offset(layout.staging_offset), len };
            residency.map(range, b).map_err(device("map the staging buffer"))?;
            state.staging.1 = true;
            state.stats.resident_bytes += len;
        }
        for s in 0..plan.slots as usize {
            Self::create_slot_backing(platform, layout, plan, reservation, state, s)?;
        }
        state.stats.peak_bytes = state.stats.resident_bytes + state.stats.slot_bytes;
        let copy = residency.create_stream().map_err(device("create the copy stream"))?;
        let convert = match layout.staging_len {
            0 => None,
            _ => Some(residency.create_stream().map_err(device("create the conversion stream"))?),
        };
        Ok((copy, convert))
    }

    fn create_slot_backing(
        platform: &Platform,
        layout: &Layout,
        plan: &ResidencyPlan,
        reservation: &Reservation,
        state: &mut State,
        s: usize,
    ) -> Result<(), ArenaError> {
        let residency = &platform.residency;
        let b = residency.create_backing(plan.slot_len).map_err(device("create slot memory"))?;
        state.slots[s].backing = Some(b);
        state.stats.slot_bytes += plan.slot_len;
        state.stats.peak_bytes =
            state.stats.peak_bytes.max(state.stats.resident_bytes + state.stats.slot_bytes);
        for (i, u) in layout.units.iter().enumerate() {
            if plan.slot_of[i] != Some(SlotId(s as u32)) {
                continue;
            }
            let range =
                DeviceRange { start: reservation.range.start.offset(u.offset), len: plan.slot_len };
            residency.map(range, b).map_err(device("map slot memory"))?;
            state.slots[s].mapped.push(ddo_core::UnitId(i as u32));
        }
        Ok(())
    }

    /// Releases everything in `state`, in reverse order of creation. Stops at the first failure
    /// and marks what is left unsafe (kept, never freed).
    fn teardown(
        platform: &Platform,
        layout: &Layout,
        slot_len: u64,
        reservation: Reservation,
        state: &mut State,
    ) -> Result<(), ArenaError> {
        let residency = &platform.residency;
        let start = reservation.range.start;
        for s in state.slots.iter_mut() {
            let Some(b) = s.backing else { continue };
            while let Some(&u) = s.mapped.last() {
                let unit = &layout.units[u.0 as usize];
                if let Err(e) =
                    residency.unmap(DeviceRange { start: start.offset(unit.offset), len: slot_len })
                {
                    s.holder.unsafe_ = true;
                    return Err(device("unmap slot memory")(e));
                }
                s.mapped.pop();
            }
            if let Err(e) = residency.release_backing(b) {
                s.holder.unsafe_ = true;
                return Err(device("release slot memory")(e));
            }
            s.backing = None;
        }
        if let (Some(b), mapped) = state.staging {
            let range =
                DeviceRange { start: start.offset(layout.staging_offset), len: layout.staging_len };
            if mapped {
                residency.unmap(range).map_err(device("unmap the staging buffer"))?;
                state.staging.1 = false;
            }
            residency.release_backing(b).map_err(device("release the staging buffer"))?;
            state.staging.0 = None;
        }
        for (i, r) in state.residents.iter_mut().enumerate() {
            let unit = &layout.units[i];
            if r.mapped {
                if let Err(e) =
                    residency.unmap(DeviceRange { start: start.offset(unit.offset), len: unit.len })
                {
                    r.holder.unsafe_ = true;
                    return Err(device("unmap resident unit memory")(e));
                }
                r.mapped = false;
            }
            if let Some(b) = r.backing {
                if let Err(e) = residency.release_backing(b) {
                    r.holder.unsafe_ = true;
                    return Err(device("release resident unit memory")(e));
                }
                r.backing = None;
            }
        }
        residency.release_reservation(reservation).map_err(device("release device addresses"))
    }

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
        let mut stats = self.lock().stats;
        if let Some(stream) = self.convert_stream {
            stats.decode_seconds = self.platform.residency.decode_totals(stream).1;
        }
        stats
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn unit(&self, unit: UnitId) -> Result<&crate::UnitLayout, ArenaError> {
        self.layout
            .units
            .get(unit.0 as usize)
            .ok_or(ArenaError::NoSuchUnit { unit, count: self.layout.units.len() })
    }

    /// Checks the source's files fully (a path renamed over included): uploads check only
    /// what is cheap (the open files' status), so whoever runs passes calls this once per pass.
    pub fn check_source(&self) -> Result<(), ArenaError> {
        Ok(self.source.check_unchanged()?)
    }

    /// Marks a pass boundary (the component's forward starts): the first pass's order becomes
    /// the learned order, and look-ahead is enabled again.
    pub fn begin_pass(&self) {
        let mut state = self.lock();
        Self::start_pass(&mut state);
    }

    /// Marks the current pass as interrupted (an exception inside the forward): the order seen
    /// so far is not learned as the execution order.
    pub fn abandon_pass(&self) {
        self.lock().order.current.clear();
    }

    fn start_pass(state: &mut State) {
        let o = &mut state.order;
        if o.learned.is_none() && !o.current.is_empty() {
            let mut seen = std::collections::HashSet::new();
            if o.current.iter().all(|u| seen.insert(*u)) {
                o.learned = Some(std::mem::take(&mut o.current).into());
            }
        }
        o.current.clear();
        o.position = 0;
        o.lookahead = true;
        state.stats.passes += 1;
    }

    /// Ensures `unit` is on the device for work enqueued on `consumer` after this call: uploads
    /// it if needed (waiting on the device for the slot's previous consumers), makes `consumer`
    /// wait for the upload, and prefetches the next units in the learned order.
    pub fn acquire(&self, unit: UnitId, consumer: StreamId) -> Result<Lease, ArenaError> {
        let t = Instant::now();
        let range = self.unit_range(unit)?;
        let mut state = self.lock();
        if state.closed {
            return Err(ArenaError::Closed);
        }
        let on_track = self.observe(&mut state, unit);
        let fence = self.ensure_loaded(&mut state, unit, false)?;
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
                if let Some(f) = self.ensure_loaded(&mut state, unit, false)? {
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

    /// Gives `leases` back with one fence recorded on `consumer` after the work that used them,
    /// as [`release`](Arena::release) does for one. If recording fails, all their memory is
    /// retained as unsafe. Leases of other arenas are refused and handed back, every one, inside
    /// [`ArenaError::ForeignLeases`] (this arena's leases are given back first).
    pub fn release_all(&self, leases: Vec<Lease>, consumer: StreamId) -> Result<(), ArenaError> {
        let (leases, foreign): (Vec<Lease>, Vec<Lease>) =
            leases.into_iter().partition(|l| l.arena == self.id);
        self.release_own(leases, consumer)?;
        if foreign.is_empty() { Ok(()) } else { Err(ArenaError::ForeignLeases { leases: foreign }) }
    }

    fn release_own(&self, leases: Vec<Lease>, consumer: StreamId) -> Result<(), ArenaError> {
        if leases.is_empty() {
            return Ok(());
        }
        let t = Instant::now();
        let mut state = self.lock();
        match self.platform.fences.record(consumer) {
            Ok(f) => {
                for l in &leases {
                    let h = self.holder_mut(&mut state, l.unit);
                    h.leases = h.leases.saturating_sub(1);
                    h.released_on(consumer, f);
                }
            }
            Err(e) => {
                for l in &leases {
                    let retained = self.holder_len(l.unit);
                    let h = self.holder_mut(&mut state, l.unit);
                    if !h.unsafe_ {
                        h.unsafe_ = true;
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

    /// Gives a lease back: records a fence on `consumer` after the work that used the unit; the
    /// unit's memory is reused only after that fence. If recording fails, the memory is retained
    /// as unsafe (never reused; close refuses) and the error is returned. A lease this arena did
    /// not grant is refused and handed back inside [`ArenaError::ForeignLease`].
    pub fn release(&self, lease: Lease, consumer: StreamId) -> Result<(), ArenaError> {
        if lease.arena != self.id {
            return Err(ArenaError::ForeignLease { lease });
        }
        let t = Instant::now();
        let mut state = self.lock();
        let unit = lease.unit;
        match self.platform.fences.record(consumer) {
            Ok(f) => {
                let h = self.holder_mut(&mut state, unit);
                h.leases = h.leases.saturating_sub(1);
                h.released_on(consumer, f);
            }
            Err(e) => {
                let retained = self.holder_len(unit);
                self.holder_mut(&mut state, unit).unsafe_ = true;
                state.stats.unsafe_retained_bytes += retained;
                return Err(device("record the consumer's completion fence")(e));
            }
        }
        state.stats.releases += 1;
        state.stats.release_seconds += t.elapsed().as_secs_f64();
        Ok(())
    }

    fn holder_len(&self, unit: UnitId) -> u64 {
        match self.plan.slot_of[unit.0 as usize] {
            Some(_) => self.plan.slot_len,
            None => self.layout.units[unit.0 as usize].len,
        }
    }

    fn holder_mut<'s>(&self, state: &'s mut State, unit: UnitId) -> &'s mut Holder {
        match self.plan.slot_of[unit.0 as usize] {
            Some(s) => &mut state.slots[s.0 as usize].holder,
            None => &mut state.residents[unit.0 as usize].holder,
        }
    }

    /// Tracks the execution order; returns whether `unit` follows the expected order.
    fn observe(&self, state: &mut State, unit: UnitId) -> bool {
        let learned_first = state.order.learned.as_ref().map(|l| l[0]);
        let o = &mut state.order;
        match &o.learned {
            None => {
                if o.current.first() == Some(&unit) {
                    Self::start_pass(state);
                    state.order.current.push(unit);
                    return true;
                }
                let expected = o.current.len() as u32;
                o.current.push(unit);
                let on_track = unit.0 == expected;
                if !on_track {
                    self.cancel_lookahead(state);
                }
                on_track
            }
            Some(learned) => {
                if o.position < learned.len() && learned[o.position] == unit {
                    o.position += 1;
                    return true;
                }
                if learned_first == Some(unit) {
                    Self::start_pass(state);
                    state.order.position = 1;
                    return true;
                }
                state.stats.order_mismatches += 1;
                self.cancel_lookahead(state);
                false
            }
        }
    }

    /// Stops look-ahead for this pass. Uploads already enqueued complete and stay valid; they
    /// are only no longer counted as prefetch.
    fn cancel_lookahead(&self, state: &mut State) {
        state.order.lookahead = false;
        for s in &mut state.slots {
            if s.prefetched {
                s.prefetched = false;
                state.stats.prefetch_cancels += 1;
            }
        }
    }

    /// The upload fence of `unit`'s bytes, uploading them first if they are not on the device.
    fn ensure_loaded(
        &self,
        state: &mut State,
        unit: UnitId,
        prefetch: bool,
    ) -> Result<Option<FenceValue>, ArenaError> {
        let i = unit.0 as usize;
        match self.plan.slot_of[i] {
            None => {
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
                let f = self.upload(state, unit)?;
                state.residents[i].holder.upload = Some(f);
                Ok(Some(f))
            }
            Some(slot) => {
                let s = slot.0 as usize;
                let st = &mut state.slots[s];
                if st.holder.unsafe_ {
                    return Err(ArenaError::Unsafe {
                        what: format!("slot {s}"),
                        retained: self.plan.slot_len,
                    });
                }
                if st.occupant == Some(unit) && st.holder.upload.is_some() {
                    if !prefetch {
                        // Already on the device: uploaded ahead by prefetch or still there.
                        st.prefetched = false;
                        state.stats.prefetch_hits += 1;
                    }
                    return Ok(st.holder.upload);
                }
                if st.holder.leases > 0 {
                    if prefetch {
                        return Ok(None);
                    }
                    return Err(ArenaError::SlotBusy {
                        unit,
                        slot: slot.0,
                        holder: st.occupant.map_or(u32::MAX, |u| u.0),
                        slots: self.plan.slots,
                    });
                }
                if !prefetch {
                    state.stats.prefetch_misses += 1;
                }
                if st.backing.is_none() {
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
                let st = &mut state.slots[s];
                if st.occupant.is_some_and(|o| o != unit) {
                    state.stats.evictions += 1;
                }
                let st = &mut state.slots[s];
                // Reuse only after the last upload (its conversions run on their own stream, and
                // a prefetched unit may never have been consumed) and every consumer since: the
                // copy stream waits on the device for their fences.
                if let Some(f) = st.holder.upload
                    && let Err(e) = self.platform.fences.stream_wait(self.copy_stream, f)
                {
                    return Err(device("make the copy stream wait for the slot's last upload")(e));
                }
                // Every fence stays recorded until the copy stream waits on all of them: a
                // failed wait leaves the slot guarded by each consumer's fence, never by fewer.
                for &(_, f) in &st.holder.releases {
                    if let Err(e) = self.platform.fences.stream_wait(self.copy_stream, f) {
                        return Err(device("make the copy stream wait for the slot's consumers")(
                            e,
                        ));
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
                st.prefetched = prefetch;
                Ok(Some(f))
            }
        }
    }

    /// Enqueues the copies of `unit` on the copy stream and records their fence.
    fn upload(&self, state: &mut State, unit: UnitId) -> Result<FenceValue, ArenaError> {
        let t = Instant::now();
        self.source.check_in_use()?;
        let result = self.enqueue_upload(state, unit);
        if result.is_err() {
            // Copies or conversions enqueued before the failure may still write into the slot
            // and read the staging buffer, and no fence covers them: wait for them here, so the
            // slot and the buffer are idle when the error reaches the caller.
            let fences = &self.platform.fences;
            for stream in std::iter::once(self.copy_stream).chain(self.convert_stream) {
                if let Ok(f) = fences.record(stream) {
                    let _ = fences.wait(f);
                }
            }
        }
        let (f, copies) = result?;
        let u = &self.layout.units[unit.0 as usize];
        state.stats.uploads += 1;
        if Self::peer_offset(state, unit).is_some() {
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
    /// the copies it took.
    fn enqueue_upload(
        &self,
        state: &mut State,
        unit: UnitId,
    ) -> Result<(FenceValue, u64), ArenaError> {
        let u = &self.layout.units[unit.0 as usize];
        let base = self.reservation.range.start.offset(u.offset);
        let fences = &self.platform.fences;
        if let Some((buffer, at)) = Self::peer_offset(state, unit) {
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
                let b = state.staging_next;
                let staging = self
                    .reservation
                    .range
                    .start
                    .offset(self.layout.staging_offset + b as u64 * self.layout.staging_buffer);
                if let Some(f) = state.staging_read[b].take()
                    && let Err(e) = fences.stream_wait(self.copy_stream, f)
                {
                    state.staging_read[b] = Some(f);
                    return Err(device("make the copy stream wait for the staging buffer")(e));
                }
                state.staging_next = 1 - b;
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
                state.staging_read[b] = Some(f);
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
        u: &crate::UnitLayout,
        to: ddo_core::DeviceAddress,
        which: impl Fn(&crate::layout::Extent) -> bool,
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
        to: ddo_core::DeviceAddress,
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
    fn tensor_runs(u: &crate::UnitLayout, e: &crate::layout::Extent) -> Vec<(u64, u64)> {
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
        u: &crate::UnitLayout,
        e: &crate::layout::Extent,
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

    /// Uploads the next streamed units in the expected order into free slots (at most
    /// `min(prefetch_depth, slots - 1)`), and resident units met on the way. A slot is never taken
    /// from a unit that runs before the one it would receive.
    fn prefetch_after(&self, state: &mut State, unit: UnitId) -> Result<(), ArenaError> {
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
    fn announce(&self, state: &mut State, next: impl Iterator<Item = UnitId>) {
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

    /// The learned order, or the attach order before one is learned.
    fn expected_order(&self, state: &State) -> Arc<[UnitId]> {
        state.order.learned.clone().unwrap_or_else(|| self.attach_order.clone())
    }

    /// Uploads units of `next` in turn: resident ones not on the device yet, and up to `depth`
    /// streamed ones into their slots (0: none), stopping at a slot held by a unit of `ahead` or
    /// by an upload not used yet.
    fn look_ahead(
        &self,
        state: &mut State,
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
            if self.plan.slot_of[i].is_none() {
                self.upload_resident(state, next)?;
                continue;
            }
            if depth == 0 {
                break;
            }
            streamed += 1;
            let s = self.plan.slot_of[i].expect("streamed").0 as usize;
            let st = &state.slots[s];
            let present = st.occupant == Some(next) && st.holder.upload.is_some();
            if present || st.holder.unsafe_ || st.holder.leases > 0 {
                ahead.push(next);
                continue;
            }
            if st.occupant.is_some_and(|o| ahead.contains(&o) || st.prefetched) {
                // The occupant runs first; `next` waits for a later look-ahead.
                break;
            }
            ahead.push(next);
            if self.ensure_loaded(state, next, true)?.is_some() {
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
            self.upload_resident(&mut state, unit)?;
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
            self.upload_resident(&mut state, UnitId(i as u32))?;
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

    /// Uploads resident `unit` unless it is on the device (or retained unsafe).
    fn upload_resident(&self, state: &mut State, unit: UnitId) -> Result<(), ArenaError> {
        let holder = &state.residents[unit.0 as usize].holder;
        if holder.upload.is_none() && !holder.unsafe_ {
            let f = self.upload(state, unit)?;
            state.residents[unit.0 as usize].holder.upload = Some(f);
        }
        Ok(())
    }

    /// Releases the physical backing of every idle slot (no lease, every fence proven complete
    /// on the host), keeping its addresses; the next acquisition recreates the backing and
    /// uploads again before use. A fence that cannot be queried or an unmap/release that fails
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
            if slot.backing.is_none() || slot.holder.leases > 0 || slot.holder.unsafe_ {
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

    /// Places streamed units, in the expected order, in `peer`'s memory (another GPU's, or this
    /// one's) up to `limit` bytes (0: every streamed unit): each is uploaded as usual, then its
    /// range is copied into the store, and from then on its uploads copy from there over the
    /// peer link instead of from host memory. Between passes only (no live lease); called
    /// again, it replaces the store. On an error nothing is stored and uploads stay on the host
    /// route.
    pub fn fill_peer_store(
        &self,
        peer: ddo_core::DeviceOrdinal,
        limit: u64,
    ) -> Result<PeerStoreReport, ArenaError> {
        let mut state = self.lock();
        if state.closed {
            return Err(ArenaError::Closed);
        }
        let live = Self::live_leases(&state);
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
        let order = self.expected_order(&state);
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
            let filled = self.ensure_loaded(&mut state, u, true).and_then(|f| {
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

    /// Leases live on the arena's slots and resident units.
    fn live_leases(state: &State) -> u32 {
        state
            .slots
            .iter()
            .map(|s| s.holder.leases)
            .chain(state.residents.iter().map(|r| r.holder.leases))
            .sum()
    }

    /// The peer buffer and offset `unit` is stored at, when it is.
    fn peer_offset(state: &State, unit: UnitId) -> Option<(ddo_core::PeerBuffer, u64)> {
        let store = state.peer.as_ref()?;
        Some((store.buffer, store.offsets[unit.0 as usize]?))
    }

    /// Waits for every outstanding fence, then releases all memory and the reservation.
    /// Refused (nothing freed) while leases are live or memory is retained unsafe.
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
