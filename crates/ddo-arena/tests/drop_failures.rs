//! Contract 2 at drop: an arena that cannot release its memory when dropped keeps it and notes
//! the failure for the host to show, once, with its cause (a test binary of its own: the notes
//! are process-wide, so the cases run in one test, in turn).

mod common;

use common::*;
use ddo_arena::{Arena, ArenaError, Budget, UnitSpec};
use ddo_core::Streams;
use ddo_core::UnitId;

fn arena(spy: &std::sync::Arc<Spy>, dir: &std::path::Path) -> Arena {
    let source = checkpoint(dir, 4, 128);
    let units = UnitSpec::by_block(source.slices());
    let unit = (5 * 128 * 128 * 2 + 128 * 2u64).div_ceil(GRANULARITY) * GRANULARITY;
    let budget = Budget { total: GRANULARITY + 2 * unit, headroom: 0, prefetch_depth: 1 };
    Arena::new(&spy.platform(), source, &units, budget).unwrap()
}

/// An arena whose unit 1 was used and released, on a device whose next fence wait fails.
fn used_then_waits_fail(dir: &std::path::Path) -> (std::sync::Arc<Spy>, Arena) {
    let spy = Spy::new();
    let a = arena(&spy, dir);
    let stream = spy.create_stream().unwrap();
    let lease = a.acquire(UnitId(1), stream).unwrap();
    a.release(lease, stream).unwrap();
    spy.fail(Op::Wait, 0);
    (spy, a)
}

#[test]
fn an_arena_dropped_with_memory_it_cannot_release_notes_it_once_with_its_cause() {
    let dir = scratch();
    assert_eq!(ddo_core::take_drop_failures(), (Vec::new(), 0));

    // A failed release retains its slot unsafe: the drop keeps it and says so.
    let spy = Spy::new();
    let a = arena(&spy, dir.path());
    let stream = spy.create_stream().unwrap();
    let lease = a.acquire(UnitId(1), stream).unwrap();
    spy.fail(Op::Record, 0);
    a.release(lease, stream).unwrap_err();
    let kept = a.kept_bytes();
    assert_eq!(kept, a.plan().slot_len, "the slot retained unsafe");
    drop(a);
    let (notes, _) = ddo_core::take_drop_failures();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert_eq!(notes[0].what, "arena");
    assert_eq!(
        notes[0].message,
        "memory retained unsafe after a failed release cannot be proven idle"
    );
    assert_eq!(notes[0].retained_bytes, Some(kept));
    assert!(!spy.calls().iter().any(|c| matches!(c, Call::ReleaseBacking(_))), "freed at drop");

    // A lease never released: the note says so, not "release every lease first".
    let spy = Spy::new();
    let a = arena(&spy, dir.path());
    let stream = spy.create_stream().unwrap();
    let _never_released = a.acquire(UnitId(1), stream).unwrap();
    drop(a);
    let (notes, _) = ddo_core::take_drop_failures();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(notes[0].message.starts_with("1 lease(s) were never released"), "{}", notes[0]);

    // A close whose fence wait fails at drop: the note carries the device's error.
    let (_spy, a) = used_then_waits_fail(dir.path());
    drop(a);
    let (notes, _) = ddo_core::take_drop_failures();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(notes[0].message.starts_with("wait for outstanding work before close"), "{}", notes[0]);

    // A close failure already returned to a caller is not noted again at drop.
    let (_spy, a) = used_then_waits_fail(dir.path());
    let e = a.close().unwrap_err();
    assert_eq!(a.close_failure(), Some(e.to_string()));
    drop(a);
    assert_eq!(ddo_core::take_drop_failures(), (Vec::new(), 0));

    // A stream that fails to go once the memory is released: the close happened (a second
    // close has nothing to do) and the stream's failure is noted, once.
    let spy = Spy::new();
    let a = arena(&spy, dir.path());
    spy.fail(Op::ReleaseStream, 0);
    a.close().unwrap();
    assert_eq!(a.close_failure(), None);
    a.close().unwrap();
    assert!(matches!(a.acquire(UnitId(1), spy.create_stream().unwrap()), Err(ArenaError::Closed)));
    drop(a);
    let (notes, _) = ddo_core::take_drop_failures();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert_eq!(notes[0].what, "arena's stream");
    assert!(notes[0].message.starts_with("releasing it at close: "), "{}", notes[0]);
    assert!(notes[0].message.contains("injected failure of ReleaseStream"), "{}", notes[0]);
}
