//! The arena's GPU budget: a budget set after opening, else the route's setting.

use ddo_arena::{Budget, Layout, UnitSpec};
use ddo_core::TensorSlice;
use ddo_policy::AutoBudgetPolicy;

use super::{ComponentSession, SessionRoute, gib};
use crate::SessionError;

/// Where the arena's whole budget comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BudgetBasis {
    /// A budget set after opening ([`ComponentSession::set_budget`]): the whole arena, no
    /// headroom inside it.
    Set(u64),
    /// The native and disk routes' `vmm_resident_weight_budget_gb`.
    Setting(u64),
    /// The linear route's: its slots of the largest streamed unit, the pinned units and
    /// `resident_module_budget_gb` on top.
    Slots {
        /// Bytes of the largest streamed unit.
        largest: u64,
        /// Bytes of the pinned units.
        pinned: u64,
        /// `resident_module_budget_gb` in bytes.
        resident: u64,
    },
}

/// The arena's budget from `basis`, with `headroom` kept free inside it (none for a set budget)
/// and `prefetch_depth` units in flight. The linear route runs `prefetch_depth + 1` slots, at
/// least two.
pub(super) fn arena_budget(
    basis: BudgetBasis,
    headroom: u64,
    prefetch_depth: u32,
) -> Result<Budget, SessionError> {
    let (total, headroom) = match basis {
        BudgetBasis::Set(total) => (total, 0),
        BudgetBasis::Setting(total) => (total, headroom),
        BudgetBasis::Slots { largest, pinned, resident } => {
            let slots = u64::from(prefetch_depth.saturating_add(1).max(2));
            // Headroom is kept free inside this budget: it shrinks the resident blocks.
            let total = largest
                .checked_mul(slots)
                .and_then(|v| v.checked_add(pinned))
                .and_then(|v| v.checked_add(resident))
                .ok_or_else(|| SessionError::Capacity {
                    setting: "resident_module_budget_gb",
                    message: "the budget overflows".into(),
                })?;
            (total, headroom)
        }
    };
    Ok(Budget { total, headroom, prefetch_depth })
}

impl ComponentSession {
    /// The arena's budget for `slices` laid out as `specs` ([`arena_budget`] over this
    /// session's settings).
    pub(super) fn budget(
        &self,
        slices: &[TensorSlice],
        specs: &[UnitSpec],
    ) -> Result<Budget, SessionError> {
        let s = &self.plan.settings;
        let set = *self.budget_override.lock().unwrap_or_else(|p| p.into_inner());
        // With the automatic budget the headroom is kept outside the arena, not inside it.
        let headroom = match s.auto_budget_policy {
            AutoBudgetPolicy::Balanced => 0,
            _ => gib("auto_vram_headroom_gb", s.auto_vram_headroom_gb)?,
        };
        let basis = match (set, self.route) {
            (Some(total), _) => BudgetBasis::Set(total),
            (None, SessionRoute::Native | SessionRoute::Disk) => BudgetBasis::Setting(gib(
                "vmm_resident_weight_budget_gb",
                s.vmm_resident_weight_budget_gb,
            )?),
            (None, SessionRoute::Linear) => {
                let granularity = self.target.platform.residency.granularity()?;
                let layout = Layout::build(slices, specs, granularity)?;
                let largest =
                    layout.units.iter().filter(|u| !u.pinned).map(|u| u.len).max().unwrap_or(0);
                let pinned = layout.units.iter().filter(|u| u.pinned).map(|u| u.len).sum();
                let resident = gib("resident_module_budget_gb", s.resident_module_budget_gb)?;
                BudgetBasis::Slots { largest, pinned, resident }
            }
        };
        arena_budget(basis, headroom, s.prefetch_depth)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_budget_is_the_whole_arena_without_headroom() {
        let b = arena_budget(BudgetBasis::Set(1 << 30), 1 << 20, 3).unwrap();
        assert_eq!((b.total, b.headroom, b.prefetch_depth), (1 << 30, 0, 3));
        let b = arena_budget(BudgetBasis::Setting(1 << 30), 1 << 20, 3).unwrap();
        assert_eq!((b.total, b.headroom), (1 << 30, 1 << 20));
    }

    #[test]
    fn the_linear_route_holds_its_slots_pinned_units_and_resident_budget() {
        let basis = BudgetBasis::Slots { largest: 100, pinned: 7, resident: 1000 };
        // prefetch_depth 2: three slots.
        assert_eq!(arena_budget(basis, 5, 2).unwrap().total, 3 * 100 + 7 + 1000);
        // At least two slots, whatever the depth.
        assert_eq!(arena_budget(basis, 5, 0).unwrap().total, 2 * 100 + 7 + 1000);
        assert_eq!(arena_budget(basis, 5, 0).unwrap().headroom, 5);
    }

    #[test]
    fn a_budget_that_overflows_is_refused_by_setting() {
        let basis = BudgetBasis::Slots { largest: u64::MAX / 2, pinned: 0, resident: 0 };
        let err = arena_budget(basis, 0, 4).unwrap_err();
        assert!(
            matches!(err, SessionError::Capacity { setting: "resident_module_budget_gb", .. }),
            "{err}"
        );
    }
}
