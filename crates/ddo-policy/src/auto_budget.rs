//! The automatic GPU budget (`auto_budget_policy = balanced`): the native arena's budget is the
//! device's free memory plus what the arena holds, less a headroom, sampled after a pass so the
//! working set the model's framework keeps (activations, its allocator's cache) never counts as
//! free.
//!
//! The rule is pure: the host samples the device's free memory after each pass and hands it to
//! [`AutoBudget::after_pass`] with a way to read the arena's state, applies the [`Step`] it gets back (a re-plan of the arena), and
//! reports how that went ([`AutoBudget::replanned`], [`AutoBudget::refused`],
//! [`AutoBudget::interrupted`]). The budget is planned again after the first pass, and after any
//! pass that leaves less than half the headroom free (the working set grew).

use serde::Serialize;

use crate::{AutoBudgetPolicy, Plan};

/// The headroom when `auto_vram_headroom_gb` is 0: what the framework keeps for the working set
/// is not free.
pub const AUTO_HEADROOM_DEFAULT_BYTES: u64 = 1 << 30;
/// A larger budget is planned only when it exceeds the current one by more than this share (or
/// [`AUTO_REPLAN_MIN_BYTES`]): rebuilding the arena uploads its resident units again.
pub const AUTO_REPLAN_SHARE: f64 = 0.05;
/// See [`AUTO_REPLAN_SHARE`].
pub const AUTO_REPLAN_MIN_BYTES: u64 = 256 << 20;

/// Why the last pass kept or changed the budget, as metrics report it (`setup.auto_budget.decision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// The first pass planned the arena under the measured budget.
    FirstPass,
    /// A later pass left less than half the headroom free: the budget shrank or grew to fit.
    WorkingSetGrew,
    /// The measured budget is the current one, or larger by less than the re-plan margin.
    KeptCloseEnough,
    /// The measured budget is no larger than one the arena could not run in.
    KeptTooSmall,
    /// Another thread holds a block's lease: planned again after a later pass.
    KeptBlocksRunning,
    /// The host holds views of the arena's weights: the arena could not be rebuilt.
    KeptViewsHeld,
    /// Neither the measured budget nor the last one could be planned: the component unloaded.
    Unloaded,
}

/// What the arena looked like after a pass: read only when the free memory alone does not
/// settle the decision (`None` when it could not be read; the pass is then decided again later).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arena {
    /// The arena's budget now.
    pub budget_bytes: u64,
    /// Device bytes the arena holds now (resident units and slots): free to it when re-planned.
    pub held_bytes: u64,
    /// Whether a block's lease is held (a forward runs in another thread).
    pub blocks_running: bool,
}

/// What the host does after a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Nothing: the budget stays.
    Keep,
    /// Re-plan the arena under `target_bytes`, then report through [`AutoBudget::replanned`],
    /// [`AutoBudget::refused`] or [`AutoBudget::interrupted`].
    Replan {
        /// The new budget.
        target_bytes: u64,
    },
}

/// Why a re-plan was refused, for [`AutoBudget::refused`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The arena cannot run in the target; it kept its last budget.
    TooSmall,
    /// Neither the target nor the last budget could be planned: the component is unloaded.
    Unloaded,
}

/// The state of one component's automatic budget.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoBudget {
    headroom_bytes: u64,
    passes: u64,
    replans: u64,
    free_bytes: Option<u64>,
    budget_bytes: Option<u64>,
    decision: Option<Decision>,
    /// The largest budget refused as too small (a later pass tries again only above it).
    refused_bytes: Option<u64>,
    /// The re-plan in flight: `(target, budget before)`.
    pending: Option<(u64, u64)>,
}

/// `setup.auto_budget` of the metrics.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// Always `balanced`.
    pub policy: &'static str,
    /// The headroom kept free.
    pub headroom_bytes: u64,
    /// Re-plans made so far.
    pub replans: u64,
    /// The budget after the last decision.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_bytes: Option<u64>,
    /// Free device memory after the last pass.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub free_bytes: Option<u64>,
    /// The last decision.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decision: Option<Decision>,
}

impl AutoBudget {
    /// The automatic budget a plan asks for: `None` unless `auto_budget_policy = balanced`
    /// (resolution refuses that policy on any arena route but the native one).
    pub fn for_plan(plan: &Plan) -> Option<AutoBudget> {
        if plan.settings.auto_budget_policy != AutoBudgetPolicy::Balanced {
            return None;
        }
        Some(AutoBudget::with_headroom(headroom_bytes(plan.settings.auto_vram_headroom_gb)))
    }

    /// An automatic budget that keeps `headroom_bytes` free.
    pub fn with_headroom(headroom_bytes: u64) -> AutoBudget {
        AutoBudget {
            headroom_bytes,
            passes: 0,
            replans: 0,
            free_bytes: None,
            budget_bytes: None,
            decision: None,
            refused_bytes: None,
            pending: None,
        }
    }

    /// The headroom kept free.
    pub fn headroom_bytes(&self) -> u64 {
        self.headroom_bytes
    }

    /// The last decision.
    pub fn decision(&self) -> Option<Decision> {
        self.decision
    }

    /// Whether [`after_pass`](AutoBudget::after_pass) with `free_bytes` reads the arena (the
    /// first pass, or less than half the headroom free).
    pub fn reads_arena(&self, free_bytes: u64) -> bool {
        self.passes == 0 || free_bytes < self.headroom_bytes / 2
    }

    /// Decides after a pass that left `free_bytes` free; `arena` is read only when that alone
    /// does not settle it (a steady pass costs the host nothing more). A [`Step::Replan`] must be
    /// followed by one of the three reports.
    pub fn after_pass(&mut self, free_bytes: u64, arena: impl FnOnce() -> Option<Arena>) -> Step {
        self.passes += 1;
        self.free_bytes = Some(free_bytes);
        if self.passes > 1 && free_bytes >= self.headroom_bytes / 2 {
            return Step::Keep;
        }
        debug_assert!(self.passes == 1 || free_bytes < self.headroom_bytes / 2);
        let Some(sample) = arena() else {
            // The arena could not be read (another pass ended meanwhile): decided again later.
            self.passes -= 1;
            return Step::Keep;
        };
        let budget = sample.budget_bytes;
        let target =
            (free_bytes.saturating_add(sample.held_bytes)).saturating_sub(self.headroom_bytes);
        self.budget_bytes = Some(budget);
        // Shrinking is never skipped (the device is short); growing only pays past a margin.
        let margin = AUTO_REPLAN_MIN_BYTES.max((budget as f64 * AUTO_REPLAN_SHARE) as u64);
        if target == budget || (target > budget && target - budget <= margin) {
            self.decision = Some(Decision::KeptCloseEnough);
            return Step::Keep;
        }
        if self.refused_bytes.is_some_and(|refused| target <= refused) {
            self.decision = Some(Decision::KeptTooSmall);
            return Step::Keep;
        }
        if sample.blocks_running {
            // Counted again by a later pass.
            self.passes -= 1;
            self.decision = Some(Decision::KeptBlocksRunning);
            return Step::Keep;
        }
        self.pending = Some((target, budget));
        Step::Replan { target_bytes: target }
    }

    /// The re-plan ran: `changed` is false when held views kept the arena as it was;
    /// `budget_bytes` is the arena's budget now.
    pub fn replanned(&mut self, changed: bool, budget_bytes: u64) {
        self.pending = None;
        if !changed {
            self.decision = Some(Decision::KeptViewsHeld);
            return;
        }
        self.replans += 1;
        self.refused_bytes = None;
        self.budget_bytes = Some(budget_bytes);
        self.decision =
            Some(if self.passes == 1 { Decision::FirstPass } else { Decision::WorkingSetGrew });
    }

    /// The re-plan was refused (`error` says why); returns the warning the host shows, said once:
    /// a later pass tries again only when more memory is free.
    pub fn refused(&mut self, refusal: Refusal, error: &str) -> String {
        let (target, budget) = self.pending.take().unwrap_or((0, 0));
        self.refused_bytes = Some(target);
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        match refusal {
            Refusal::Unloaded => {
                self.decision = Some(Decision::Unloaded);
                format!(
                    "the automatic GPU budget could plan the arena under neither {target} bytes nor its last \
                     budget {budget} ({error}); the component is unloaded: free GPU memory and call reload()"
                )
            }
            Refusal::TooSmall => {
                self.decision = Some(Decision::KeptTooSmall);
                format!(
                    "the automatic GPU budget would be {:.2} GiB ({:.2} GiB free, {:.2} GiB headroom), which the \
                     component cannot run in ({error}); it keeps {:.2} GiB. Free GPU memory or lower \
                     auto_vram_headroom_gb",
                    gib(target),
                    gib(self.free_bytes.unwrap_or(0)),
                    gib(self.headroom_bytes),
                    gib(budget)
                )
            }
        }
    }

    /// The re-plan was interrupted before it finished: the next pass decides as this one would
    /// have.
    pub fn interrupted(&mut self) {
        self.pending = None;
        self.passes = self.passes.saturating_sub(1);
    }

    /// `setup.auto_budget` of the metrics.
    pub fn report(&self) -> Report {
        Report {
            policy: "balanced",
            headroom_bytes: self.headroom_bytes,
            replans: self.replans,
            budget_bytes: self.budget_bytes,
            free_bytes: self.free_bytes,
            decision: self.decision,
        }
    }
}

/// The headroom of `auto_vram_headroom_gb`: [`AUTO_HEADROOM_DEFAULT_BYTES`] when 0.
pub fn headroom_bytes(auto_vram_headroom_gb: f64) -> u64 {
    let bytes = (auto_vram_headroom_gb * (1u64 << 30) as f64) as u64;
    if bytes == 0 { AUTO_HEADROOM_DEFAULT_BYTES } else { bytes }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    /// After a pass that left `free` free, with the arena at `budget` holding `held`.
    fn pass(auto: &mut AutoBudget, free: u64, budget: u64, held: u64) -> Step {
        auto.after_pass(free, || {
            Some(Arena { budget_bytes: budget, held_bytes: held, blocks_running: false })
        })
    }

    #[test]
    fn headroom_is_one_gib_when_zero() {
        assert_eq!(headroom_bytes(0.0), GIB);
        assert_eq!(headroom_bytes(0.5), GIB / 2);
        assert_eq!(AutoBudget::with_headroom(7).headroom_bytes(), 7);
    }

    #[test]
    fn the_first_pass_plans_free_plus_held_less_the_headroom() {
        let mut auto = AutoBudget::with_headroom(GIB);
        let step = pass(&mut auto, 10 * GIB, 3 * GIB, 3 * GIB);
        assert_eq!(step, Step::Replan { target_bytes: 12 * GIB });
        auto.replanned(true, 12 * GIB);
        let report = auto.report();
        assert_eq!((report.replans, report.budget_bytes), (1, Some(12 * GIB)));
        assert_eq!(report.decision, Some(Decision::FirstPass));
    }

    #[test]
    fn later_passes_keep_the_budget_while_half_the_headroom_is_free() {
        let mut auto = AutoBudget::with_headroom(GIB);
        assert!(matches!(pass(&mut auto, 10 * GIB, 3 * GIB, 3 * GIB), Step::Replan { .. }));
        auto.replanned(true, 12 * GIB);
        assert_eq!(pass(&mut auto, GIB / 2, 12 * GIB, 12 * GIB), Step::Keep);
        // Below half the headroom: the working set grew, the budget shrinks.
        let step = pass(&mut auto, GIB / 4, 12 * GIB, 12 * GIB);
        assert_eq!(step, Step::Replan { target_bytes: 12 * GIB + GIB / 4 - GIB });
        auto.replanned(true, 11 * GIB);
        assert_eq!(auto.decision(), Some(Decision::WorkingSetGrew));
        assert_eq!(auto.report().replans, 2);
    }

    #[test]
    fn growth_within_the_margin_is_not_worth_a_replan_but_shrinking_always_is() {
        let mut auto = AutoBudget::with_headroom(GIB);
        // 200 MiB more than the budget: under the 256 MiB floor of the margin.
        assert_eq!(pass(&mut auto, GIB + 200 * MIB, 4 * GIB, 4 * GIB), Step::Keep);
        assert_eq!(auto.decision(), Some(Decision::KeptCloseEnough));
        let mut auto = AutoBudget::with_headroom(GIB);
        // 1 MiB less: shrunk.
        let step = pass(&mut auto, GIB - MIB, 4 * GIB, 4 * GIB);
        assert_eq!(step, Step::Replan { target_bytes: 4 * GIB - MIB });
        // On a 40 GiB budget the margin is 5 %: 1 GiB more is under it.
        let mut auto = AutoBudget::with_headroom(GIB);
        assert_eq!(pass(&mut auto, 2 * GIB, 40 * GIB, 40 * GIB), Step::Keep);
    }

    #[test]
    fn a_refused_budget_is_said_once_and_tried_again_only_above_it() {
        let mut auto = AutoBudget::with_headroom(GIB);
        let step = pass(&mut auto, 0, 2 * GIB, 2 * GIB);
        assert_eq!(step, Step::Replan { target_bytes: GIB });
        let warning = auto.refused(Refusal::TooSmall, "two slots need 1.5 GiB");
        assert!(warning.contains("cannot run in (two slots need 1.5 GiB)"), "{warning}");
        assert!(warning.contains("keeps 2.00 GiB"), "{warning}");
        assert_eq!(pass(&mut auto, 0, 2 * GIB, 2 * GIB), Step::Keep);
        assert_eq!(auto.decision(), Some(Decision::KeptTooSmall));
        // More memory free: tried again.
        assert!(matches!(pass(&mut auto, GIB / 4, 2 * GIB, 2 * GIB), Step::Replan { .. }));
        let warning = auto.refused(Refusal::Unloaded, "out of memory");
        assert!(warning.contains("call reload()"), "{warning}");
        assert_eq!(auto.decision(), Some(Decision::Unloaded));
    }

    #[test]
    fn running_blocks_and_interrupts_leave_the_pass_to_be_decided_again() {
        let mut auto = AutoBudget::with_headroom(GIB);
        let running = || Some(Arena { budget_bytes: GIB, held_bytes: GIB, blocks_running: true });
        assert_eq!(auto.after_pass(10 * GIB, running), Step::Keep);
        assert_eq!(auto.decision(), Some(Decision::KeptBlocksRunning));
        // Still the first pass: a re-plan follows whatever is free.
        assert!(matches!(pass(&mut auto, 10 * GIB, GIB, GIB), Step::Replan { .. }));
        auto.interrupted();
        assert!(matches!(pass(&mut auto, 10 * GIB, GIB, GIB), Step::Replan { .. }));
        auto.replanned(false, GIB);
        assert_eq!(auto.decision(), Some(Decision::KeptViewsHeld));
        assert_eq!(auto.report().replans, 0);
    }

    #[test]
    fn a_steady_pass_does_not_read_the_arena() {
        let mut auto = AutoBudget::with_headroom(GIB);
        assert!(matches!(pass(&mut auto, 10 * GIB, GIB, GIB), Step::Replan { .. }));
        auto.replanned(true, 10 * GIB);
        assert!(!auto.reads_arena(GIB) && auto.reads_arena(GIB / 4));
        let step = auto.after_pass(GIB, || panic!("the arena was read on a steady pass"));
        assert_eq!(step, Step::Keep);
        // An arena that could not be read publishes no budget and leaves the pass to a later one.
        let mut auto = AutoBudget::with_headroom(GIB);
        assert_eq!(auto.after_pass(10 * GIB, || None), Step::Keep);
        assert_eq!(auto.report().budget_bytes, None);
        assert!(auto.reads_arena(10 * GIB), "still the first pass");
    }

    #[test]
    fn the_report_has_only_what_was_measured() {
        let auto = AutoBudget::with_headroom(GIB);
        let json = serde_json::to_value(auto.report()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"policy": "balanced", "headroom_bytes": GIB, "replans": 0})
        );
    }
}
