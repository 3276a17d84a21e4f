//! The phase helpers' sections, the execution timer's snapshot and capacity profiles: where
//! they may appear, their JSON and their profile lines.

use ddo_metrics::DynamicOffloadMetrics;
use serde_json::json;

fn parse(v: serde_json::Value) -> DynamicOffloadMetrics {
    serde_json::from_value(v).expect("parses")
}

#[test]
fn each_phase_section_belongs_to_its_route() {
    let sections = [
        (
            "pytorch_host_cache_release",
            "host_cache_release",
            json!({"phase": "after_run", "status": "released", "allocator_bytes_before": 4096, "allocator_bytes_after": 0, "allocator_bytes_delta": -4096}),
        ),
        (
            "native_vmm_idle_cache_release",
            "idle_cache_release",
            json!({"phase": "before_transformer", "status": "completed", "sessions": 1, "slots_released": 3, "bytes_released": 6291456}),
        ),
        (
            "vmm_auxiliary_source_detachment",
            "auxiliary_detachment",
            json!({"status": "nothing_to_detach", "copied_bytes": 0, "gpu_placement_changed": false, "commit_recovery_proven": false}),
        ),
    ];
    for (route, section, value) in &sections {
        let m = parse(
            json!({"schema_version": 2, "route": route, "runtime": {*section: value.clone()}}),
        );
        m.validate().unwrap_or_else(|e| panic!("{route}: {e}"));
        assert_eq!(m.as_dict()["runtime"][*section], *value, "{route} round-trips");
        assert!(m.format_profile().contains(&format!("  {section}=")), "{route} has its line");
        // Another route does not report it.
        let other = parse(
            json!({"schema_version": 2, "route": "host_memory_observation", "runtime": {*section: value.clone()}}),
        );
        assert!(other.validate().is_err(), "{section} outside {route} is refused");
    }
}

#[test]
fn execution_timing_attaches_to_any_route() {
    let timing = json!({
        "schema_version": 1, "clock": "cuda_event", "unit": "seconds",
        "scope": "compute_stream_with_dependencies", "failed": false, "status": "complete",
        "stream": 7, "phase_seconds": 3.0, "step_seconds": [1.5, 0.75, 0.75], "tail_seconds": 0.0,
        "steady_state_seconds_per_step": 0.75, "step_count": 3,
        "diagnostic_step_wait": {"enabled": true, "scope": "host_wait_for_step_completion", "calls": 3, "host_seconds": 0.5, "benchmark_eligible": false}
    });
    for route in ["dynamic_offload", "diffusers_group_offload", "none"] {
        let m = parse(
            json!({"schema_version": 2, "route": route, "runtime": {"execution_timing": timing.clone()}}),
        );
        m.validate().expect("an attachment, not a counter");
        assert_eq!(m.as_dict()["runtime"]["execution_timing"], timing);
        let text = m.format_profile();
        assert!(text.contains("  execution_timing=status=complete clock=cuda_event"), "{text}");
        assert!(text.contains("steady_state_seconds_per_step=0.750000"), "{text}");
        assert!(text.contains("not benchmark-eligible"), "{text}");
    }
}

#[test]
fn capacity_profile_is_a_setup_line() {
    let m = parse(json!({
        "schema_version": 2, "route": "dynamic_offload",
        "setup": {"capacity_profile": {"name": "flux", "status": "applied", "setting": "vmm_resident_weight_budget_gb", "budget_gb": 6.5, "recommended_budget_gb": 6.5}}
    }));
    m.validate().expect("valid");
    let text = m.format_profile();
    assert!(
        text.contains("  capacity_profile=name=flux status=applied setting=vmm_resident_weight_budget_gb budget_gib=6.5000"),
        "{text}"
    );
}
