//! The arena over a staged source: uploads copy from staging buffers read ahead in the learned
//! order, and a buffer is never refilled while a copy from it is in flight (contract 1).

mod common;

use ddo_core::{Copies, DeviceMemory, HostRegistration, PeerStore, Streams, Transforms};
use std::sync::{Arc, Mutex};

use common::*;
use ddo_arena::{Arena, Budget, UnitSpec};
use ddo_core::{
    BackingId, DeviceError, DeviceOrdinal, DeviceRange, Fence, FenceValue, HostSlice, Platform,
    Registration, Reservation, Residency, StreamId, UnitId, WeightSource,
};
use ddo_source::{
    Checkpoint, CheckpointSource, ReadMethod, ReadOptions, RetainedStore, StagedSource,
    StagingOptions, StagingPool,
};

const WIDTH: usize = 128;

/// A copy in flight: its source, the bytes it had when enqueued, the fence covering it.
type Held = (HostSlice, Vec<u8>, Option<FenceValue>);

/// The spy device, holding every copy's source as an asynchronous adapter does: a slice is
/// dropped only when asked to retire completed copies (or when its fence is waited for), never
/// before a fence recorded after it. Each drop checks the bytes never changed while held.
struct Holding {
    spy: Arc<Spy>,
    held: Mutex<Vec<Held>>,
    retired: Mutex<u64>,
}

impl Holding {
    fn drop_completed(&self, upto: Option<FenceValue>) {
        let mut held = self.held.lock().unwrap();
        for (h, bytes, _) in held.iter() {
            assert_eq!(h.as_bytes(), &bytes[..], "a staging buffer changed under a copy in flight");
        }
        held.retain(|(_, _, f)| match (f, upto) {
            (Some(f), Some(upto)) => f.0 > upto.0,
            (Some(_), None) => false,
            (None, _) => true,
        });
    }
}

impl DeviceMemory for Holding {
    fn device(&self) -> DeviceOrdinal {
        self.spy.device()
    }

    fn granularity(&self) -> Result<u64, DeviceError> {
        self.spy.granularity()
    }

    fn reserve(&self, len: u64) -> Result<Reservation, DeviceError> {
        self.spy.reserve(len)
    }

    fn release_reservation(&self, r: Reservation) -> Result<(), DeviceError> {
        self.spy.release_reservation(r)
    }

    fn create_backing(&self, len: u64) -> Result<BackingId, DeviceError> {
        self.spy.create_backing(len)
    }

    fn map(&self, range: DeviceRange, b: BackingId) -> Result<(), DeviceError> {
        self.spy.map(range, b)
    }

    fn unmap(&self, range: DeviceRange) -> Result<(), DeviceError> {
        self.spy.unmap(range)
    }

    fn release_backing(&self, b: BackingId) -> Result<(), DeviceError> {
        self.spy.release_backing(b)
    }

    fn read_back(&self, src: DeviceRange, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.spy.read_back(src, dst)
    }
}

impl Streams for Holding {
    fn create_stream(&self) -> Result<StreamId, DeviceError> {
        self.spy.create_stream()
    }

    fn release_stream(&self, s: StreamId) -> Result<(), DeviceError> {
        self.spy.release_stream(s)
    }
}

impl Copies for Holding {
    fn copy_to_device(
        &self,
        src: HostSlice,
        dst: DeviceRange,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        self.spy.copy_to_device(src.clone(), dst, stream)?;
        let bytes = src.as_bytes().to_vec();
        self.held.lock().unwrap().push((src, bytes, None));
        Ok(())
    }

    fn retire_completed_copies(&self) -> Result<(), DeviceError> {
        *self.retired.lock().unwrap() += 1;
        // As the contract asks, copies no fence covers yet get one (the spy's copies complete
        // at once), then completed ones are dropped.
        let f = self.spy.record(self.spy.create_stream()?)?;
        for h in self.held.lock().unwrap().iter_mut().filter(|h| h.2.is_none()) {
            h.2 = Some(f);
        }
        self.drop_completed(None);
        Ok(())
    }
}

impl HostRegistration for Holding {
    fn register_host(&self, s: HostSlice, read_only: bool) -> Result<Registration, DeviceError> {
        self.spy.register_host(s, read_only)
    }

    fn unregister_host(&self, r: &Registration) -> Result<(), DeviceError> {
        self.spy.unregister_host(r)
    }
}

impl PeerStore for Holding {}

impl Transforms for Holding {}

impl Fence for Holding {
    fn record(&self, stream: StreamId) -> Result<FenceValue, DeviceError> {
        let f = self.spy.record(stream)?;
        for h in self.held.lock().unwrap().iter_mut().filter(|h| h.2.is_none()) {
            h.2 = Some(f);
        }
        Ok(f)
    }
    fn query(&self, value: FenceValue) -> Result<bool, DeviceError> {
        self.spy.query(value)
    }
    fn wait(&self, value: FenceValue) -> Result<(), DeviceError> {
        self.spy.wait(value)?;
        self.drop_completed(Some(value));
        Ok(())
    }
    fn stream_wait(&self, stream: StreamId, value: FenceValue) -> Result<(), DeviceError> {
        self.spy.stream_wait(stream, value)
    }
}

fn block_bytes() -> u64 {
    let block = (5 * WIDTH * WIDTH * 2 + WIDTH * 2) as u64;
    block.div_ceil(GRANULARITY) * GRANULARITY
}

/// Primes `arena`, then runs three passes, checking every tensor's device bytes under its
/// lease against `mapped`.
fn three_passes(arena: &Arena, holding: &Holding, mapped: &dyn WeightSource, units: &[UnitSpec]) {
    let stream = holding.create_stream().unwrap();
    arena.prime().unwrap();
    for _ in 0..3 {
        arena.begin_pass();
        for u in 0..arena.layout().units.len() as u32 {
            let lease = arena.acquire(UnitId(u), stream).unwrap();
            for &t in &units[u as usize].tensors {
                let (_, range) = arena.tensor_range(t).unwrap();
                let mut got = vec![0u8; range.len as usize];
                holding.read_back(range, &mut got).unwrap();
                let mut want = vec![0u8; range.len as usize];
                mapped.read(t, &mut want).unwrap();
                assert_eq!(got, want, "unit {u} tensor {t}");
            }
            arena.release(lease, stream).unwrap();
        }
    }
}

#[test]
fn uploads_copy_from_staging_read_ahead_and_never_refill_a_buffer_in_flight() {
    let dir = scratch();
    let blocks = 8;
    let mapped = checkpoint(dir.path(), blocks, WIDTH);
    let checkpoint = Checkpoint::open(dir.path().join("model.safetensors")).unwrap();
    let checkpoint = Arc::new(checkpoint);
    let units = UnitSpec::by_block(mapped.slices());
    let largest = units
        .iter()
        .map(|u| u.tensors.iter().map(|&t| mapped.slices()[t].len).sum::<u64>())
        .max()
        .unwrap();
    let holding =
        Arc::new(Holding { spy: Spy::new(), held: Mutex::new(Vec::new()), retired: Mutex::new(0) });
    let store = RetainedStore::new(u64::MAX, Arc::new(ddo_platform::LinuxAdmissionProbe::system()));
    // Three buffers for a model of nine units.
    let options = StagingOptions {
        ceiling: 3 * StagingPool::buffer_bytes(largest),
        largest_range: largest,
        readers: 2,
        method: ReadMethod::Direct,
        chunk_bytes: 64 << 10,
    };
    let pool = Arc::new(
        StagingPool::new(&checkpoint, options, &store, Some(holding.clone() as Arc<dyn Residency>))
            .unwrap(),
    );
    let reader = CheckpointSource::new(checkpoint.clone(), ReadOptions::pread()).unwrap();
    let source: Arc<dyn WeightSource> = Arc::new(StagedSource::new(Arc::new(reader), pool.clone()));
    let platform = Platform {
        name: "holding",
        residency: holding.clone(),
        fences: holding.clone(),
        admission: Arc::new(ddo_platform::LinuxAdmissionProbe::system()),
    };
    let budget = Budget { total: GRANULARITY + 3 * block_bytes(), headroom: 0, prefetch_depth: 2 };
    let arena = Arena::new(&platform, source, &units, budget).unwrap();
    three_passes(&arena, &holding, &*mapped, &units);
    let stats = pool.stats();
    assert!(stats.read_ahead > stats.on_demand, "uploads were read ahead: {stats:?}");
    assert!(*holding.retired.lock().unwrap() > 0, "the pool asked for completed copies");
    arena.close().unwrap();
    holding.drop_completed(None);
    assert_eq!(pool.lent(), 0);
}

/// Writes `units` units of three 64 KiB tensors `u{i}.a`, `u{i}.b`, `u{i}.c`, each pair a
/// 256 KiB pad apart (too far for one copy, close enough for one staging cover); the pads are
/// one pinned unit scattered over the whole file.
fn three_extent_checkpoint(
    dir: &std::path::Path,
    units: usize,
) -> (Arc<Checkpoint>, Vec<UnitSpec>) {
    use safetensors::tensor::TensorView;
    let mut data: Vec<(String, Vec<u8>)> = Vec::new();
    for u in 0..units {
        for (name, len) in [
            ("a", 64 << 10),
            ("a_pad", 256 << 10),
            ("b", 64 << 10),
            ("b_pad", 256 << 10),
            ("c", 64 << 10),
        ] {
            let n = format!("u{u:02}.{name}");
            let bytes = pattern(&n, len);
            data.push((n, bytes));
        }
    }
    let views: Vec<(String, TensorView<'_>)> = data
        .iter()
        .map(|(n, b)| {
            (n.clone(), TensorView::new(safetensors::Dtype::BF16, vec![b.len() / 2], b).unwrap())
        })
        .collect();
    let path = dir.join("model.safetensors");
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    let checkpoint = Arc::new(Checkpoint::open(&path).unwrap());
    let index = |name: &str| checkpoint.slices().iter().position(|s| s.name == name).unwrap();
    let mut specs = vec![UnitSpec {
        name: "pads".into(),
        tensors: (0..units)
            .flat_map(|u| [format!("u{u:02}.a_pad"), format!("u{u:02}.b_pad")])
            .map(|n| index(&n))
            .collect(),
        pinned: true,
    }];
    for u in 0..units {
        specs.push(UnitSpec {
            name: format!("u{u:02}"),
            tensors: ["a", "b", "c"].iter().map(|t| index(&format!("u{u:02}.{t}"))).collect(),
            pinned: false,
        });
    }
    (checkpoint, specs)
}

/// A unit of more ranges than there are staging buffers, and a resident unit of many scattered
/// ranges read on demand: each upload's first copies hold buffers its later ranges need. The
/// device retires those copies (the contract of `retire_completed_copies`), so no upload waits
/// for a buffer and none falls back to reading into memory of its own; a unit's ranges read
/// ahead as one cover into one buffer.
#[test]
fn a_unit_of_more_ranges_than_buffers_never_waits_for_its_own_copies() {
    let dir = scratch();
    let (checkpoint, units) = three_extent_checkpoint(dir.path(), 6);
    let mapped = CheckpointSource::new(checkpoint.clone(), ReadOptions::pread()).unwrap();
    let holding =
        Arc::new(Holding { spy: Spy::new(), held: Mutex::new(Vec::new()), retired: Mutex::new(0) });
    let store = RetainedStore::new(u64::MAX, Arc::new(ddo_platform::LinuxAdmissionProbe::system()));
    // Two buffers, each the size of a unit's cover (a, pad, b, pad, c).
    let cover = (3 * 64 + 2 * 256) << 10;
    let options = StagingOptions {
        ceiling: 2 * StagingPool::buffer_bytes(cover),
        largest_range: cover,
        readers: 2,
        method: ReadMethod::Direct,
        chunk_bytes: 64 << 10,
    };
    let pool = Arc::new(
        StagingPool::new(&checkpoint, options, &store, Some(holding.clone() as Arc<dyn Residency>))
            .unwrap(),
    );
    assert_eq!(pool.stats().buffers, 2);
    let reader = CheckpointSource::new(checkpoint.clone(), ReadOptions::pread()).unwrap();
    let source: Arc<dyn WeightSource> = Arc::new(StagedSource::new(Arc::new(reader), pool.clone()));
    let platform = Platform {
        name: "holding",
        residency: holding.clone(),
        fences: holding.clone(),
        admission: Arc::new(ddo_platform::LinuxAdmissionProbe::system()),
    };
    // The pads resident and three slots.
    let probe = Budget { total: 0, headroom: 0, prefetch_depth: 1 };
    let Err(ddo_arena::ArenaError::BudgetTooSmall { needed, largest_unit, .. }) =
        Arena::new(&platform, source.clone(), &units, probe)
    else {
        panic!("a zero budget is refused")
    };
    // The largest unit is the resident one; the rest of the smallest working set, two slots.
    let slot = (needed - largest_unit) / 2;
    let budget = Budget { total: needed + slot, headroom: 0, prefetch_depth: 2 };
    let arena = Arena::new(&platform, source, &units, budget).unwrap();
    assert_eq!(arena.plan().slots, 3, "six units stream through three slots");
    assert!(
        arena.layout().units[1..].iter().all(|u| u.extents.len() == 3),
        "each unit copies three extents: {:?}",
        arena.layout().units[1].extents
    );
    three_passes(&arena, &holding, &mapped, &units);
    let stats = pool.stats();
    assert_eq!(stats.gave_up, 0, "no upload waited out a buffer its own copies held: {stats:?}");
    assert!(stats.read_ahead >= 6, "units were read ahead: {stats:?}");
    // One cover per unit read ahead, not one read per extent.
    assert!(stats.read_ahead + stats.on_demand < 3 * 6 * 3, "{stats:?}");
    arena.close().unwrap();
    holding.drop_completed(None);
    assert_eq!(pool.lent(), 0);
}
