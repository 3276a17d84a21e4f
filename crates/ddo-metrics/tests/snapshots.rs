//! A representative snapshot of each route: JSON, text profile, and the schema.

use ddo_core::{CgroupMemory, GIB, HostMemoryObservation, MIB, OvercommitMode};
use ddo_metrics::{
    DynamicOffloadMetrics, ExecutionSection, GroupOffloadSetup, HostMemorySection, metrics_schema,
};

fn route(name: &str, preset: &str, effective: &str, backend: &str, mode: &str) -> ExecutionSection {
    ExecutionSection {
        route: name.into(),
        component: Some("transformer".into()),
        backend: Some(backend.into()),
        requested_preset: Some(preset.into()),
        effective_preset: Some(effective.into()),
        execution_mode: Some(mode.into()),
    }
}

fn host() -> HostMemorySection {
    HostMemorySection {
        observation: HostMemoryObservation {
            rss_bytes: Some(10 * GIB),
            peak_rss_bytes: Some(11 * GIB),
            locked_bytes: Some(0),
            mem_total_bytes: Some(64 * GIB),
            mem_available_bytes: Some(40 * GIB),
            commit_limit_bytes: Some(32 * GIB),
            committed_bytes: Some(12 * GIB),
            overcommit_mode: Some(OvercommitMode::Heuristic),
            cgroups: vec![CgroupMemory {
                path: "/ddo".into(),
                max: Some(48 * GIB),
                high: None,
                current: 12 * GIB,
                reclaimable: 2 * GIB,
            }],
            rlimit_as_bytes: None,
            rlimit_memlock_bytes: Some(8 * MIB),
            rlimits_observed: true,
        },
        phase: Some("after_pass".into()),
    }
}

fn vmm_fast() -> DynamicOffloadMetrics {
    let mut m = DynamicOffloadMetrics::new(route(
        "vmm_fast_runtime",
        "auto",
        "vmm_fast",
        "vmm",
        "vmm_fast_runtime",
    ));
    m.configuration.insert("dynamic_offload_prefetch_depth".into(), 2.into());
    m.setup.module_count = Some(640);
    m.setup.tensor_count = Some(812);
    m.setup.total_bytes = Some(9 * GIB + GIB / 2);
    m.setup.setup_seconds = Some(1.25);
    m.setup.unit_count = Some(57);
    m.setup.resident_units = Some(0);
    m.setup.streamed_units = Some(57);
    m.setup.execution_slots = Some(3);
    m.setup.slot_bytes = Some(340 * MIB);
    m.setup.gpu_budget_bytes = Some(3 * GIB);
    m.setup.headroom_bytes = Some(GIB);
    m.setup.streamed_bytes_per_pass = Some(9 * GIB + GIB / 2);
    m.setup.link_bytes_per_second = Some(55.4e9);
    m.setup.expected_copy_floor_seconds = Some(0.184);
    m.setup.registered_bytes = Some(9 * GIB + GIB / 2);
    m.setup.source_bound_tensors = Some(812);
    m.runtime.passes = Some(4);
    m.runtime.uploads = Some(228);
    m.runtime.upload_bytes = Some(38 * GIB);
    m.runtime.upload_seconds = Some(0.012);
    m.runtime.wait_seconds = Some(0.031);
    m.runtime.prefetch_hits = Some(224);
    m.runtime.prefetch_misses = Some(4);
    m.runtime.prefetch_cancels = Some(0);
    m.runtime.evictions = Some(225);
    m.runtime.reclaim_cycles = Some(0);
    m.runtime.resident_bytes = Some(0);
    m.runtime.slot_bytes = Some(1020 * MIB);
    m.runtime.peak_bytes = Some(1020 * MIB);
    m.runtime.unsafe_retained_bytes = Some(0);
    m.host_memory = Some(host());
    m
}

fn vmm_disk() -> DynamicOffloadMetrics {
    let mut m = DynamicOffloadMetrics::new(route(
        "vmm_runtime",
        "nvme_baseline",
        "nvme_baseline",
        "vmm",
        "vmm_runtime",
    ));
    m.setup.unit_count = Some(57);
    m.setup.streamed_units = Some(45);
    m.setup.resident_units = Some(12);
    m.setup.execution_slots = Some(2);
    m.runtime.passes = Some(1);
    m.runtime.uploads = Some(45);
    m.runtime.unsafe_retained_bytes = Some(64 * MIB);
    m
}

fn linear() -> DynamicOffloadMetrics {
    let mut m = DynamicOffloadMetrics::new(route(
        "linear_runtime",
        "auto",
        "one_shot_fast",
        "linear",
        "linear_runtime",
    ));
    m.setup.module_count = Some(640);
    m.setup.total_bytes = Some(9 * GIB);
    m.setup.pinned_bytes = Some(9 * GIB);
    m.runtime.passes = Some(2);
    m.runtime.uploads = Some(1000);
    m.runtime.upload_bytes = Some(18 * GIB);
    m.runtime.prefetch_hits = Some(998);
    m.runtime.prefetch_misses = Some(2);
    m.runtime.peak_bytes = Some(2 * GIB);
    m
}

fn group() -> DynamicOffloadMetrics {
    let mut m = DynamicOffloadMetrics::new(route(
        "diffusers_group_offload",
        "auto",
        "one_shot_fast",
        "linear",
        "linear_runtime",
    ));
    m.execution.as_mut().expect("a route snapshot").component = Some("vae".into());
    m.setup.group_offload = Some(GroupOffloadSetup {
        offload_type: "leaf_level".into(),
        use_stream: false,
        record_stream: false,
        low_cpu_mem_usage: false,
        num_blocks_per_group: None,
    });
    m.runtime.passes = Some(1);
    m
}

fn none() -> DynamicOffloadMetrics {
    let mut m = DynamicOffloadMetrics::new(route("none", "off", "off", "linear", "plan"));
    m.setup.placement = Some("unmanaged".into());
    m
}

#[test]
fn each_route_json_and_profile() {
    for (name, m) in [
        ("vmm_fast_runtime", vmm_fast()),
        ("vmm_runtime", vmm_disk()),
        ("linear_runtime", linear()),
        ("diffusers_group_offload", group()),
        ("none", none()),
    ] {
        m.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
        insta::assert_json_snapshot!(format!("{name}_json"), m.as_dict());
        insta::assert_snapshot!(format!("{name}_profile"), m.format_profile());
    }
}

#[test]
fn json_round_trips() {
    let m = vmm_fast();
    let back: DynamicOffloadMetrics = serde_json::from_value(m.as_dict()).unwrap();
    assert_eq!(back, m);
}

#[test]
fn absent_counters_are_absent_not_zero() {
    let m = group();
    let json = m.as_dict();
    let runtime = json["runtime"].as_object().unwrap();
    assert_eq!(runtime.keys().collect::<Vec<_>>(), ["passes"]);
    let text = m.format_profile();
    assert!(!text.contains("uploads"), "{text}");
    assert!(!text.contains("prefetch"), "{text}");
    assert!(json.get("host_memory").is_none());
}

#[test]
fn a_counter_the_route_lacks_is_refused() {
    let mut m = group();
    m.runtime.prefetch_hits = Some(0);
    m.runtime.evictions = Some(3);
    assert_eq!(
        m.validate().unwrap_err().to_string(),
        "route diffusers_group_offload has no counter(s) prefetch_hits, evictions; a counter a route does not have must be absent"
    );
    // The linear route streams through the arena too: it has the arena's counters.
    let mut l = linear();
    l.runtime.reclaim_cycles = Some(0);
    l.validate().unwrap();
    let mut n = none();
    n.runtime.passes = Some(1);
    assert!(n.validate().is_err());
}

#[test]
fn metrics_json_schema() {
    insta::assert_json_snapshot!("metrics_schema", metrics_schema());
}

#[test]
fn the_route_is_the_published_string_and_ddo_s_route_is_beside_it() {
    for (m, published, runtime) in [
        (linear(), "dynamic_offload", "linear_runtime"),
        (vmm_fast(), "dynamic_offload", "vmm_fast_runtime"),
        (group(), "diffusers_group_offload", "diffusers_group_offload"),
        (none(), "none", "none"),
    ] {
        let json = m.as_dict();
        assert_eq!(json["schema_version"], 2);
        assert_eq!(json["route"], published);
        assert_eq!(json["execution"]["route"], runtime);
        for key in ["schema_version", "route", "setup", "runtime"] {
            assert!(json.get(key).is_some(), "{key} in {json}");
        }
    }
    let observation = DynamicOffloadMetrics::observation("host_memory_observation");
    let json = observation.as_dict();
    assert_eq!(json["route"], "host_memory_observation");
    assert!(json.get("execution").is_none());
    observation.validate().unwrap();
}

#[test]
fn a_version_1_snapshot_still_reads() {
    let v1 = serde_json::json!({
        "schema_version": 1,
        "route": {"name": "linear_runtime", "component": "transformer", "backend": "linear",
                  "requested_preset": "auto", "effective_preset": "one_shot_fast",
                  "execution_mode": "linear_runtime"},
        "setup": {"module_count": 3},
        "runtime": {"passes": 2, "uploads": 4},
    });
    let m: DynamicOffloadMetrics = serde_json::from_value(v1).unwrap();
    assert_eq!(m.schema_version, 1);
    assert_eq!(m.route, "dynamic_offload");
    assert_eq!(m.runtime_route(), "linear_runtime");
    assert_eq!(m.execution.as_ref().and_then(|e| e.component.as_deref()), Some("transformer"));
    m.validate().unwrap();
    let observation: DynamicOffloadMetrics =
        serde_json::from_value(serde_json::json!({"route": {"name": "model_load"}})).unwrap();
    assert_eq!((observation.route.as_str(), observation.execution), ("model_load", None));
}

#[test]
fn the_schema_describes_the_published_route_and_the_execution_section() {
    let schema = metrics_schema();
    let current = &schema["$defs"]["MetricsVersion2"];
    let props = &current["properties"];
    assert_eq!(props["route"]["type"], "string");
    assert!(props.get("execution").is_some(), "{schema}");
    let required: Vec<&str> =
        current["required"].as_array().unwrap().iter().filter_map(|v| v.as_str()).collect();
    assert!(required.contains(&"route") && required.contains(&"schema_version"), "{required:?}");
}
