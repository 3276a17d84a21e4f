//! A model test: random acquire / release / pass / reclaim sequences on the host backend against
//! a simple reference model. Invariants: the budget is never exceeded, every lease sees its
//! unit's bytes, an acquisition is refused only when its slot is leased by another unit, and the
//! arena closes cleanly once every lease is back.

mod common;

use ddo_core::{DeviceMemory, Streams};
use std::collections::VecDeque;

use common::*;
use ddo_arena::{Arena, ArenaError, Budget, Lease, UnitSpec};
use ddo_core::UnitId;
use proptest::prelude::*;

const WIDTH: usize = 64;
const BLOCKS: usize = 6;

#[derive(Debug, Clone)]
enum Step {
    Acquire(u32),
    ReleaseOldest,
    ReleaseNewest,
    BeginPass,
    Reclaim,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0u32..=BLOCKS as u32).prop_map(Step::Acquire),
        3 => Just(Step::ReleaseOldest),
        1 => Just(Step::ReleaseNewest),
        1 => Just(Step::BeginPass),
        1 => Just(Step::Reclaim),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_keep_the_invariants(slots in 2u64..4, steps in proptest::collection::vec(step(), 1..60)) {
        let dir = scratch();
        let source = checkpoint(dir.path(), BLOCKS, WIDTH);
        let spy = Spy::new();
        let units = UnitSpec::by_block(source.slices());
        let g = GRANULARITY;
        let unit = ((5 * WIDTH * WIDTH * 2 + WIDTH * 2) as u64).div_ceil(g) * g;
        let budget = Budget { total: g + slots * unit, headroom: 0, prefetch_depth: (slots - 1) as u32 };
        let arena = Arena::new(&spy.platform(), source.clone(), &units, budget).unwrap();
        let stream = spy.create_stream().unwrap();
        let mut live: VecDeque<Lease> = VecDeque::new();

        for s in steps {
            match s {
                Step::Acquire(u) => match arena.acquire(UnitId(u), stream) {
                    Ok(lease) => {
                        let layout = &arena.layout().units[u as usize];
                        for t in &layout.tensors {
                            let (_, r) = arena.tensor_range(t.slice).unwrap();
                            let mut got = vec![0u8; r.len as usize];
                            spy.read_back(r, &mut got).unwrap();
                            let sl = &source.slices()[t.slice];
                            prop_assert_eq!(&got, &pattern(&sl.name, sl.len as usize), "unit {} tensor {}", u, &sl.name);
                        }
                        live.push_back(lease);
                    }
                    Err(ArenaError::SlotBusy { slot, holder, .. }) => {
                        // Refused only if another live lease holds that slot.
                        let held = live.iter().any(|l| l.unit().0 == holder && l.unit().0 != u
                            && arena.plan().slot_of[holder as usize].map(|s| s.0) == Some(slot));
                        prop_assert!(held, "refused without a live holder");
                    }
                    Err(e) => prop_assert!(false, "unexpected error {e}"),
                },
                Step::ReleaseOldest => {
                    if let Some(l) = live.pop_front() {
                        arena.release(l, stream).unwrap();
                    }
                }
                Step::ReleaseNewest => {
                    if let Some(l) = live.pop_back() {
                        arena.release(l, stream).unwrap();
                    }
                }
                Step::BeginPass => arena.begin_pass(),
                Step::Reclaim => {
                    arena.reclaim_idle().unwrap();
                }
            }
            let usage = spy.inner.usage();
            prop_assert!(usage.backing_bytes <= budget.total, "{usage:?} over {}", budget.total);
        }
        while let Some(l) = live.pop_front() {
            arena.release(l, stream).unwrap();
        }
        arena.close().unwrap();
        prop_assert_eq!(spy.inner.usage().backing_bytes, 0);
    }
}
