//! The safety contracts of DESIGN section 4 that the arena carries, each with a test that fails
//! if the contract breaks: fenced reuse (1), retain on release failure (2), cleanup once with the
//! original error first (3), separate ceilings (4).

mod common;

use std::sync::Arc;

use common::*;
use ddo_arena::{Arena, ArenaError, Budget, UnitSpec};
use ddo_core::{
    BackingId, DeviceAddress, DeviceError, DeviceRange, MockFence, MockResidency, Platform,
    Reservation, StreamId, UnitId,
};

const WIDTH: usize = 128;

fn unit_bytes() -> u64 {
    let block = (5 * WIDTH * WIDTH * 2 + WIDTH * 2) as u64;
    block.div_ceil(GRANULARITY) * GRANULARITY
}

fn budget(slots: u64) -> Budget {
    Budget {
        total: GRANULARITY + slots * unit_bytes(),
        headroom: 0,
        prefetch_depth: slots as u32 - 1,
    }
}

fn spy_arena(blocks: usize, slots: u64) -> (tempfile::TempDir, Arc<Spy>, Arena, StreamId) {
    let dir = scratch();
    let source = checkpoint(dir.path(), blocks, WIDTH);
    let spy = Spy::new();
    let units = UnitSpec::by_block(source.slices());
    let arena = Arena::new(&spy.platform(), source, &units, budget(slots)).unwrap();
    let stream = ddo_core::Streams::create_stream(&*spy).unwrap();
    (dir, spy, arena, stream)
}

/// The fence the spy last recorded on `stream`.
fn last_record(spy: &Spy, stream: StreamId) -> ddo_core::FenceValue {
    spy.calls()
        .iter()
        .rev()
        .find_map(|c| match c {
            Call::Record(r, f) if *r == stream => Some(*f),
            _ => None,
        })
        .expect("a fence recorded on the stream")
}

/// Contract 1: a slot is reused only after the copy stream waits for every consumer fence
/// recorded since its last upload.
#[test]
fn slot_reuse_waits_for_every_consumer_fence() {
    let (_d, spy, arena, stream) = spy_arena(4, 2);
    let copy = arena.copy_stream();
    // Unit 1 -> slot 0; unit 3 -> slot 0 again.
    let a = arena.acquire(UnitId(1), stream).unwrap();
    arena.release(a, stream).unwrap();
    let release_fence = last_record(&spy, stream);
    let unit3 = arena.unit_range(UnitId(3)).unwrap();
    let mark = spy.calls().len();
    let c = arena.acquire(UnitId(3), stream).unwrap();
    let after = &spy.calls()[mark..];
    let wait = after.iter().position(|c| *c == Call::StreamWait(copy, release_fence));
    let first_copy = after.iter().position(|c| matches!(c, Call::Copy(addr, _, s) if *addr >= unit3.start.0 && *addr < unit3.end() && *s == copy));
    assert!(wait.is_some(), "no wait on the release fence: {after:?}");
    assert!(first_copy.is_some(), "unit 3 was not uploaded: {after:?}");
    assert!(
        wait < first_copy,
        "the upload was enqueued before waiting for the consumer: {after:?}"
    );
    arena.release(c, stream).unwrap();
}

/// Contract 1 across passes: a slot's reuse waits for the last release of each consumer stream
/// (a later fence on a stream completes after the earlier ones), and a resident unit keeps one
/// fence per stream however many passes release it: close waits on a handful, not thousands.
#[test]
fn release_fences_are_kept_per_consumer_stream() {
    let (_d, spy, arena, stream) = spy_arena(4, 2);
    let other = ddo_core::Streams::create_stream(&*spy).unwrap();
    let copy = arena.copy_stream();
    let record = |s: StreamId| last_record(&spy, s);
    for _ in 0..3 {
        let a = arena.acquire(UnitId(1), stream).unwrap();
        arena.release(a, stream).unwrap();
    }
    let last_on_stream = record(stream);
    let a = arena.acquire(UnitId(1), other).unwrap();
    arena.release(a, other).unwrap();
    let last_on_other = record(other);
    let mark = spy.calls().len();
    let c = arena.acquire(UnitId(3), stream).unwrap();
    let waits: Vec<_> = spy.calls()[mark..]
        .iter()
        .filter_map(|c| match c {
            Call::StreamWait(s, f) if *s == copy => Some(*f),
            _ => None,
        })
        .collect();
    assert!(waits.contains(&last_on_stream) && waits.contains(&last_on_other), "{waits:?}");
    assert!(waits.len() <= 3, "slot reuse waited on superseded fences: {waits:?}");
    arena.release(c, stream).unwrap();
    for _ in 0..500 {
        let r = arena.acquire(UnitId(0), stream).unwrap();
        arena.release(r, stream).unwrap();
    }
    let mark = spy.calls().len();
    arena.close().unwrap();
    let waited = spy.calls()[mark..].iter().filter(|c| matches!(c, Call::Wait(_))).count();
    assert!(waited <= 12, "close waited on {waited} fences after 500 releases of one unit");
}

/// Contract 1: freeing (reclaim) needs a host-observed fence; an incomplete one frees nothing.
#[test]
fn reclaim_frees_nothing_while_a_fence_is_incomplete() {
    let (_d, spy, arena, stream) = spy_arena(3, 2);
    for u in 0..4 {
        let l = arena.acquire(UnitId(u), stream).unwrap();
        arena.release(l, stream).unwrap();
    }
    *spy.query_answer.lock().unwrap() = Some(false);
    let mark = spy.calls().len();
    assert_eq!(arena.reclaim_idle().unwrap().slots, 0);
    let after = &spy.calls()[mark..];
    assert!(
        after.iter().any(|c| matches!(c, Call::Query(_))),
        "reclaim must ask the fence: {after:?}"
    );
    assert!(
        !after.iter().any(|c| matches!(c, Call::Unmap(_) | Call::ReleaseBacking(_))),
        "{after:?}"
    );
    *spy.query_answer.lock().unwrap() = None;
    assert_eq!(arena.reclaim_idle().unwrap().slots, 2);
}

/// Contract 1 with mockall: a fence query that never completes keeps every mapping.
#[test]
fn mocked_incomplete_fences_keep_memory_mapped() {
    let mut residency = MockResidency::new();
    residency.expect_granularity().returning(|| Ok(GRANULARITY));
    residency.expect_reserve().returning(|len| {
        Ok(Reservation { range: DeviceRange { start: DeviceAddress(1 << 40), len } })
    });
    let mut next = 0;
    residency.expect_create_backing().returning(move |_| {
        next += 1;
        Ok(BackingId(next))
    });
    residency.expect_map().returning(|_, _| Ok(()));
    residency.expect_create_stream().returning(|| Ok(StreamId(7)));
    residency.expect_copy_to_device().returning(|_, _, _| Ok(()));
    residency.expect_unmap().never();
    residency.expect_release_backing().never();
    residency.expect_release_reservation().never();
    let mut fences = MockFence::new();
    let mut value = 0;
    fences.expect_record().returning(move |_| {
        value += 1;
        Ok(ddo_core::FenceValue(value))
    });
    fences.expect_stream_wait().returning(|_, _| Ok(()));
    fences.expect_query().returning(|_| Ok(false));
    fences.expect_wait().returning(|_| Err(DeviceError::Lost("no completion".into())));
    let platform = Platform {
        name: "mock",
        residency: Arc::new(residency),
        fences: Arc::new(fences),
        admission: Arc::new(ddo_platform::LinuxAdmissionProbe::system()),
    };
    let dir = scratch();
    let source = checkpoint(dir.path(), 3, WIDTH);
    let units = UnitSpec::by_block(source.slices());
    let arena = Arena::new(&platform, source, &units, budget(2)).unwrap();
    for u in 0..4 {
        let l = arena.acquire(UnitId(u), StreamId(7)).unwrap();
        arena.release(l, StreamId(7)).unwrap();
    }
    assert_eq!(arena.reclaim_idle().unwrap().slots, 0);
    // Close cannot prove completion: it fails and keeps everything (the mock forbids frees).
    let e = arena.close().unwrap_err();
    assert!(e.to_string().starts_with("wait for outstanding work before close"), "{e}");
    assert!(arena.stats().unsafe_retained_bytes > 0);
    assert!(matches!(arena.close(), Err(ArenaError::CloseRefused { .. })));
}

/// Contract 2: a release whose fence cannot be recorded retains the slot: never reused, close
/// refuses and reports the bytes, nothing is freed.
#[test]
fn a_failed_release_retains_and_refuses_reuse_and_close() {
    let (_d, spy, arena, stream) = spy_arena(4, 2);
    let l = arena.acquire(UnitId(1), stream).unwrap();
    spy.fail(Op::Record, 0);
    let e = arena.release(l, stream).unwrap_err();
    assert!(e.to_string().starts_with("record the consumer's completion fence"), "{e}");
    let retained = arena.stats().unsafe_retained_bytes;
    assert_eq!(retained, arena.plan().slot_len);
    // Unit 3 shares slot 0: refused.
    let e = arena.acquire(UnitId(3), stream).unwrap_err();
    assert!(matches!(e, ArenaError::Unsafe { .. }), "{e}");
    let mark = spy.calls().len();
    let e = arena.close().unwrap_err();
    assert!(matches!(e, ArenaError::CloseRefused { retained: r, .. } if r == retained), "{e}");
    assert!(spy.calls()[mark..].is_empty(), "close touched the device: {:?}", &spy.calls()[mark..]);
    // Unit 2 (slot 1) still works.
    let ok = arena.acquire(UnitId(2), stream).unwrap();
    arena.release(ok, stream).unwrap();
}

/// Contract 2: the bytes a failed release retains are counted once, however many of the
/// memory's leases fail to be given back, by `release` and `release_all` alike.
#[test]
fn failed_releases_count_the_retained_bytes_once() {
    let (_d, spy, arena, stream) = spy_arena(4, 2);
    let leases: Vec<_> = (0..4).map(|_| arena.acquire(UnitId(1), stream).unwrap()).collect();
    let mut leases = leases.into_iter();
    for nth in 0..3 {
        spy.fail(Op::Record, nth);
    }
    arena.release(leases.next().unwrap(), stream).unwrap_err();
    arena.release(leases.next().unwrap(), stream).unwrap_err();
    arena.release_all(leases.collect(), stream).unwrap_err();
    assert_eq!(arena.stats().unsafe_retained_bytes, arena.plan().slot_len);
    let e = arena.close().unwrap_err();
    assert!(
        matches!(e, ArenaError::CloseRefused { retained, .. } if retained == arena.plan().slot_len),
        "{e}"
    );
}

/// Contracts 1 and 2 for pass leases: resident units leased for a pass are given back after one
/// fence on the consumer (its work on them completes before their memory can go), a unit the
/// plan streams is refused with nothing left leased, and a failed record retains every unit.
#[test]
fn pass_leases_end_on_one_fence_and_a_failed_one_retains_them_all() {
    let (_d, spy, arena, stream) = spy_arena(4, 2);
    let e = arena.lease_for_pass(&[UnitId(0), UnitId(1)], stream).unwrap_err();
    assert!(e.to_string().contains("streams through a slot"), "{e}");
    let e = arena.reached(UnitId(0)).unwrap_err();
    assert!(e.to_string().contains("not held by a pass lease"), "{e}");
    arena.begin_pass();
    let leases = arena.lease_for_pass(&[UnitId(0)], stream).unwrap();
    arena.reached(UnitId(0)).unwrap();
    let mark = spy.calls().len();
    arena.release_all(leases, stream).unwrap();
    let records: Vec<_> =
        spy.calls()[mark..].iter().filter(|c| matches!(c, Call::Record(..))).cloned().collect();
    assert_eq!(records.len(), 1, "{records:?}");
    let Call::Record(_, fence) = records[0] else { unreachable!() };
    let mark = spy.calls().len();
    arena.close().unwrap();
    assert!(
        spy.calls()[mark..].contains(&Call::Wait(fence)),
        "close did not wait on the pass fence"
    );

    let (_d, spy, arena, stream) = spy_arena(4, 2);
    let mut leases = arena.lease_for_pass(&[UnitId(0)], stream).unwrap();
    leases.push(arena.acquire(UnitId(1), stream).unwrap());
    spy.fail(Op::Record, 0);
    let e = arena.release_all(leases, stream).unwrap_err();
    assert!(e.to_string().starts_with("record the consumer's completion fence"), "{e}");
    let resident = arena.stats().resident_bytes;
    assert_eq!(arena.stats().unsafe_retained_bytes, resident + arena.plan().slot_len);
    assert!(matches!(arena.close().unwrap_err(), ArenaError::CloseRefused { .. }));
}

/// Contract 2: an unmap failure during reclaim keeps the backing (no release) and marks it unsafe.
#[test]
fn a_failed_unmap_keeps_the_backing() {
    let (_d, spy, arena, stream) = spy_arena(4, 2);
    let l = arena.acquire(UnitId(1), stream).unwrap();
    arena.release(l, stream).unwrap();
    spy.fail(Op::Unmap, 0);
    let mark = spy.calls().len();
    let e = arena.reclaim_idle().unwrap_err();
    assert!(e.to_string().starts_with("unmap slot memory for reclaim"), "{e}");
    assert!(!spy.calls()[mark..].iter().any(|c| matches!(c, Call::ReleaseBacking(_))));
    assert!(matches!(arena.close(), Err(ArenaError::CloseRefused { .. })));
}

/// Contract 3: a failed setup cleans up once, returns the original error, and attaches a
/// cleanup error instead of replacing the original with it.
#[test]
fn setup_failure_cleans_up_once_and_keeps_the_original_error() {
    let dir = scratch();
    let source = checkpoint(dir.path(), 4, WIDTH);
    let units = UnitSpec::by_block(source.slices());

    let spy = Spy::new();
    spy.fail(Op::CreateBacking, 2);
    let e = Arena::new(&spy.platform(), source.clone(), &units, budget(2)).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("create slot memory: device lost: injected failure of CreateBacking"),
        "{e}"
    );
    let calls = spy.calls();
    let created: Vec<_> = calls.iter().filter(|c| matches!(c, Call::CreateBacking(_))).collect();
    let released: Vec<_> = calls.iter().filter(|c| matches!(c, Call::ReleaseBacking(_))).collect();
    assert_eq!(created.len(), released.len(), "every created backing released once: {calls:?}");
    assert_eq!(calls.iter().filter(|c| **c == Call::ReleaseReservation).count(), 1);
    assert_eq!(spy.inner.usage().backing_bytes, 0);
    assert_eq!(spy.inner.usage().reserved_bytes, 0);

    let spy = Spy::new();
    spy.fail(Op::CreateBacking, 2);
    spy.fail(Op::ReleaseReservation, 0);
    let e = Arena::new(&spy.platform(), source, &units, budget(2)).unwrap_err();
    match &e {
        ArenaError::WithCleanup { error, cleanup } => {
            assert!(error.to_string().starts_with("create slot memory"), "{error}");
            assert!(cleanup.to_string().starts_with("release device addresses"), "{cleanup}");
        }
        other => panic!("{other}"),
    }
    assert!(e.original().to_string().starts_with("create slot memory"));
    assert_eq!(std::error::Error::source(&e).unwrap().to_string(), e.original().to_string());
    assert_eq!(
        spy.calls().iter().filter(|c| **c == Call::ReleaseReservation).count(),
        0,
        "the failed call is not retried"
    );
}

/// Contract 4: the GPU ceiling counts physical memory only; the address reservation spans every
/// unit and is not residency.
#[test]
fn address_reservation_is_not_residency() {
    let (_d, spy, arena, stream) = spy_arena(8, 2);
    let b = budget(2);
    let usage = spy.inner.usage();
    assert!(usage.reserved_bytes > b.total, "{usage:?}");
    for u in 0..9 {
        let l = arena.acquire(UnitId(u), stream).unwrap();
        arena.release(l, stream).unwrap();
    }
    let usage = spy.inner.usage();
    assert!(usage.peak_backing_bytes <= b.total, "{usage:?} > {}", b.total);
    assert_eq!(usage.registered_bytes, 0);
}

/// Fault injection at every port call the arena makes during setup and two passes: each
/// failure is an error (never a panic), and afterwards the arena either still serves correct
/// bytes or refuses; no backing is released while a lease is live.
#[test]
fn any_single_port_failure_is_an_error_and_loses_nothing() {
    let ops = [
        Op::Reserve,
        Op::ReleaseReservation,
        Op::CreateBacking,
        Op::Map,
        Op::Unmap,
        Op::ReleaseBacking,
        Op::CreateStream,
        Op::Copy,
        Op::Record,
        Op::Query,
        Op::Wait,
        Op::StreamWait,
    ];
    for op in ops {
        for nth in 0..6 {
            let dir = scratch();
            let source = checkpoint(dir.path(), 4, WIDTH);
            let spy = Spy::new();
            spy.fail(op, nth);
            let units = UnitSpec::by_block(source.slices());
            let arena = match Arena::new(&spy.platform(), source.clone(), &units, budget(2)) {
                Ok(a) => a,
                Err(e) => {
                    assert!(!e.to_string().is_empty());
                    assert_eq!(
                        spy.inner.usage().backing_bytes,
                        0,
                        "{op:?}/{nth}: setup failure leaked"
                    );
                    continue;
                }
            };
            let stream = StreamId(1);
            let mut failures = 0;
            for u in (0..5).chain(0..5) {
                match arena.acquire(UnitId(u), stream) {
                    Ok(lease) => {
                        let layout = &arena.layout().units[u as usize];
                        for t in &layout.tensors {
                            let (_, r) = arena.tensor_range(t.slice).unwrap();
                            let mut got = vec![0u8; r.len as usize];
                            ddo_core::DeviceMemory::read_back(&*spy, r, &mut got).unwrap();
                            let s = &source.slices()[t.slice];
                            assert_eq!(
                                got,
                                pattern(&s.name, s.len as usize),
                                "{op:?}/{nth}: unit {u} bytes"
                            );
                        }
                        if arena.release(lease, stream).is_err() {
                            failures += 1;
                        }
                    }
                    Err(_) => failures += 1,
                }
            }
            let _ = failures;
            // Reclaim and close exercise the release paths: a failure there keeps the memory
            // (close refuses and reports it); success frees everything.
            let _ = arena.reclaim_idle();
            match arena.close() {
                Ok(()) => assert_eq!(
                    spy.inner.usage().backing_bytes,
                    0,
                    "{op:?}/{nth}: closed but memory left"
                ),
                Err(e) => {
                    assert!(
                        spy.inner.usage().backing_bytes > 0 || spy.inner.usage().reserved_bytes > 0,
                        "{op:?}/{nth}: {e} but nothing kept"
                    );
                }
            }
        }
    }
}

#[test]
fn leases_never_exceed_the_slots() {
    let (_d, _spy, arena, stream) = spy_arena(4, 2);
    let a = arena.acquire(UnitId(1), stream).unwrap();
    let b = arena.acquire(UnitId(2), stream).unwrap();
    let e = arena.acquire(UnitId(3), stream).unwrap_err();
    assert_eq!(
        e.to_string(),
        "unit 3 needs slot 0, which is leased by unit 1; release leases in execution order (at most 2 streamed units can be held at once)"
    );
    arena.release(a, stream).unwrap();
    arena.release(b, stream).unwrap();
    let c = arena.acquire(UnitId(3), stream).unwrap();
    arena.release(c, stream).unwrap();
}

/// A lease belongs to the arena that granted it: given to another arena it is refused and handed
/// back, so it is released to its own arena and both arenas stay usable and close.
#[test]
fn a_lease_from_another_arena_is_refused_and_returned() {
    let (_d1, _spy1, first, stream) = spy_arena(4, 2);
    let (_d2, _spy2, second, _) = spy_arena(4, 2);
    let lease = first.acquire(UnitId(1), stream).unwrap();
    let err = second.release(lease, stream).unwrap_err();
    assert!(err.to_string().contains("from another arena"), "{err}");
    let lease = err.into_foreign_lease().expect("the refused lease comes back");
    assert_eq!(lease.unit(), UnitId(1));
    let again = second.acquire(UnitId(1), stream).unwrap();
    second.release(again, stream).unwrap();
    first.release(lease, stream).unwrap();
    first.close().unwrap();
    second.close().unwrap();
}

/// Contract 1 under a failing port: a wait that fails while a slot is being reused leaves every
/// consumer's fence recorded, so the retried upload still waits for each stream that read it.
#[test]
fn a_failed_wait_during_reuse_keeps_every_consumer_fence() {
    let (_d, spy, arena, a) = spy_arena(4, 2);
    let b = ddo_core::Streams::create_stream(&*spy).unwrap();
    let copy = arena.copy_stream();
    // Unit 1 (slot 0) read on two streams.
    let la = arena.acquire(UnitId(1), a).unwrap();
    let lb = arena.acquire(UnitId(1), b).unwrap();
    arena.release(la, a).unwrap();
    let fa = last_record(&spy, a);
    arena.release(lb, b).unwrap();
    let fb = last_record(&spy, b);
    // Unit 3 takes slot 0: the wait on stream a's fence fails (wait 0 is for the slot's upload).
    spy.fail(Op::StreamWait, 1);
    assert!(arena.acquire(UnitId(3), a).is_err());
    let mark = spy.calls().len();
    let l3 = arena.acquire(UnitId(3), a).unwrap();
    let after = &spy.calls()[mark..];
    for f in [fa, fb] {
        assert!(
            after.contains(&Call::StreamWait(copy, f)),
            "the retried upload did not wait for {f:?}: {after:?}"
        );
    }
    arena.release(l3, a).unwrap();
    arena.close().unwrap();
}

/// `release_all` gives this arena's leases back and hands back every lease of another arena,
/// so both arenas reach zero live leases and close.
#[test]
fn release_all_hands_back_every_foreign_lease() {
    let (_d1, _spy1, first, stream) = spy_arena(4, 2);
    let (_d2, _spy2, second, _) = spy_arena(4, 2);
    let leases = vec![
        second.acquire(UnitId(0), stream).unwrap(),
        first.acquire(UnitId(0), stream).unwrap(),
        first.acquire(UnitId(1), stream).unwrap(),
    ];
    let err = second.release_all(leases, stream).unwrap_err();
    assert!(err.to_string().contains("2 lease(s) from another arena"), "{err}");
    let back = err.into_foreign_leases();
    assert_eq!(back.iter().map(|l| l.unit()).collect::<Vec<_>>(), [UnitId(0), UnitId(1)]);
    first.release_all(back, stream).unwrap();
    first.close().unwrap();
    second.close().unwrap();
}
