//! The rules a host applies while a component runs, from `ddo-policy`: the automatic GPU
//! budget, capacity profiles and the layer route's limits. Python samples, applies and warns;
//! the decisions are made here.

use std::sync::Mutex;

use ddo_session::policy::auto_budget::{self, Arena, Refusal, Step};
use ddo_session::policy::capacity_profile::{self, Outcome, Recommendation, Target};
use pyo3::prelude::*;

use crate::errors::config_error;
use crate::plan::ResolvedPlan;

/// One component's automatic GPU budget (`auto_budget_policy = balanced`): after each pass the
/// host hands it what the device looks like, re-plans the arena when it says so, and reports
/// how that went.
#[pyclass(module = "ddo._native", frozen)]
pub(crate) struct AutoBudget {
    inner: Mutex<auto_budget::AutoBudget>,
}

impl AutoBudget {
    fn rule(&self) -> std::sync::MutexGuard<'_, auto_budget::AutoBudget> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl AutoBudget {
    /// The automatic budget `plan` asks for, or `None` when its policy is off.
    #[staticmethod]
    fn for_plan(plan: &ResolvedPlan) -> Option<AutoBudget> {
        auto_budget::AutoBudget::for_plan(&plan.plan).map(|a| AutoBudget { inner: Mutex::new(a) })
    }

    /// The headroom kept free, in bytes.
    #[getter]
    fn headroom_bytes(&self) -> u64 {
        self.rule().headroom_bytes()
    }

    /// Decides after a pass that left `free_bytes` free: the budget in bytes to re-plan the
    /// arena under, or `None` to keep it. `arena()` returns `(budget bytes, held bytes, blocks
    /// running)` and is called only when the free memory alone does not settle it. A budget
    /// returned must be followed by `replanned`, `refused` or `interrupted`.
    fn after_pass(&self, free_bytes: u64, arena: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
        // Read without holding the rule's lock: the read runs Python, which may let another
        // thread in to read the report.
        let read = if self.rule().reads_arena(free_bytes) {
            let (budget_bytes, held_bytes, blocks_running) = arena.call0()?.extract()?;
            Some(Arena { budget_bytes, held_bytes, blocks_running })
        } else {
            None
        };
        // Another pass may have ended in between: an arena not read is decided again later.
        Ok(match self.rule().after_pass(free_bytes, || read) {
            Step::Keep => None,
            Step::Replan { target_bytes } => Some(target_bytes),
        })
    }

    /// The re-plan ran (`changed` false: held views kept the arena); `budget_bytes` is the
    /// arena's budget now.
    fn replanned(&self, changed: bool, budget_bytes: u64) {
        self.rule().replanned(changed, budget_bytes);
    }

    /// The re-plan was refused with `error`; `unloaded` when the component could not keep its
    /// last budget either. Returns the warning to show.
    fn refused(&self, unloaded: bool, error: &str) -> String {
        let refusal = if unloaded { Refusal::Unloaded } else { Refusal::TooSmall };
        self.rule().refused(refusal, error)
    }

    /// The re-plan was interrupted: the next pass decides as this one would have.
    fn interrupted(&self) {
        self.rule().interrupted();
    }

    /// `setup.auto_budget` of the metrics, as JSON.
    fn report(&self) -> PyResult<String> {
        serde_json::to_string(&self.rule().report()).map_err(config_error)
    }
}

/// Whether a capacity profile's recommendation sizes the budget of `plan`'s component on
/// `device` (a torch device name) of `device_total_bytes`, as `(outcome, setting, budget GiB,
/// why)`: outcome `not_applicable`, `explicit_budget` (budget: the recommendation where usable),
/// `apply`, or a refusal's status (`invalid`, `device_changed`) with `why`. `keep_resident_budget`:
/// a host's own profile session, which also keeps a resident budget the settings already carry.
#[pyfunction]
#[pyo3(signature = (plan, device, device_total_bytes, keep_resident_budget, setting=None, budget_gb=None, recorded_total_bytes=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn capacity_profile_outcome(
    plan: &ResolvedPlan,
    device: &str,
    device_total_bytes: u64,
    keep_resident_budget: bool,
    setting: Option<String>,
    budget_gb: Option<f64>,
    recorded_total_bytes: Option<f64>,
) -> (&'static str, Option<&'static str>, Option<f64>, Option<String>) {
    let recommendation =
        Recommendation { setting, budget_gb, device_total_bytes: recorded_total_bytes };
    let target = Target::for_plan(&plan.plan, device, device_total_bytes, keep_resident_budget);
    let budget_setting = plan.plan.route.budget_setting();
    match capacity_profile::decide(&recommendation, &target) {
        Outcome::NotApplicable => ("not_applicable", None, None, None),
        Outcome::ExplicitBudget { recommended_gb } => {
            ("explicit_budget", budget_setting, recommended_gb, None)
        }
        Outcome::Apply { setting, budget_gb } => ("apply", Some(setting), Some(budget_gb), None),
        Outcome::Refused { refusal, why } => {
            (refusal.status(), budget_setting, budget_gb, Some(why))
        }
    }
}

/// A measured run's recommendation: `(budget GiB, free margin bytes)`.
#[pyfunction]
pub(crate) fn recommend_budget_gb(
    build_budget_gb: f64,
    total_bytes: u64,
    peak_bytes: u64,
    headroom_bytes: u64,
) -> (f64, u64) {
    capacity_profile::recommend_budget_gb(build_budget_gb, total_bytes, peak_bytes, headroom_bytes)
}

/// The published library's rule: `max(0, total - peak - headroom)` GiB, rounded to 4 digits.
#[pyfunction]
pub(crate) fn published_resident_budget_gb(total_gb: f64, peak_gb: f64, headroom_gb: f64) -> f64 {
    capacity_profile::published_resident_budget_gb(total_gb, peak_gb, headroom_gb)
}

/// Route `linear_convolution`'s limits: `(resident KiB, streamed dtypes as torch names)`.
#[pyfunction]
pub(crate) fn layer_route_limits() -> (u32, Vec<&'static str>) {
    let dtypes = ddo_session::policy::LAYER_ROUTE_DTYPES.iter().map(|d| d.torch_name()).collect();
    (ddo_session::policy::LAYER_ROUTE_RESIDENT_KIB, dtypes)
}

/// The facts of the route named `name` as JSON (`name`, `published_name`, `streams`, `native`,
/// `reads_checkpoint`, `budget_setting`, `takes_auto_budget`); `None` for a name that is no route.
#[pyfunction]
pub(crate) fn route_facts(name: &str) -> PyResult<Option<String>> {
    ddo_session::policy::RouteFacts::of_name(name)
        .map(|facts| serde_json::to_string(&facts).map_err(config_error))
        .transpose()
}

/// Registers the rules in `ddo._native`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<AutoBudget>()?;
    m.add_function(wrap_pyfunction!(capacity_profile_outcome, m)?)?;
    m.add_function(wrap_pyfunction!(recommend_budget_gb, m)?)?;
    m.add_function(wrap_pyfunction!(published_resident_budget_gb, m)?)?;
    m.add_function(wrap_pyfunction!(layer_route_limits, m)?)?;
    m.add_function(wrap_pyfunction!(route_facts, m)?)?;
    Ok(())
}
