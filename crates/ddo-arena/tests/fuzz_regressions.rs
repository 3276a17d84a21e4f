//! Inputs the fuzz targets found, kept as tests (the harness is the `planning` target's).

use ddo_arena::{Budget, Layout, ResidencyPlan, UnitSpec};
use ddo_core::{CheckpointFileId, Dtype, TensorSlice};

/// The `planning` fuzz target's steps; `Err` is fine, a panic or wrap is not.
fn plan(data: &[u8]) {
    let word = |i: usize| u64::from_le_bytes(data[i..i + 8].try_into().expect("8 bytes"));
    let granularity = 1u64 << (data[0] % 24);
    let budget = Budget { total: word(1), headroom: word(9), prefetch_depth: u32::from(data[17]) };
    let pinned_mask = data[18];
    let mut slices = Vec::new();
    let mut offset = 0u64;
    for (i, chunk) in data[26..].chunks_exact(8).take(64).enumerate() {
        let len = u64::from_le_bytes(chunk.try_into().expect("8 bytes")) >> (chunk[0] % 64);
        slices.push(TensorSlice {
            name: format!("blocks.{i}.w"),
            dtype: Dtype::U8,
            shape: vec![len],
            file: CheckpointFileId(0),
            path: "fuzz".into(),
            offset,
            len,
        });
        offset = offset.saturating_add(len);
    }
    let units: Vec<UnitSpec> = (0..slices.len())
        .map(|i| UnitSpec {
            name: format!("u{i}"),
            tensors: vec![i],
            pinned: pinned_mask >> (i % 8) & 1 == 1,
        })
        .collect();
    if let Ok(mut layout) = Layout::build(&slices, &units, granularity)
        && let Ok(plan) = ResidencyPlan::new(&layout, budget)
    {
        let streamed: Vec<bool> = plan.resident.iter().map(|r| !r).collect();
        layout.place(plan.slot_len, &streamed);
        assert!(layout.reserved <= ddo_arena::MAX_LAYOUT);
    }
}

/// Streamed units whose slot ranges would overflow the placed layout.
#[test]
fn slots_that_would_overflow_the_placed_layout_are_refused() {
    plan(&[
        0, 0, 0, 26, 0, 0, 0, 246, 32, 7, 7, 7, 0, 0, 0, 0, 0, 0, 0, 0, 95, 0, 0, 26, 0, 0, 0, 246,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 95, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 255, 4, 4, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 234,
        234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234,
        234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 4, 4, 4, 4, 4, 4, 255, 3,
        4, 4, 4, 4, 4, 58, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 36,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 184, 184, 184, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 8, 4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 4, 4, 4, 4, 4, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 255, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234,
        234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234,
        234, 234, 4, 4, 4, 4, 4, 4, 255, 3, 4, 4, 4, 4, 4, 58, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 26, 0, 95, 0, 0, 0, 0, 0,
        0,
    ]);
}
