//! The arena's one lock is never held while the source is read: while an upload waits for the
//! disk, other callers of the arena (its counters, the release of another unit) go on.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::*;
use ddo_arena::{Arena, Budget, UnitSpec};
use ddo_core::{
    CheckpointFileId, HostSlice, ReadRequest, SourceError, TensorSlice, UnitId, WeightSource,
};

/// A source that holds nothing in host memory (every upload reads), whose reads wait at a gate
/// once it is closed, telling the test when one has started.
struct GatedSource {
    inner: Arc<dyn WeightSource>,
    closed: AtomicBool,
    open: (Mutex<bool>, Condvar),
    started: Mutex<mpsc::Sender<()>>,
}

impl GatedSource {
    fn open_gate(&self) {
        *self.open.0.lock().unwrap() = true;
        self.open.1.notify_all();
    }
}

impl WeightSource for GatedSource {
    fn slices(&self) -> &[TensorSlice] {
        self.inner.slices()
    }

    fn check_unchanged(&self) -> Result<(), SourceError> {
        self.inner.check_unchanged()
    }

    fn read(&self, slice: usize, dst: &mut [u8]) -> Result<(), SourceError> {
        self.inner.read(slice, dst)
    }

    fn host_bytes(&self, _slice: usize) -> Option<HostSlice> {
        None
    }

    fn host_pieces(
        &self,
        _file: CheckpointFileId,
        _offset: u64,
        _len: u64,
    ) -> Option<Vec<(u64, HostSlice)>> {
        None
    }

    fn read_batch(&self, requests: &[ReadRequest], dst: &mut [u8]) -> Result<(), SourceError> {
        if self.closed.load(Ordering::SeqCst) {
            self.started.lock().unwrap().send(()).unwrap();
            let mut open = self.open.0.lock().unwrap();
            while !*open {
                open = self.open.1.wait(open).unwrap();
            }
        }
        self.inner.read_batch(requests, dst)
    }
}

#[test]
fn a_read_of_the_source_does_not_hold_the_arena() {
    let dir = scratch();
    let (started, reading) = mpsc::channel();
    let source = Arc::new(GatedSource {
        inner: checkpoint(dir.path(), 4, 128),
        closed: AtomicBool::new(false),
        open: (Mutex::new(false), Condvar::new()),
        started: Mutex::new(started),
    });
    let (platform, device) = host();
    let units = UnitSpec::by_block(source.slices());
    let block = (5 * 128 * 128 * 2 + 128 * 2) as u64;
    let slot = block.div_ceil(GRANULARITY) * GRANULARITY;
    // Two slots, no look-ahead: each streamed unit uploads when acquired.
    let budget = Budget { total: GRANULARITY + 2 * slot, headroom: 0, prefetch_depth: 0 };
    let arena = Arena::new(&platform, source.clone(), &units, budget).unwrap();
    let stream = ddo_core::Streams::create_stream(&*device).unwrap();
    // Unit 1 streams through slot 0, unit 2 through slot 1.
    let held = arena.acquire(UnitId(1), stream).unwrap();
    source.closed.store(true, Ordering::SeqCst);
    let (went_on, seen) = std::thread::scope(|s| {
        let arena = &arena;
        let reader = s.spawn(|| arena.acquire(UnitId(2), stream));
        reading.recv_timeout(Duration::from_secs(30)).expect("the upload of unit 2 reads");
        let (done, finished) = mpsc::channel();
        let other = s.spawn(move || {
            let stats = arena.stats();
            arena.release(held, stream).unwrap();
            done.send(()).unwrap();
            stats
        });
        let went_on = finished.recv_timeout(Duration::from_secs(5)).is_ok();
        source.open_gate();
        let lease = reader.join().unwrap().unwrap();
        arena.release(lease, stream).unwrap();
        (went_on, other.join().unwrap())
    });
    assert!(went_on, "the arena's lock was held while the source was read");
    assert_eq!(seen.uploads, 1, "unit 2's upload had not committed yet");
    assert_eq!(arena.stats().uploads, 2);
    arena.close().unwrap();
}

/// Contract 1: a caller that waited for another upload re-checks that the arena is open. An
/// acquisition waiting for a unit `prime` uploads, while `close` waits for the same upload,
/// either leases before the close (which is then refused) or is refused itself: never a lease
/// into memory the close released.
#[test]
fn an_acquisition_waiting_for_an_upload_is_refused_when_the_arena_closes_meanwhile() {
    let dir = scratch();
    let mut closed_first = 0;
    for _ in 0..12 {
        let (started, reading) = mpsc::channel();
        let source = Arc::new(GatedSource {
            inner: checkpoint(dir.path(), 4, 128),
            closed: AtomicBool::new(false),
            open: (Mutex::new(false), Condvar::new()),
            started: Mutex::new(started),
        });
        let (platform, device) = host();
        let units = UnitSpec::by_block(source.slices());
        // Every unit resident.
        let budget = Budget { total: 1 << 30, headroom: 0, prefetch_depth: 0 };
        let arena = Arena::new(&platform, source.clone(), &units, budget).unwrap();
        assert_eq!(arena.plan().slots, 0);
        let stream = ddo_core::Streams::create_stream(&*device).unwrap();
        // Every unit but the last is on the device: `prime` uploads only that one.
        let last = UnitId(arena.layout().units.len() as u32 - 1);
        let before: Vec<UnitId> = (0..last.0).map(UnitId).collect();
        let leases = arena.lease_for_pass(&before, stream).unwrap();
        arena.release_all(leases, stream).unwrap();
        source.closed.store(true, Ordering::SeqCst);
        std::thread::scope(|s| {
            let arena = &arena;
            let primer = s.spawn(|| arena.prime());
            reading
                .recv_timeout(Duration::from_secs(30))
                .expect("the upload of the last unit reads");
            // The close waits for the upload first (so it is woken first), then the acquisition.
            let closer = s.spawn(|| arena.close());
            std::thread::sleep(Duration::from_millis(50));
            let acquirer = s.spawn(|| arena.acquire(last, stream));
            std::thread::sleep(Duration::from_millis(50));
            source.open_gate();
            primer.join().unwrap().unwrap();
            let closed = closer.join().unwrap();
            match acquirer.join().unwrap() {
                Ok(lease) => {
                    assert!(
                        matches!(
                            closed,
                            Err(ddo_arena::ArenaError::CloseRefused { live_leases: 1, .. })
                        ),
                        "a lease handed out by an arena that closed: {closed:?}"
                    );
                    arena.release(lease, stream).unwrap();
                    arena.close().unwrap();
                }
                Err(e) => {
                    assert!(matches!(e, ddo_arena::ArenaError::Closed), "{e:?}");
                    closed.unwrap();
                    closed_first += 1;
                }
            }
        });
    }
    assert!(closed_first > 0, "the close never ran before the waiting acquisition");
}

/// A fill of the peer weight store reads the source with the lock released, like any upload:
/// an acquisition meanwhile waits for the fill to end, so it never takes a slot the fill still
/// uploads into.
#[test]
fn an_acquisition_waits_for_a_fill_of_the_peer_store() {
    let dir = scratch();
    let (started, reading) = mpsc::channel();
    let source = Arc::new(GatedSource {
        inner: checkpoint(dir.path(), 4, 128),
        closed: AtomicBool::new(false),
        open: (Mutex::new(false), Condvar::new()),
        started: Mutex::new(started),
    });
    let (platform, device) = host();
    let units = UnitSpec::by_block(source.slices());
    let block = (5 * 128 * 128 * 2 + 128 * 2) as u64;
    let slot = block.div_ceil(GRANULARITY) * GRANULARITY;
    // Two slots, no look-ahead: units 1 and 3 stream through slot 0, 2 and 4 through slot 1.
    let budget = Budget { total: GRANULARITY + 2 * slot, headroom: 0, prefetch_depth: 0 };
    let arena = Arena::new(&platform, source.clone(), &units, budget).unwrap();
    assert_eq!(arena.plan().streamed_units(), 4, "{:?}", arena.plan());
    let stream = ddo_core::Streams::create_stream(&*device).unwrap();
    source.closed.store(true, Ordering::SeqCst);
    let (filled, lease) = std::thread::scope(|s| {
        let arena = &arena;
        let filler = s.spawn(|| arena.fill_peer_store(ddo_core::DeviceOrdinal(1), 0));
        reading.recv_timeout(Duration::from_secs(30)).expect("the fill uploads unit 1");
        // Waits for unit 1's upload; leasing it then would hold slot 0, which unit 3 needs.
        let acquirer = s.spawn(|| arena.acquire(UnitId(1), stream));
        std::thread::sleep(Duration::from_millis(50));
        source.open_gate();
        (filler.join().unwrap(), acquirer.join().unwrap())
    });
    let report = filled.expect("the fill is not disturbed by the acquisition");
    assert_eq!(report.units, 4, "{report:?}");
    let lease = lease.unwrap();
    arena.release(lease, stream).unwrap();
    assert!(arena.stats().peer_uploads >= 1, "unit 1 came from the store after the fill");
    arena.close().unwrap();
}
