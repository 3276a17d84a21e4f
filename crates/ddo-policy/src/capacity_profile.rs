//! Capacity profiles: a run measured on the GPU sizes the GPU weight budget of later runs.
//!
//! One rule for every caller: an attach with `profile_name`, and a host's own profile session
//! applying its execution profile to settings, both ask [`decide`] whether a recorded
//! recommendation applies, and both record with [`recommend_budget_gb`]. The profile files
//! themselves (paths, locking, JSON) are the host's.

use crate::{Origin, Plan, Route};

const GIB: f64 = (1u64 << 30) as f64;

/// What a profile file recommends, as read from it (each field absent or not a finite number
/// is `None`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Recommendation {
    /// The setting the budget is for (`vmm_resident_weight_budget_gb`,
    /// `resident_module_budget_gb`); absent in the published library's files.
    pub setting: Option<String>,
    /// The recommended budget in GiB: ddo's `budget_gb`, or the published
    /// `profile_resident_module_budget_gb` (`auto_full_pin_resident_budget_gb` in older files).
    pub budget_gb: Option<f64>,
    /// The memory of the GPU the run was measured on.
    pub device_total_bytes: Option<f64>,
}

/// Where the recommendation would apply.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// The component's route.
    pub route: Route,
    /// Whether the user set the route's budget setting (an argument, a config, a variable).
    pub explicit_budget: bool,
    /// The execution device's memory.
    pub device_total_bytes: u64,
    /// Whether the execution device is a GPU (a host-backend run records no GPU size).
    pub device_is_gpu: bool,
    /// The execution device's name (`cuda:0`, `cpu`), for messages.
    pub device: String,
}

impl Target {
    /// Where a recommendation would apply to `plan`'s component on `device` (a torch device
    /// name: `cuda:0`, `cpu`) of `device_total_bytes`. The budget counts as the user's when its
    /// setting came from anything but a default or a preset; `keep_resident_budget` (a host's own
    /// profile session, as the published `apply_settings`) also keeps any
    /// `resident_module_budget_gb` above 0 the settings already carry.
    pub fn for_plan(
        plan: &Plan,
        device: &str,
        device_total_bytes: u64,
        keep_resident_budget: bool,
    ) -> Target {
        let users = plan.route.budget_setting().is_some_and(|setting| {
            !matches!(plan.origins.get(setting), None | Some(Origin::Default | Origin::Preset(_)))
        });
        let kept = keep_resident_budget && plan.settings.resident_module_budget_gb > 0.0;
        Target {
            route: plan.route,
            explicit_budget: users || kept,
            device_total_bytes,
            device_is_gpu: device.starts_with("cuda"),
            device: device.to_owned(),
        }
    }
}

/// Why a recommendation is not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The file does not hold a usable recommendation for this route and device.
    Invalid,
    /// It was measured on a GPU of another size.
    DeviceChanged,
}

impl Refusal {
    /// The status metrics report (`setup.capacity_profile.status`).
    pub const fn status(self) -> &'static str {
        match self {
            Refusal::Invalid => "invalid",
            Refusal::DeviceChanged => "device_changed",
        }
    }
}

/// What to do with a recommendation.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The route has no GPU weight budget to size.
    NotApplicable,
    /// The user set the budget: it stays, whatever the profile holds.
    ExplicitBudget {
        /// The budget the profile would have set, where it names a usable one.
        recommended_gb: Option<f64>,
    },
    /// Set `setting` (and the published `profile_resident_module_budget_gb`) to `budget_gb`.
    Apply {
        /// The route's budget setting.
        setting: &'static str,
        /// The recommended budget.
        budget_gb: f64,
    },
    /// Not applied; the budget stays and the host warns with `why`.
    Refused {
        /// Which kind of refusal.
        refusal: Refusal,
        /// What is wrong and what to do, without the profile's name or path.
        why: String,
    },
}

/// Whether `recommendation` sizes the budget of `target`.
pub fn decide(recommendation: &Recommendation, target: &Target) -> Outcome {
    let Some(setting) = target.route.budget_setting() else {
        return Outcome::NotApplicable;
    };
    let route = target.route.name();
    let usable = recommendation.budget_gb.filter(|b| b.is_finite() && *b >= 0.0);
    if target.explicit_budget {
        return Outcome::ExplicitBudget { recommended_gb: usable };
    }
    let refused = |refusal, why: String| Outcome::Refused { refusal, why };
    let Some(budget) = usable else {
        return refused(
            Refusal::Invalid,
            "it recommends no finite budget >= 0: delete it or build it again".into(),
        );
    };
    if let Some(recorded) = recommendation.setting.as_deref().filter(|s| *s != setting) {
        return refused(
            Refusal::Invalid,
            format!(
                "it recommends {recorded:?}, and route {route} sizes {setting}: delete it or build it again"
            ),
        );
    }
    let total = target.device_total_bytes;
    if let Some(recorded) =
        recommendation.device_total_bytes.filter(|r| target.device_is_gpu && *r != total as f64)
    {
        return refused(
            Refusal::DeviceChanged,
            format!(
                "it was measured on a GPU of {recorded} bytes, and this one has {total}: build it again on this GPU"
            ),
        );
    }
    if budget * GIB > total as f64 {
        return refused(
            Refusal::Invalid,
            format!(
                "it recommends {budget} GiB, more than {}'s {:.1} GiB: build it again",
                target.device,
                total as f64 / GIB
            ),
        );
    }
    if target.route.is_native() && budget <= 0.0 {
        return refused(
            Refusal::Invalid,
            "it recommends no GPU memory for weights (0 GiB): build it again with a lighter run or a lower \
             profile_vram_headroom_gb, or set vmm_resident_weight_budget_gb"
                .into(),
        );
    }
    Outcome::Apply { setting, budget_gb: budget }
}

/// The recommendation of a measured run: `(budget GiB, free margin bytes)`. The margin is
/// `max(0, total - peak - headroom)` bytes and the budget the run's own budget plus the margin,
/// rounded down to 1/10000 GiB.
pub fn recommend_budget_gb(
    build_budget_gb: f64,
    total_bytes: u64,
    peak_bytes: u64,
    headroom_bytes: u64,
) -> (f64, u64) {
    let margin = total_bytes.saturating_sub(peak_bytes).saturating_sub(headroom_bytes);
    ((((build_budget_gb + margin as f64 / GIB) * 1e4).floor()) / 1e4, margin)
}

/// The published library's rule for a host's own numbers: `max(0, total - peak - headroom)`
/// GiB, rounded to 4 digits.
pub fn published_resident_budget_gb(total_gb: f64, peak_gb: f64, headroom_gb: f64) -> f64 {
    ((total_gb - peak_gb - headroom_gb).max(0.0) * 1e4).round() / 1e4
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB_U: u64 = 1 << 30;

    fn target(route: Route) -> Target {
        Target {
            route,
            explicit_budget: false,
            device_total_bytes: 80 * GIB_U,
            device_is_gpu: true,
            device: "cuda:0".into(),
        }
    }

    fn recommending(budget: f64) -> Recommendation {
        Recommendation { budget_gb: Some(budget), ..Recommendation::default() }
    }

    #[test]
    fn a_recommendation_sizes_the_routes_own_budget() {
        assert_eq!(
            decide(&recommending(12.5), &target(Route::VmmFastRuntime)),
            Outcome::Apply { setting: "vmm_resident_weight_budget_gb", budget_gb: 12.5 }
        );
        assert_eq!(
            decide(&recommending(0.25), &target(Route::LinearRuntime)),
            Outcome::Apply { setting: "resident_module_budget_gb", budget_gb: 0.25 }
        );
        assert_eq!(decide(&recommending(1.0), &target(Route::VmmRuntime)), Outcome::NotApplicable);
    }

    #[test]
    fn an_explicit_budget_stays() {
        let explicit = Target { explicit_budget: true, ..target(Route::LinearRuntime) };
        assert_eq!(
            decide(&recommending(0.25), &explicit),
            Outcome::ExplicitBudget { recommended_gb: Some(0.25) }
        );
        // Whatever the profile holds: the user's budget stays, silently.
        assert_eq!(
            decide(&Recommendation::default(), &explicit),
            Outcome::ExplicitBudget { recommended_gb: None }
        );
    }

    #[test]
    fn what_does_not_fit_is_refused_with_the_reason() {
        let why = |r: &Recommendation, t: &Target| match decide(r, t) {
            Outcome::Refused { refusal, why } => (refusal, why),
            other => panic!("applied: {other:?}"),
        };
        let native = target(Route::VmmFastRuntime);
        let (r, w) = why(&Recommendation::default(), &native);
        assert_eq!(r, Refusal::Invalid);
        assert!(w.contains("no finite budget"), "{w}");
        assert!(why(&recommending(f64::NAN), &native).1.contains("no finite budget"));
        let other = Recommendation {
            setting: Some("vmm_resident_weight_budget_gb".into()),
            ..recommending(1.0)
        };
        assert!(
            why(&other, &target(Route::LinearRuntime))
                .1
                .contains("sizes resident_module_budget_gb")
        );
        let moved = Recommendation { device_total_bytes: Some(24.0 * GIB), ..recommending(1.0) };
        assert_eq!(why(&moved, &native).0, Refusal::DeviceChanged);
        // On the host backend the recorded GPU size does not matter.
        let host = Target { device_is_gpu: false, ..native.clone() };
        assert!(matches!(decide(&moved, &host), Outcome::Apply { .. }));
        assert!(why(&recommending(1e300), &native).1.contains("more than cuda:0's 80.0 GiB"));
        assert!(why(&recommending(0.0), &native).1.contains("no GPU memory for weights"));
        // The linear route's resident budget may be 0 (every block streamed).
        assert!(matches!(
            decide(&recommending(0.0), &target(Route::LinearRuntime)),
            Outcome::Apply { .. }
        ));
    }

    #[test]
    fn a_budget_is_the_users_unless_a_default_or_preset_set_it() {
        let plan = |pairs: &[(&str, &str)], env: &[(&str, &str)]| {
            let arguments = serde_json::Value::Object(
                pairs.iter().map(|(k, v)| (k.to_string(), serde_json::json!(v))).collect(),
            );
            let request = crate::Request {
                component: "transformer",
                arguments: crate::DynamicOffloadConfig::from_json_value(
                    &arguments,
                    Origin::Argument,
                )
                .unwrap(),
                environment: crate::Environment::from_pairs(env.iter().copied()),
                ..crate::Request::default()
            };
            crate::resolve(&request).unwrap()
        };
        let target =
            |p: &Plan, keep| Target::for_plan(p, "cuda:0", 80 * GIB_U, keep).explicit_budget;
        // warm_process sets resident_module_budget_gb = 6 from its preset.
        let warm = plan(&[("preset", "warm_process")], &[]);
        assert!(!target(&warm, false));
        assert!(target(&warm, true), "a host's session keeps a resident budget already set");
        let env = plan(&[], &[("DDO_RESIDENT_MODULE_BUDGET_GB", "0.5")]);
        assert!(target(&env, false));
        let native = plan(&[("backend", "vmm")], &[]);
        assert!(!target(&native, false) && !target(&native, true));
        let t = Target::for_plan(&native, "cpu", GIB_U, false);
        assert!(!t.device_is_gpu && t.device == "cpu");
    }

    #[test]
    fn the_recommended_budget_adds_the_free_margin() {
        let (budget, margin) = recommend_budget_gb(3.0, 80 * GIB_U, 70 * GIB_U, GIB_U);
        assert_eq!((budget, margin), (12.0, 9 * GIB_U));
        assert_eq!(recommend_budget_gb(3.0, 10 * GIB_U, 12 * GIB_U, GIB_U), (3.0, 0));
        // Rounded down to 1/10000 GiB.
        assert_eq!(recommend_budget_gb(0.0, GIB_U + 12345, 0, GIB_U).0, 0.0);
        assert_eq!(published_resident_budget_gb(24.0, 20.5, 1.0), 2.5);
        assert_eq!(published_resident_budget_gb(24.0, 30.0, 1.0), 0.0);
    }
}
