//! Learning the execution order: the first complete pass (each unit once) becomes the expected
//! order; an acquisition out of it cancels look-ahead for the rest of the pass.

use std::sync::Arc;

use ddo_core::UnitId;

use super::Arena;
use super::state::State;

impl Arena {
    /// Marks a pass boundary (the component's forward starts): the first pass's order becomes
    /// the learned order, and look-ahead is enabled again.
    pub fn begin_pass(&self) {
        let mut state = self.lock();
        Self::start_pass(&mut state);
    }

    /// Marks the current pass as interrupted (an exception inside the forward): the order seen
    /// so far is not learned as the execution order.
    pub fn abandon_pass(&self) {
        self.lock().order.current.clear();
    }

    pub(super) fn start_pass(state: &mut State) {
        let o = &mut state.order;
        if o.learned.is_none() && !o.current.is_empty() {
            let mut seen = std::collections::HashSet::new();
            if o.current.iter().all(|u| seen.insert(*u)) {
                o.learned = Some(std::mem::take(&mut o.current).into());
            }
        }
        o.current.clear();
        o.position = 0;
        o.lookahead = true;
        state.stats.passes += 1;
    }

    /// Tracks the execution order; returns whether `unit` follows the expected order.
    pub(super) fn observe(&self, state: &mut State, unit: UnitId) -> bool {
        let learned_first = state.order.learned.as_ref().map(|l| l[0]);
        let o = &mut state.order;
        match &o.learned {
            None => {
                if o.current.first() == Some(&unit) {
                    Self::start_pass(state);
                    state.order.current.push(unit);
                    return true;
                }
                let expected = o.current.len() as u32;
                o.current.push(unit);
                let on_track = unit.0 == expected;
                if !on_track {
                    Self::cancel_lookahead(state);
                }
                on_track
            }
            Some(learned) => {
                if o.position < learned.len() && learned[o.position] == unit {
                    o.position += 1;
                    return true;
                }
                if learned_first == Some(unit) {
                    Self::start_pass(state);
                    state.order.position = 1;
                    return true;
                }
                state.stats.order_mismatches += 1;
                Self::cancel_lookahead(state);
                false
            }
        }
    }

    /// Stops look-ahead for this pass. Uploads already enqueued complete and stay valid; they
    /// are only no longer counted as prefetch.
    fn cancel_lookahead(state: &mut State) {
        state.order.lookahead = false;
        for s in &mut state.slots {
            if s.prefetched {
                s.prefetched = false;
                state.stats.prefetch_cancels += 1;
            }
        }
    }

    /// The learned order, or the attach order before one is learned.
    pub(super) fn expected_order(&self, state: &State) -> Arc<[UnitId]> {
        state.order.learned.clone().unwrap_or_else(|| self.attach_order.clone())
    }
}
