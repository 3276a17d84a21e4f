//! Residency planning: which units stay resident and how many execution slots stream the rest.

use ddo_core::SlotId;

use crate::{ArenaError, Layout, UnitLayout};

/// The budget an arena plans for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// GPU bytes the arena may use, headroom included.
    pub total: u64,
    /// Bytes of `total` kept free for activations.
    pub headroom: u64,
    /// Streamed units kept in flight ahead of execution; the planner wants `prefetch_depth + 1`
    /// slots when the budget allows (never fewer than two).
    pub prefetch_depth: u32,
}

/// The plan: resident units, slot count and size, and each streamed unit's slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResidencyPlan {
    /// The budget planned for.
    pub budget: Budget,
    /// Per unit: kept resident.
    pub resident: Vec<bool>,
    /// Number of execution slots (0 when everything is resident).
    pub slots: u32,
    /// Bytes of one slot.
    pub slot_len: u64,
    /// Per unit: its slot, for streamed units (see `assign_slots`).
    pub slot_of: Vec<Option<SlotId>>,
    /// Device bytes of resident units.
    pub resident_bytes: u64,
    /// Bytes uploaded per pass in steady state, as stored (before any device conversion):
    /// streamed units sharing a slot (a unit alone in its slot is uploaded once and stays).
    pub streamed_bytes: u64,
}

impl ResidencyPlan {
    /// Device bytes the plan holds at most: resident units plus slots.
    pub fn device_bytes(&self) -> u64 {
        self.resident_bytes + u64::from(self.slots) * self.slot_len
    }

    /// Units streamed each pass.
    pub fn streamed_units(&self) -> usize {
        self.resident.iter().filter(|r| !**r).count()
    }

    /// Plans `layout` under `budget`: streams through `prefetch_depth + 1` slots (at least two,
    /// fewer extra ones when the budget is tight), sized to the largest streamed unit, and keeps
    /// whole units resident in what is left, spread through the execution order. Of the slot
    /// sizes that fit, the one whose pass simulates shortest is chosen (see `simulated_pass`),
    /// then the one keeping the most bytes resident. Pinned units are always resident.
    pub fn new(layout: &Layout, budget: Budget) -> Result<ResidencyPlan, ArenaError> {
        // The staging buffer of device conversions is mapped for the arena's life.
        let usable =
            budget.total.saturating_sub(budget.headroom).saturating_sub(layout.staging_len);
        let units = &layout.units;
        let pinned: u64 = units.iter().filter(|u| u.pinned).map(|u| u.len).sum();
        let candidates: Vec<usize> = (0..units.len()).filter(|&i| !units[i].pinned).collect();
        let all: u64 = pinned + candidates.iter().map(|&i| units[i].len).sum::<u64>();
        let largest = units.iter().map(|u| u.len).max().unwrap_or(0);
        let desired_slots = budget.prefetch_depth.saturating_add(1).max(2);

        if all <= usable {
            let resident = vec![true; units.len()];
            return Ok(Self::finish(layout, budget, resident, 0, 0));
        }

        let mut sizes: Vec<u64> = candidates.iter().map(|&i| units[i].len).collect();
        sizes.sort_unstable();
        sizes.dedup();
        // One candidate per slot size: units larger than the slot stay resident, then as many
        // of the others as fit, spread through the execution order. The candidate whose pass
        // simulates shortest wins (a plan that keeps the most bytes resident may bunch its
        // streamed units into one stretch the link cannot cover), then the most resident bytes,
        // then the most slots.
        let mut best: Option<(f64, u64, u32, Vec<bool>, u64)> = None;
        // Without a unit that can stream, the pinned units are all there is to hold.
        let mut needed = if candidates.is_empty() { all } else { u64::MAX };
        for &slot in sizes.iter().rev() {
            let mut resident: Vec<bool> = units.iter().map(|u| u.pinned).collect();
            let mut cost = pinned + 2 * slot;
            for &i in &candidates {
                if units[i].len > slot {
                    resident[i] = true;
                    cost += units[i].len;
                }
            }
            needed = needed.min(cost);
            if cost > usable {
                continue;
            }
            let mut left = usable - cost;
            let extra = u32::try_from(left / slot).unwrap_or(u32::MAX).min(desired_slots - 2);
            let slots = 2 + extra;
            left -= u64::from(extra) * slot;
            let small: Vec<usize> = candidates.iter().copied().filter(|&i| !resident[i]).collect();
            // Two selections of the extra resident units, each simulated: the most that fit
            // evenly spaced through the execution order (so the streamed ones are too, and
            // their uploads spread over the pass), then any other that still fits; and the
            // bisecting order alone, which fits more of them where sizes are unequal.
            for even in [true, false] {
                let mut resident = resident.clone();
                let mut left = left;
                if even {
                    keep_evenly_spaced(units, &small, &mut resident, &mut left);
                }
                for i in spread_order(small.len()) {
                    let u = small[i];
                    if !resident[u]
                        && units[u].len <= left
                        && !all_but_none_streamed(&resident, &candidates, u)
                    {
                        resident[u] = true;
                        left -= units[u].len;
                    }
                }
                let resident_bytes: u64 =
                    units.iter().zip(&resident).filter(|(_, r)| **r).map(|(u, _)| u.len).sum();
                let pass = simulated_pass(layout, &resident, slots as usize);
                let better = match &best {
                    None => true,
                    Some((t, bytes, s, _, _)) => {
                        pass < t * (1.0 - SIMULATION_TOLERANCE)
                            || (pass <= t * (1.0 + SIMULATION_TOLERANCE)
                                && (resident_bytes > *bytes
                                    || (resident_bytes == *bytes && slots > *s)))
                    }
                };
                if better {
                    best = Some((pass, resident_bytes, slots, resident, slot));
                }
            }
        }
        let Some((_, _, slots, resident, slot)) = best else {
            return Err(ArenaError::BudgetTooSmall {
                budget: budget.total,
                headroom: budget.headroom,
                needed: needed.saturating_add(layout.staging_len),
                largest_unit: largest,
                staging: layout.staging_len,
                streams: !candidates.is_empty(),
            });
        };
        // Every streamed unit's range spans a whole slot: the placed layout must stay bounded.
        let placed = units.iter().zip(&resident).try_fold(0u64, |acc, (u, r)| {
            acc.checked_add(if *r { u.len } else { slot.max(u.len) })
        });
        if placed.is_none_or(|p| p > crate::MAX_LAYOUT) {
            return Err(ArenaError::InvalidUnits(format!(
                "{} streamed units in slots of {slot} bytes exceed what an arena can lay out ({} bytes)",
                resident.iter().filter(|r| !**r).count(),
                crate::MAX_LAYOUT
            )));
        }
        Ok(Self::finish(layout, budget, resident, slots, slot))
    }

    fn finish(
        layout: &Layout,
        budget: Budget,
        resident: Vec<bool>,
        slots: u32,
        slot_len: u64,
    ) -> ResidencyPlan {
        let lens: Vec<u64> = layout.units.iter().map(|u| u.len).collect();
        let slot_of = assign_slots(&lens, &resident, slots as usize);
        let resident_bytes =
            layout.units.iter().zip(&resident).filter(|(_, r)| **r).map(|(u, _)| u.len).sum();
        // A unit alone in its slot is uploaded once and stays: it is not streamed per pass.
        let mut sharing = vec![0u32; slots as usize];
        for s in slot_of.iter().flatten() {
            sharing[s.0 as usize] += 1;
        }
        let streamed_bytes = layout
            .units
            .iter()
            .zip(&slot_of)
            .filter(|(_, s)| s.is_some_and(|s| sharing[s.0 as usize] > 1))
            .map(|(u, _)| u.link_bytes())
            .sum();
        ResidencyPlan { budget, resident, slots, slot_len, slot_of, resident_bytes, streamed_bytes }
    }
}

/// Slots for the streamed units (`!resident[i]`), in unit order, over `k` slots. A unit's upload
/// can start only once its slot's previous occupant has run, so it overlaps with the units that run
/// between the two (the wrap to the next pass included). Candidates: round-robin, and rounds
/// `0..d` / `0..d - 1` for `3 <= d <= k` (units sharing a slot stay at least `d - 1` streamed units
/// apart, across the wrap too, where round-robin can put the last unit of a pass and the first of
/// the next in one slot). The chosen one gives its tightest upload the most bytes of other units
/// to overlap with, per byte uploaded (bytes stand in for compute).
fn assign_slots(lens: &[u64], resident: &[bool], k: usize) -> Vec<Option<SlotId>> {
    let streamed: Vec<usize> = (0..lens.len()).filter(|&i| !resident[i]).collect();
    let n = streamed.len();
    let mut candidates: Vec<Vec<u32>> = vec![(0..n).map(|i| (i % k.max(1)) as u32).collect()];
    if n > k {
        for d in 3..=k {
            // n = a * d + b * (d - 1) with the most full rounds.
            if let Some(a) = (0..=n / d).rev().find(|a| (n - a * d).is_multiple_of(d - 1)) {
                let b = (n - a * d) / (d - 1);
                let rounds = std::iter::repeat_n(d, a).chain(std::iter::repeat_n(d - 1, b));
                candidates.push(rounds.flat_map(|len| 0..len as u32).collect());
            }
        }
    }
    let mut prefix = vec![0u64; lens.len() + 1];
    for (i, &l) in lens.iter().enumerate() {
        prefix[i + 1] = prefix[i] + l;
    }
    let total = prefix[lens.len()];
    // Bytes of the units strictly between `p` and `u`, cyclically.
    let between = |p: usize, u: usize| {
        if p < u { prefix[u] - prefix[p + 1] } else { total - prefix[p + 1] + prefix[u] }
    };
    // The tightest upload of a sequence as (overlap bytes, uploaded bytes); None: nothing re-uploads.
    let tightest = |seq: &[u32]| -> Option<(u64, u64)> {
        let mut last = vec![None::<usize>; k.max(1)];
        for (j, &s) in seq.iter().enumerate() {
            last[s as usize] = Some(j);
        }
        let mut worst: Option<(u64, u64)> = None;
        for (j, &s) in seq.iter().enumerate() {
            let prev = last[s as usize].expect("seen");
            last[s as usize] = Some(j);
            if prev == j {
                continue; // alone in its slot: uploaded once
            }
            let u = streamed[j];
            let cur = (between(streamed[prev], u), lens[u]);
            let tighter = worst.is_none_or(|(g, l)| {
                u128::from(cur.0) * u128::from(l) < u128::from(g) * u128::from(cur.1)
            });
            if tighter {
                worst = Some(cur);
            }
        }
        worst
    };
    let mut best = 0;
    let mut best_score = tightest(&candidates[0]);
    for (c, seq) in candidates.iter().enumerate().skip(1) {
        let score = tightest(seq);
        let better = match (score, best_score) {
            (None, Some(_)) => true,
            (Some((g, l)), Some((bg, bl))) => {
                u128::from(g) * u128::from(bl) > u128::from(bg) * u128::from(l)
            }
            _ => false,
        };
        if better {
            best = c;
            best_score = score;
        }
    }
    let mut seq = candidates.swap_remove(best).into_iter();
    resident
        .iter()
        .map(|&r| (!r).then(|| SlotId(seq.next().expect("one slot per streamed unit"))))
        .collect()
}

/// Compute time per byte of a unit, in units of link time per byte, that planning assumes: a
/// unit computes in half the time its bytes take on the link (a streamed model near its copy
/// floor, where the placement of resident units decides whether the link stays busy).
const COMPUTE_PER_LINK_BYTE: f64 = 0.5;

/// Simulated passes within this share of each other are equal; resident bytes decide.
const SIMULATION_TOLERANCE: f64 = 0.005;

/// The steady-state pass time of a plan, in link time per byte: one copy stream uploads the
/// streamed units in execution order, each once its slot's previous occupant has run; a unit
/// runs after the one before it and after its upload (resident units at once). A unit alone in
/// its slot uploads in the first pass only.
fn simulated_pass(layout: &Layout, resident: &[bool], slots: usize) -> f64 {
    let units = &layout.units;
    let lens: Vec<u64> = units.iter().map(|u| u.len).collect();
    let slot_of = assign_slots(&lens, resident, slots);
    let mut sharing = vec![0u32; slots.max(1)];
    for s in slot_of.iter().flatten() {
        sharing[s.0 as usize] += 1;
    }
    let mut slot_free = vec![0f64; slots.max(1)];
    let (mut link_free, mut compute_free) = (0f64, 0f64);
    let mut ends = [0f64; 3];
    for (pass, end) in ends.iter_mut().enumerate() {
        for (u, slot) in units.iter().zip(&slot_of) {
            let compute = u.len as f64 * COMPUTE_PER_LINK_BYTE;
            let mut ready = compute_free;
            if let Some(s) = slot {
                let s = s.0 as usize;
                if sharing[s] > 1 || pass == 0 {
                    let done = link_free.max(slot_free[s]) + u.link_bytes() as f64;
                    link_free = done;
                    ready = ready.max(done);
                }
                compute_free = ready + compute;
                slot_free[s] = compute_free;
            } else {
                compute_free = ready + compute;
            }
        }
        *end = compute_free;
    }
    ends[2] - ends[1]
}

/// Keeps at least one unit streamed when slots exist (a plan with slots and nothing to stream
/// would be the all-resident plan, handled before).
fn all_but_none_streamed(resident: &[bool], candidates: &[usize], adding: usize) -> bool {
    candidates.iter().all(|&i| i == adding || resident[i])
}

/// Keeps resident as many units of `small` as fit in `left`, evenly spaced through them (at
/// least one stays streamed): counts tried from what the mean unit size allows, down by one a
/// bounded number of times (unequal sizes may fit none of them; the caller fills the rest).
fn keep_evenly_spaced(
    units: &[UnitLayout],
    small: &[usize],
    resident: &mut [bool],
    left: &mut u64,
) {
    const TRIES: usize = 8;
    let n = small.len();
    let total: u64 = small.iter().map(|&i| units[i].len).sum();
    let mean = (total / n.max(1) as u64).max(1);
    let most = usize::try_from(*left / mean).unwrap_or(usize::MAX).min(n.saturating_sub(1));
    for k in (1..=most).rev().take(TRIES) {
        let picks = evenly_spaced(n, k);
        let bytes: u64 = picks.iter().map(|&i| units[small[i]].len).sum();
        if bytes <= *left {
            for i in picks {
                resident[small[i]] = true;
            }
            *left -= bytes;
            return;
        }
    }
}

/// `k` of the indices `0..n` (`k <= n`), evenly spaced: the middle of each of `k` equal shares.
fn evenly_spaced(n: usize, k: usize) -> Vec<usize> {
    (0..k).map(|j| ((2 * j + 1) * n) / (2 * k)).collect()
}

/// Indices `0..n` with evenly spaced ones first, then the rest in order.
fn spread_order(n: usize) -> Vec<usize> {
    let mut order = Vec::with_capacity(n);
    let mut seen = vec![false; n];
    let mut step = n;
    while step > 0 {
        let mut i = step / 2;
        while i < n {
            if !seen[i] {
                seen[i] = true;
                order.push(i);
            }
            i += step.max(1);
        }
        step /= 2;
    }
    order.extend((0..n).filter(|&i| !seen[i]));
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::UnitLayout;
    use ddo_core::UnitId;

    fn layout(lens: &[u64], pinned: &[bool]) -> Layout {
        let mut offset = 0;
        let units = lens
            .iter()
            .zip(pinned)
            .enumerate()
            .map(|(i, (&len, &p))| {
                let u = UnitLayout {
                    id: UnitId(i as u32),
                    name: format!("u{i}"),
                    offset,
                    len,
                    payload: len,
                    tensors: vec![],
                    extents: vec![crate::layout::Extent {
                        file: ddo_core::CheckpointFileId(0),
                        file_offset: offset,
                        len,
                        offset: 0,
                        staged: false,
                        round: 0,
                    }],
                    conversions: vec![],
                    staging_len: 0,
                    pinned: p,
                };
                offset += len;
                u
            })
            .collect();
        Layout {
            units,
            reserved: offset,
            granularity: 1,
            staging_len: 0,
            staging_buffer: 0,
            staging_offset: offset,
        }
    }

    fn budget(total: u64, depth: u32) -> Budget {
        Budget { total, headroom: 0, prefetch_depth: depth }
    }

    #[test]
    fn everything_resident_when_it_fits() {
        let p = ResidencyPlan::new(&layout(&[10, 10, 10], &[false; 3]), budget(30, 2)).unwrap();
        assert_eq!((p.slots, p.streamed_units(), p.device_bytes()), (0, 0, 30));
    }

    #[test]
    fn two_slots_then_resident_units_then_more_slots() {
        let l = layout(&[10; 10], &[false; 10]);
        let p = ResidencyPlan::new(&l, budget(20, 2)).unwrap();
        assert_eq!((p.slots, p.slot_len, p.resident_bytes), (2, 10, 0));
        let p = ResidencyPlan::new(&l, budget(45, 2)).unwrap();
        assert_eq!((p.slots, p.resident_bytes), (3, 10));
        let p = ResidencyPlan::new(&l, budget(45, 1)).unwrap();
        assert_eq!((p.slots, p.resident_bytes), (2, 20));
        assert!(p.device_bytes() <= 45);
        // Round-robin slots in unit order over the streamed units.
        let slots: Vec<u32> = p.slot_of.iter().flatten().map(|s| s.0).collect();
        assert_eq!(slots, [0, 1, 0, 1, 0, 1, 0, 1]);
        assert_eq!(p.streamed_bytes, 80);
    }

    #[test]
    fn large_units_become_resident_to_shrink_slots() {
        let l = layout(&[40, 10, 10, 10], &[false; 4]);
        let p = ResidencyPlan::new(&l, budget(60, 1)).unwrap();
        assert!(p.resident[0]);
        assert_eq!(p.slot_len, 10);
        assert!(p.device_bytes() <= 60);
    }

    #[test]
    fn pinned_units_and_too_small_budgets() {
        let l = layout(&[5, 10, 10, 10], &[true, false, false, false]);
        let p = ResidencyPlan::new(&l, budget(25, 2)).unwrap();
        assert!(p.resident[0]);
        assert_eq!(p.slots, 2);
        let e = ResidencyPlan::new(&l, Budget { total: 30, headroom: 6, prefetch_depth: 2 })
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "GPU budget of 30 B (24 B after 6 B of headroom) is too small: the resident units and two execution slots need at least 25 B (largest unit 10 B); raise the budget to 31 B or more"
        );
    }

    #[test]
    fn a_budget_too_small_for_pinned_units_alone_says_what_they_need() {
        // No unit can stream: the pinned units and the staging buffers are the whole need.
        let mut l = layout(&[5, 10], &[true, true]);
        l.staging_len = 4;
        let e = ResidencyPlan::new(&l, budget(12, 1)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "GPU budget of 12 B (12 B after 0 B of headroom) is too small: the resident units and 4 B of staging buffers (for tensors converted or decoded on the device) need at least 19 B (largest unit 10 B); raise the budget to 19 B or more"
        );
        l.staging_len = 0;
        assert!(ResidencyPlan::new(&l, budget(15, 1)).is_ok());
    }

    /// Slots of `n` equal streamed units over `k` slots, none resident.
    fn slot_sequence(n: usize, k: usize) -> Vec<u32> {
        assign_slots(&vec![1; n], &vec![false; n], k).into_iter().map(|s| s.unwrap().0).collect()
    }

    /// Smallest cyclic distance between two units sharing a slot (the wrap to the next pass
    /// included).
    fn min_reuse_distance(seq: &[u32]) -> usize {
        let n = seq.len();
        (0..n)
            .map(|i| (1..=n).find(|&d| seq[(i + d) % n] == seq[i]).expect("the unit itself"))
            .min()
            .unwrap_or(n)
    }

    #[test]
    fn units_sharing_a_slot_stay_apart_across_the_wrap() {
        // Round-robin would give 0,1,2,3,0,1: units 4 and 5 two slots from the next pass's 0, 1.
        assert_eq!(slot_sequence(6, 4), [0, 1, 2, 0, 1, 2]);
        assert_eq!(slot_sequence(13, 4), [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 0, 1, 2]);
        assert_eq!(slot_sequence(8, 4), [0, 1, 2, 3, 0, 1, 2, 3]);
        assert_eq!(slot_sequence(3, 4), [0, 1, 2]);
        for k in 2..=6 {
            for n in 0..60 {
                let seq = slot_sequence(n, k);
                assert_eq!(seq.len(), n);
                assert!(seq.iter().all(|&s| (s as usize) < k));
                if n > k && n >= (k - 1) * (k - 2) && k >= 3 {
                    assert!(min_reuse_distance(&seq) >= k - 1, "n={n} k={k}: {seq:?}");
                }
            }
        }
    }

    #[test]
    fn a_long_resident_stretch_keeps_round_robin() {
        // Nine large resident units, then six streamed ones between resident ones: the resident
        // stretch covers the uploads at the wrap, so round-robin's wider spacing within the
        // pass wins (and two units keep a slot to themselves).
        let mut lens = vec![650; 9];
        let mut resident = vec![true; 9];
        for _ in 0..6 {
            lens.extend([270, 270]);
            resident.extend([false, true]);
        }
        let slots: Vec<u32> =
            assign_slots(&lens, &resident, 4).into_iter().flatten().map(|s| s.0).collect();
        assert_eq!(slots, [0, 1, 2, 3, 0, 1]);
    }

    #[test]
    fn resident_units_do_not_bunch_the_streamed_ones_into_one_stretch() {
        // Flux-shaped: 19 large double blocks, then 38 small single blocks. Keeping every large
        // block resident (slots the size of a small one) keeps the most bytes, but streams only
        // the singles, back to back at the end of the pass, where the link cannot keep up.
        let mut lens = vec![650; 19];
        lens.extend([270; 38]);
        let l = layout(&lens, &[false; 57]);
        let p = ResidencyPlan::new(&l, budget(14_190, 4)).unwrap();
        assert!(p.device_bytes() <= 14_190);
        assert!(p.resident[..19].iter().any(|r| !r), "some double blocks stream");
        assert!(p.resident[19..].iter().any(|r| *r), "some single blocks stay resident");
        let mut bunched: Vec<bool> = (0..57).map(|i| i < 19).collect();
        bunched[38] = true;
        let chosen = simulated_pass(&l, &p.resident, p.slots as usize);
        let most_bytes = simulated_pass(&l, &bunched, 5);
        assert!(chosen < most_bytes * 0.9, "chosen {chosen}, bunched {most_bytes}");
    }

    #[test]
    fn the_simulated_pass_follows_the_link_and_the_compute() {
        let l = layout(&[10; 4], &[false; 4]);
        // Everything streamed over two slots: link-bound, 40 per pass.
        assert_eq!(simulated_pass(&l, &[false; 4], 2), 40.0);
        // Two resident: 20 on the link, 20 of compute at half a link-byte per byte: 25 with the
        // waits for the two uploads.
        let t = simulated_pass(&l, &[true, false, true, false], 2);
        assert!((20.0..=30.0).contains(&t), "{t}");
        // A unit alone in its slot uploads once: only compute remains.
        assert_eq!(simulated_pass(&l, &[true, true, true, false], 2), 20.0);
    }

    #[test]
    fn streamed_units_spread_evenly_through_the_pass() {
        // SD3-shaped: 39 equal blocks, a budget for two slots and 21 resident blocks. The 18
        // streamed blocks sit evenly apart, not bunched at one end of the pass.
        let l = layout(&[10; 39], &[false; 39]);
        let p = ResidencyPlan::new(&l, budget(230, 1)).unwrap();
        assert_eq!((p.slots, p.streamed_units()), (2, 18));
        let streamed: Vec<usize> = (0..39).filter(|&i| !p.resident[i]).collect();
        let gaps: Vec<usize> = streamed.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.iter().all(|&g| (2..=3).contains(&g)), "{streamed:?}");
        assert!(streamed[0] <= 2 && streamed[17] >= 36, "{streamed:?}");
        for n in 1..40 {
            for k in 0..=n {
                let e = evenly_spaced(n, k);
                assert_eq!(e.len(), k);
                assert!(
                    e.windows(2).all(|w| w[0] < w[1]) && e.iter().all(|&i| i < n),
                    "{n} {k}: {e:?}"
                );
            }
        }
    }

    #[test]
    fn unequal_units_keep_the_selection_whose_pass_simulates_shorter() {
        // Large and small units alternating: the most evenly spaced units that fit mix both
        // sizes and leave no room for more, where the bisecting order keeps far more small ones
        // resident. Both are simulated; the shorter pass is kept.
        let lens: Vec<u64> = (0..40).map(|i| if i % 2 == 0 { 30 } else { 3 }).collect();
        let l = layout(&lens, &[false; 40]);
        for total in [420, 450] {
            let p = ResidencyPlan::new(&l, budget(total, 1)).unwrap();
            assert!(p.device_bytes() <= total);
            let chosen = simulated_pass(&l, &p.resident, p.slots as usize);
            assert!(
                chosen <= 370.0,
                "budget {total}: pass {chosen}, {} streamed",
                p.streamed_units()
            );
        }
    }

    #[test]
    fn thousands_of_units_of_distinct_sizes_plan_within_the_budget() {
        let lens: Vec<u64> = (0..3000).map(|i| 1000 + i).collect();
        let l = layout(&lens, &[false; 3000]);
        let total: u64 = lens.iter().sum();
        let p = ResidencyPlan::new(&l, budget(total / 2, 2)).unwrap();
        assert!(p.device_bytes() <= total / 2 && p.streamed_units() > 0);
        assert!(p.resident_bytes > total / 3, "most of the budget holds resident units");
    }

    #[test]
    fn spread_order_is_a_permutation() {
        for n in 0..20 {
            let mut o = spread_order(n);
            o.sort_unstable();
            assert_eq!(o, (0..n).collect::<Vec<_>>());
        }
    }
}
