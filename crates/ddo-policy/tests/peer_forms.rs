//! The peer library's forms of settings that ddo spells differently: `execution_mode` picks the
//! backend (and `plan` turns dynamic offload off), `small_tensor_threshold_bytes` is
//! `small_tensor_threshold_kb` in bytes.

use ddo_policy::{
    Backend, DynamicOffloadConfig, Environment, ExecutionMode, Origin, Preset, Request, resolve,
};
use serde_json::json;

fn with(component: &'static str, config: serde_json::Value) -> Request<'static> {
    Request {
        component,
        arguments: DynamicOffloadConfig::from_json_value(&config, Origin::Argument)
            .expect("a valid config"),
        ..Request::default()
    }
}

#[test]
fn each_execution_mode_picks_its_backend_and_route() {
    let cases = [
        ("linear_runtime", Backend::Linear, Preset::OneShotFast, "linear_runtime"),
        ("vmm_fast_runtime", Backend::Vmm, Preset::VmmFast, "vmm_fast_runtime"),
        ("vmm_runtime", Backend::Vmm, Preset::NvmeBaseline, "vmm_runtime"),
        ("plan", Backend::Linear, Preset::OneShotFast, "none"),
    ];
    for (mode, backend, preset, route) in cases {
        let plan = resolve(&with("transformer", json!({ "execution_mode": mode }))).expect(mode);
        assert_eq!(plan.backend, backend, "{mode}");
        assert_eq!(plan.effective_preset, preset, "{mode}");
        assert_eq!(plan.execution_mode.as_str(), mode, "{mode}");
        assert_eq!(plan.route.name(), route, "{mode}");
    }
}

#[test]
fn linear_runtime_turns_a_plan_only_preset_into_dynamic_offload() {
    let plan = resolve(&with(
        "transformer",
        json!({ "preset": "off", "execution_mode": "linear_runtime" }),
    ))
    .expect("resolves");
    assert_eq!(plan.execution_mode, ExecutionMode::LinearRuntime);
    assert_eq!(plan.route.name(), "linear_runtime");
}

#[test]
fn the_variable_is_read_below_arguments() {
    let env = Environment::from_pairs([("DDO_EXECUTION_MODE", "vmm_fast_runtime")]);
    let request =
        Request { component: "transformer", environment: env.clone(), ..Request::default() };
    assert_eq!(resolve(&request).expect("resolves").route.name(), "vmm_fast_runtime");
    let mut explicit = with("transformer", json!({ "execution_mode": "linear_runtime" }));
    explicit.environment = env;
    assert_eq!(resolve(&explicit).expect("resolves").route.name(), "linear_runtime");
}

#[test]
fn a_mode_that_contradicts_the_backend_or_preset_is_refused() {
    for config in [
        json!({ "execution_mode": "linear_runtime", "backend": "vmm" }),
        json!({ "execution_mode": "plan", "backend": "vmm" }),
        json!({ "execution_mode": "vmm_runtime", "preset": "vmm_fast" }),
        json!({ "execution_mode": "vmm_fast_runtime", "preset": "nvme_baseline" }),
    ] {
        let e = resolve(&with("transformer", config.clone())).expect_err("refused").to_string();
        assert!(e.contains("does not fit backend") && e.contains("drop one"), "{config}: {e}");
    }
}

#[test]
fn sdnq_runtime_is_refused_with_what_to_do() {
    let e = resolve(&with("transformer", json!({ "execution_mode": "sdnq_runtime" })))
        .expect_err("refused")
        .to_string();
    assert!(e.contains("sdnq_runtime") && e.contains("diffusers_group_offload"), "{e}");
}

#[test]
fn the_threshold_in_bytes_is_the_threshold_in_kib() {
    let plan = resolve(&with("transformer", json!({ "small_tensor_threshold_bytes": 16384 })))
        .expect("resolves");
    assert_eq!(plan.settings.small_tensor_threshold_kb, 16);
    let same = json!({ "small_tensor_threshold_bytes": 16384, "small_tensor_threshold_kb": 16 });
    assert!(DynamicOffloadConfig::from_json_value(&same, Origin::Argument).is_ok());
    for bad in [
        json!({ "small_tensor_threshold_bytes": 1000 }),
        json!({ "small_tensor_threshold_bytes": -1024 }),
        json!({ "small_tensor_threshold_bytes": 16384, "small_tensor_threshold_kb": 32 }),
    ] {
        let e = DynamicOffloadConfig::from_json_value(&bad, Origin::Argument)
            .expect_err("refused")
            .to_string();
        assert!(e.contains("small_tensor_threshold"), "{bad}: {e}");
    }
}

#[test]
fn where_a_component_runs_is_not_a_request_for_a_runtime() {
    let placed =
        resolve(&with("vae", json!({ "execution_device": "cpu", "offload_device": "cpu" })))
            .expect("resolves");
    assert_eq!(placed.route.name(), "diffusers_group_offload");
    let asked = resolve(&with("vae", json!({ "execution_device": "cpu", "prefetch_depth": 1 })))
        .expect("resolves");
    assert_eq!(asked.route.name(), "linear_runtime");
}

#[test]
fn a_preset_argument_routes_components_as_the_variable_does() {
    let argument = resolve(&with("vae", json!({ "preset": "warm_process" }))).expect("resolves");
    let request = Request {
        component: "vae",
        environment: Environment::from_pairs([("DDO_PRESET", "warm_process")]),
        ..Request::default()
    };
    let variable = resolve(&request).expect("resolves");
    assert_eq!(argument.route, variable.route);
    assert_eq!(argument.route.name(), "none");
}

#[test]
fn a_dynamic_route_under_a_plan_only_mode_reports_the_mode_that_runs() {
    let plan = resolve(&with(
        "transformer",
        json!({ "execution_mode": "plan", "route": "dynamic_offload" }),
    ))
    .expect("resolves");
    assert_eq!(plan.route.name(), "linear_runtime");
    assert_eq!(plan.execution_mode, ExecutionMode::LinearRuntime);
}
