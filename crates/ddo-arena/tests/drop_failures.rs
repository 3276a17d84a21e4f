//! Contract 2 at drop: an arena that cannot release its memory when dropped keeps it and notes
//! the failure for the host to show (a test binary of its own: the notes are process-wide).

mod common;

use common::*;
use ddo_arena::{Arena, Budget, UnitSpec};
use ddo_core::{Residency, UnitId};

#[test]
fn an_arena_dropped_with_memory_it_cannot_release_notes_what_it_kept() {
    let dir = scratch();
    let source = checkpoint(dir.path(), 4, 128);
    let spy = Spy::new();
    let units = UnitSpec::by_block(source.slices());
    let unit = (5 * 128 * 128 * 2 + 128 * 2u64).div_ceil(GRANULARITY) * GRANULARITY;
    let budget = Budget { total: GRANULARITY + 2 * unit, headroom: 0, prefetch_depth: 1 };
    let arena = Arena::new(&spy.platform(), source, &units, budget).unwrap();
    let stream = spy.create_stream().unwrap();
    let lease = arena.acquire(UnitId(1), stream).unwrap();
    spy.fail(Op::Record, 0);
    arena.release(lease, stream).unwrap_err();
    let kept = arena.stats().resident_bytes + arena.stats().slot_bytes;
    assert_eq!(ddo_core::take_drop_failures(), (Vec::new(), 0));
    drop(arena);
    let (notes, _) = ddo_core::take_drop_failures();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert_eq!(notes[0].what, "arena");
    assert!(notes[0].message.starts_with("close refused"), "{}", notes[0]);
    assert_eq!(notes[0].retained_bytes, Some(kept));
    assert!(
        !spy.calls().iter().any(|c| matches!(c, Call::ReleaseBacking(_))),
        "memory retained unsafe was freed at drop"
    );
}
