//! The staging pool: buffers reused only once their copies are done, read-ahead, unused
//! announcements, the ceiling.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ddo_core::{FileRange, HostSlice, MockResidency, WeightSource};
use ddo_source::{
    Checkpoint, CheckpointSource, ReadMethod, ReadOptions, RetainedStore, StagedSource,
    StagingOptions, StagingPool,
};

/// A checkpoint of `blocks` blocks (four tensors each), its tensors' ranges and the source.
fn fixture(dir: &std::path::Path, blocks: usize) -> (Arc<Checkpoint>, Vec<FileRange>) {
    let names = common::block_tensors(blocks, 256);
    let tensors: Vec<(&str, Vec<usize>)> =
        names.iter().map(|(n, s)| (n.as_str(), s.clone())).collect();
    let path = common::write(&dir.join("model.safetensors"), &tensors);
    let checkpoint = Arc::new(Checkpoint::open(&path).unwrap());
    let ranges = checkpoint
        .slices()
        .iter()
        .map(|s| FileRange { file: s.file, offset: s.offset, len: s.len })
        .collect();
    (checkpoint, ranges)
}

fn expected(checkpoint: &Checkpoint, r: &FileRange) -> Vec<u8> {
    let s = checkpoint.slices().iter().find(|s| s.offset == r.offset).unwrap();
    common::pattern(&s.name, s.len as usize)
}

fn options(buffers: u64, largest: u64, method: ReadMethod) -> StagingOptions {
    StagingOptions {
        ceiling: buffers * StagingPool::buffer_bytes(largest),
        largest_range: largest,
        readers: 3,
        method,
        chunk_bytes: 8192,
    }
}

fn probe() -> Arc<dyn ddo_core::AdmissionProbe> {
    let mut p = ddo_core::MockAdmissionProbe::new();
    p.expect_admit().returning(|_| ddo_core::Admission::Granted { headroom: 1 << 40 });
    Arc::new(p)
}

/// A device whose copies stay in flight until the test completes them: it holds each copy's
/// slice (as asynchronous adapters do) and drops it on `retire_completed_copies` only once the
/// test marked it complete, checking that its bytes never changed while held.
#[derive(Default)]
struct InFlight {
    held: Mutex<Vec<(HostSlice, Vec<u8>, bool)>>,
}

impl InFlight {
    fn copy(&self, h: HostSlice) {
        let bytes = h.as_bytes().to_vec();
        self.held.lock().unwrap().push((h, bytes, false));
    }
    fn complete_all(&self) {
        for c in self.held.lock().unwrap().iter_mut() {
            c.2 = true;
        }
    }
    fn retire(&self) {
        let mut held = self.held.lock().unwrap();
        for (h, bytes, _) in held.iter() {
            assert_eq!(h.as_bytes(), &bytes[..], "a staging buffer changed under a copy in flight");
        }
        held.retain(|c| !c.2);
    }
}

fn device(inflight: &Arc<InFlight>) -> Arc<dyn ddo_core::Residency> {
    let mut mock = MockResidency::new();
    let d = inflight.clone();
    mock.expect_retire_completed_copies().returning(move || {
        d.retire();
        Ok(())
    });
    Arc::new(mock)
}

#[test]
fn a_buffer_is_reused_only_after_its_copy_completed() {
    let dir = common::scratch();
    let (checkpoint, ranges) = fixture(dir.path(), 4);
    let largest = ranges.iter().map(|r| r.len).max().unwrap();
    let inflight = Arc::new(InFlight::default());
    let store = RetainedStore::new(u64::MAX, probe());
    for method in [ReadMethod::Pread, ReadMethod::Direct] {
        let pool = Arc::new(
            StagingPool::new(
                &checkpoint,
                options(2, largest, method),
                &store,
                Some(device(&inflight)),
            )
            .unwrap(),
        );
        // Two copies in flight take both buffers.
        for r in &ranges[..2] {
            let h = pool.take(*r).unwrap().expect("a buffer");
            assert_eq!(h.as_bytes(), &expected(&checkpoint, r)[..]);
            inflight.copy(h);
        }
        assert_eq!(pool.lent(), 2);
        // A third range waits: no buffer is idle until a copy is proven complete.
        let third = ranges[2];
        let waiting = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.take(third).unwrap().expect("a buffer"))
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(!waiting.is_finished(), "a buffer whose copy is in flight was reused");
        inflight.retire(); // nothing complete yet: the held bytes are checked unchanged
        inflight.complete_all();
        let h = waiting.join().unwrap();
        assert_eq!(h.as_bytes(), &expected(&checkpoint, &third)[..]);
        inflight.copy(h);
        inflight.complete_all();
        inflight.retire();
        assert_eq!(pool.lent(), 0);
    }
}

#[test]
fn announced_ranges_are_read_ahead_and_unused_ones_leak_no_buffer() {
    let dir = common::scratch();
    let (checkpoint, ranges) = fixture(dir.path(), 6);
    let largest = ranges.iter().map(|r| r.len).max().unwrap();
    let store = RetainedStore::new(u64::MAX, probe());
    let pool = StagingPool::new(&checkpoint, options(3, largest, ReadMethod::Direct), &store, None)
        .unwrap();
    pool.announce(&ranges[0..3]);
    // O_DIRECT reads whole aligned blocks: every announced read has landed once this many bytes
    // came in (the ranges' own sum is reached earlier, while the last read may still run).
    let block = if pool.is_direct() { ddo_source::DIRECT_ALIGN as u64 } else { 1 };
    let read =
        |r: &FileRange| (r.offset + r.len).div_ceil(block) * block - r.offset / block * block;
    let deadline = Instant::now() + Duration::from_secs(5);
    while pool.stats().disk_bytes < ranges[0..3].iter().map(read).sum::<u64>() {
        assert!(Instant::now() < deadline, "the announced reads landed");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(pool.holding(), 3);
    // The first is used; the other two never are: the next announcement drops them.
    let h = pool.take(ranges[0]).unwrap().unwrap();
    assert_eq!(h.as_bytes(), &expected(&checkpoint, &ranges[0])[..]);
    drop(h);
    pool.announce(&ranges[5..6]);
    // Every buffer serves again: three unannounced ranges, each promptly.
    for r in &ranges[3..5] {
        let t = Instant::now();
        let h = pool.take(*r).unwrap().expect("an idle buffer");
        assert!(t.elapsed() < Duration::from_secs(5));
        assert_eq!(h.as_bytes(), &expected(&checkpoint, r)[..]);
    }
    let h = pool.take(ranges[5]).unwrap().unwrap();
    assert_eq!(h.as_bytes(), &expected(&checkpoint, &ranges[5])[..]);
    drop(h);
    let stats = pool.stats();
    assert_eq!(pool.holding(), 0, "no buffer kept for a range nobody uses: {stats:?}");
    assert_eq!(stats.read_ahead, 2, "{stats:?}");
    assert_eq!(stats.on_demand, 2, "{stats:?}");
    assert!(stats.dropped >= 2, "{stats:?}");
}

#[test]
fn the_pool_stays_within_its_ceiling_and_refuses_one_that_holds_no_range() {
    let dir = common::scratch();
    let (checkpoint, ranges) = fixture(dir.path(), 2);
    let largest = ranges.iter().map(|r| r.len).max().unwrap();
    let ceiling = 3 * StagingPool::buffer_bytes(largest) + 100;
    let store = RetainedStore::new(ceiling, probe());
    let mut o = options(3, largest, ReadMethod::Pread);
    o.ceiling = ceiling;
    let pool = StagingPool::new(&checkpoint, o, &store, None).unwrap();
    assert_eq!(pool.stats().buffers, 3);
    assert_eq!(store.used(), pool.stats().bytes);
    assert!(store.used() <= ceiling);
    drop(pool);
    assert_eq!(store.used(), 0, "the buffers are given back");
    o.ceiling = StagingPool::buffer_bytes(largest) - 1;
    let err = StagingPool::new(&checkpoint, o, &store, None).unwrap_err();
    assert!(matches!(err, ddo_core::SourceError::CeilingExceeded { what: "staging", .. }), "{err}");
}

#[test]
fn a_staged_source_serves_the_checkpoint_and_notices_a_write() {
    let dir = common::scratch();
    let (checkpoint, ranges) = fixture(dir.path(), 3);
    let largest = ranges.iter().map(|r| r.len).max().unwrap();
    let store = RetainedStore::new(u64::MAX, probe());
    let pool = Arc::new(
        StagingPool::new(&checkpoint, options(2, largest, ReadMethod::Direct), &store, None)
            .unwrap(),
    );
    let reader = CheckpointSource::new(checkpoint.clone(), ReadOptions::pread()).unwrap();
    let source = StagedSource::new(Arc::new(reader), pool.clone());
    source.announce(&ranges[..2]);
    for r in &ranges {
        let pieces = source.host_pieces(r.file, r.offset, r.len).expect("staged");
        assert_eq!(pieces.len(), 1);
        assert_eq!(pieces[0].1.as_bytes(), &expected(&checkpoint, r)[..]);
    }
    source.check_unchanged().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let path = &checkpoint.files()[0].path;
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &[1, 2, 3], ranges[1].offset).unwrap();
    drop(file);
    let err = source.check_unchanged().unwrap_err();
    assert!(matches!(err, ddo_core::SourceError::CheckpointChanged { .. }), "{err}");
    let r = ranges[1];
    assert!(source.host_pieces(r.file, r.offset, r.len).is_none(), "changed bytes are not served");
}

/// Waits until the pool has read `bytes` from disk.
fn read_at_least(pool: &StagingPool, bytes: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while pool.stats().disk_bytes < bytes {
        assert!(Instant::now() < deadline, "the reads landed: {:?}", pool.stats());
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Three 128 KiB tensors that no cover joins (each fills a buffer), and the largest range.
fn three_apart(ranges: &[FileRange]) -> ([FileRange; 3], u64) {
    // to_q, to_k and ff of block 0 and block 1: adjacent pairs exceed one buffer.
    let picked = [ranges[1], ranges[2], ranges[5]];
    let largest = ranges.iter().map(|r| r.len).max().unwrap();
    assert!(picked.iter().all(|r| r.len == largest));
    (picked, largest)
}

#[test]
fn a_served_cover_is_not_read_again_when_buffers_come_back() {
    let dir = common::scratch();
    let (checkpoint, ranges) = fixture(dir.path(), 4);
    let ([x, a, b], largest) = three_apart(&ranges);
    let inflight = Arc::new(InFlight::default());
    let store = RetainedStore::new(u64::MAX, probe());
    let pool = StagingPool::new(
        &checkpoint,
        options(2, largest, ReadMethod::Pread),
        &store,
        Some(device(&inflight)),
    )
    .unwrap();
    // X's copy is in flight; A gets the other buffer, B waits for one.
    inflight.copy(pool.take(x).unwrap().unwrap());
    pool.announce(&[a, b]);
    read_at_least(&pool, x.len + a.len);
    let h = pool.take(a).unwrap().unwrap();
    assert_eq!(h.as_bytes(), &expected(&checkpoint, &a)[..]);
    drop(h); // A's copy done: its buffer goes to B
    read_at_least(&pool, x.len + a.len + b.len);
    inflight.complete_all();
    inflight.retire(); // X's buffer comes back: nothing is left to read
    std::thread::sleep(Duration::from_millis(50));
    let stats = pool.stats();
    assert_eq!(stats.disk_bytes, x.len + a.len + b.len, "A was read once: {stats:?}");
    assert_eq!(pool.holding(), 1, "B alone waits for its take: {stats:?}");
    let h = pool.take(b).unwrap().unwrap();
    assert_eq!(h.as_bytes(), &expected(&checkpoint, &b)[..]);
    drop(h);
    let stats = pool.stats();
    assert_eq!((stats.read_ahead, stats.on_demand), (2, 1), "{stats:?}");
}

#[test]
fn a_take_waiting_for_a_buffer_uses_the_read_ahead_its_range_gets_meanwhile() {
    let dir = common::scratch();
    let (checkpoint, ranges) = fixture(dir.path(), 4);
    let ([x, y, a], largest) = three_apart(&ranges);
    let inflight = Arc::new(InFlight::default());
    let store = RetainedStore::new(u64::MAX, probe());
    let pool = Arc::new(
        StagingPool::new(
            &checkpoint,
            options(2, largest, ReadMethod::Pread),
            &store,
            Some(device(&inflight)),
        )
        .unwrap(),
    );
    // Both buffers lent; A is announced with no buffer to read into, and an upload asks for it.
    inflight.copy(pool.take(x).unwrap().unwrap());
    inflight.copy(pool.take(y).unwrap().unwrap());
    pool.announce(&[a]);
    let waiting = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.take(a).unwrap().expect("a buffer"))
    };
    std::thread::sleep(Duration::from_millis(50));
    assert!(!waiting.is_finished(), "no buffer was idle");
    // The copies complete: the first buffer back reads A ahead, and the take uses that read.
    inflight.complete_all();
    inflight.retire();
    let h = waiting.join().unwrap();
    assert_eq!(h.as_bytes(), &expected(&checkpoint, &a)[..]);
    drop(h);
    let stats = pool.stats();
    assert_eq!(stats.disk_bytes, x.len + y.len + a.len, "A was read once: {stats:?}");
    assert_eq!((stats.read_ahead, stats.on_demand, stats.dropped), (1, 2, 0), "{stats:?}");
}

#[test]
fn a_served_cover_announced_again_is_kept_not_read_again() {
    let dir = common::scratch();
    let (checkpoint, ranges) = fixture(dir.path(), 4);
    let ([a, _, _], largest) = three_apart(&ranges);
    let store = RetainedStore::new(u64::MAX, probe());
    let pool = StagingPool::new(&checkpoint, options(2, largest, ReadMethod::Pread), &store, None)
        .unwrap();
    for pass in 0..3 {
        pool.announce(&[a]);
        assert_eq!(pool.holding(), 1, "pass {pass}: {:?}", pool.stats());
        read_at_least(&pool, a.len);
        let h = pool.take(a).unwrap().unwrap();
        assert_eq!(h.as_bytes(), &expected(&checkpoint, &a)[..]);
    }
    let stats = pool.stats();
    assert_eq!(stats.disk_bytes, a.len, "read once for three passes: {stats:?}");
    assert_eq!((stats.read_ahead, stats.on_demand, stats.dropped), (3, 0, 0), "{stats:?}");
}
