//! The parts of a file or storage that hold the tensors served from it: what is registered
//! when the rest is converted, encoded or not this component's.

use std::collections::HashSet;

use ddo_core::{HostSlice, TensorSlice};

use crate::session::state::HostRange;

/// The ranges of file mappings `maps` holding tensors served as stored (not in `skip`): what a
/// host registers when the rest is converted or encoded.
pub(super) fn stored_runs(
    slices: &[TensorSlice],
    skip: &HashSet<usize>,
    maps: &[HostSlice],
) -> Vec<HostRange> {
    let skip: HashSet<&str> = skip.iter().map(|&i| slices[i].name.as_str()).collect();
    maps.iter()
        .enumerate()
        .flat_map(|(file, map)| {
            used_runs(slices, |t| t.file.0 as usize == file && !skip.contains(t.name.as_str()), map)
        })
        .map(|r| HostRange::new(r, true))
        .collect()
}

/// The parts of `region` (one file or storage, offsets as the slices give them) that the
/// tensors `uses` selects lie in: whole pages, merged across gaps of up to
/// [`ddo_arena::MAX_BRIDGED_GAP`] (a copy spanning such a gap must start and end in one
/// registration).
pub(super) fn used_runs(
    slices: &[TensorSlice],
    uses: impl Fn(&TensorSlice) -> bool,
    region: &HostSlice,
) -> Vec<HostSlice> {
    // Whole host pages: two runs never share a page, so neither registration overlaps the other.
    let page = ddo_platform::linux::page_size();
    let mut runs: Vec<(u64, u64)> = slices
        .iter()
        .filter(|t| t.len > 0 && uses(t))
        .map(|t| (t.offset / page * page, (t.offset + t.len).div_ceil(page) * page))
        .collect();
    runs.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (start, end) in runs {
        match merged.last_mut() {
            Some(last) if start <= last.1 + ddo_arena::MAX_BRIDGED_GAP => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    merged
        .into_iter()
        .filter_map(|(start, end)| {
            let end = end.min(region.len() as u64);
            region
                .slice(usize::try_from(start).ok()?, usize::try_from(end.checked_sub(start)?).ok()?)
        })
        .collect()
}
