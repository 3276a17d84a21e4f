//! The planning fuzz target's steps, shared with the arena's regression tests: any unit sizes
//! (one tensor each, up to 2^64), granularity, budget, headroom and prefetch depth are laid out
//! and planned; an error is fine, a panic or a wrapped size is a finding.

use ddo_arena::{ArenaError, Budget, Layout, MAX_LAYOUT, ResidencyPlan, UnitSpec};
use ddo_core::{CheckpointFileId, Dtype, TensorSlice};

/// Lays out and plans the units `data` describes: `None` when `data` is too short to describe
/// any, else the bytes the placed layout reserves, or the layout's or the plan's refusal.
pub(crate) fn plan(data: &[u8]) -> Option<Result<u64, ArenaError>> {
    if data.len() < 26 {
        return None;
    }
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
    let planned = Layout::build(&slices, &units, granularity).and_then(|mut layout| {
        let plan = ResidencyPlan::new(&layout, budget)?;
        let streamed: Vec<bool> = plan.resident.iter().map(|r| !r).collect();
        layout.place(plan.slot_len, &streamed);
        assert!(layout.reserved <= MAX_LAYOUT);
        Ok(layout.reserved)
    });
    Some(planned)
}
