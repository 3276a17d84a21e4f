//! Metrics: a versioned snapshot of what ddo did for one component, its JSON form (`as_dict`)
//! and its text profile (`format_profile`).
//!
//! The snapshot is plain data, built by the routes and read by hosts; hosts consume only this
//! object, never internal state. It never invents data: every counter is optional, a counter a
//! route does not have is absent (not zero), and [`DynamicOffloadMetrics::validate`] refuses a
//! snapshot that reports a counter its route cannot measure.
#![forbid(unsafe_code)]

mod phases;
mod profile;
mod snapshot;

pub use phases::{
    AutoBudgetSetup, AuxiliaryDetachment, CapacityProfileSetup, DiagnosticStepWait,
    ExecutionTiming, HostCacheRelease, IdleCacheRelease,
};
pub use profile::format_profile;
pub use snapshot::{
    DynamicOffloadMetrics, ExecutionSection, GroupOffloadSetup, HostMemorySection, MetricsError,
    RuntimeSection, SCHEMA_VERSION, SetupSection, published_route, runtime_counters_of,
};

/// The JSON Schema of a metrics document: `oneOf` its two layouts, told apart by
/// `schema_version`.
///
/// - Version 2 ([`SCHEMA_VERSION`], what [`DynamicOffloadMetrics::as_dict`] writes): the
///   published `route` string, ddo's `execution` beside it, every section typed.
/// - Version 1, what reads as before: the published library's layout (`route` a string;
///   `configuration` with `dynamic_offload_<field>` keys, `setup` and `runtime` with its keys:
///   `module_count`, `total_gb`, `bytes_by_placement`, `planner_decisions`, `state`, `vmm`, ...),
///   or ddo's first layout (`route` an object with ddo's route as `name`). Its sections are open:
///   keys beyond the ones described are allowed, as the published library adds them per route.
pub fn metrics_schema() -> serde_json::Value {
    use serde_json::{Value, json};

    let mut current = serde_json::to_value(schemars::schema_for!(DynamicOffloadMetrics))
        .expect("schema serializes");
    let object = current.as_object_mut().expect("the schema is an object");
    let dialect = object.remove("$schema").unwrap_or(Value::Null);
    let mut defs = match object.remove("$defs") {
        Some(Value::Object(defs)) => defs,
        _ => serde_json::Map::new(),
    };
    object.remove("title");
    object.insert("description".into(), json!("Version 2: ddo's layout (as_dict())."));
    object["properties"]["schema_version"] = json!({
        "description": "Layout version 2.",
        "const": SCHEMA_VERSION,
    });
    defs.insert("MetricsVersion2".into(), current);
    defs.insert("MetricsVersion1".into(), version_1_schema());
    json!({
        "$schema": dialect,
        "title": "DynamicOffloadMetrics",
        "description": "A versioned snapshot of one component's offload: version 2 (ddo's layout) or version 1 \
            (the published library's layout, or ddo's first one).",
        "oneOf": [
            {"$ref": "#/$defs/MetricsVersion2"},
            {"$ref": "#/$defs/MetricsVersion1"},
        ],
        "$defs": defs,
    })
}

/// Version 1: the published library's layout (diffusers-dynamic-offloader's schema version 1),
/// and ddo's first layout (`route` an object).
fn version_1_schema() -> serde_json::Value {
    use serde_json::json;

    let number = json!({"type": "number"});
    let count = json!({"type": "integer", "minimum": 0});
    let boolean = json!({"type": "boolean"});
    let text = json!({"type": "string"});
    let open = json!({"type": "object", "additionalProperties": true});
    let gib_by_name = json!({"type": "object", "additionalProperties": {"type": "number"}});
    let names = json!({"type": "array", "items": {"type": "string"}});
    // The published event payload (dynamic route), the group-offload parameters and the
    // unmanaged placement of route none.
    let setup_keys = json!({
        "module_count": count,
        "patched_module_count": count,
        "total_gb": number,
        "bytes_by_placement": gib_by_name,
        "execution_mode": text,
        "pin_cpu_memory": boolean,
        "allow_pin_memory_fallback": boolean,
        "cache_plan": boolean,
        "cache_pinned_weights": boolean,
        "pinned_weight_cache_namespace": text,
        "load_safetensors_backend": text,
        "auto_budget_policy": text,
        "max_resident_module_budget_gb": number,
        "auto_full_pin_min_model_to_vram_ratio": number,
        "profile_resident_module_budget_gb": number,
        "max_pin_weight_budget_gb": number,
        "available_system_ram_gb": number,
        "system_ram_headroom_gb": number,
        "pin_weight_budget_gb": number,
        "pin_weight_budget_ratio": number,
        "pin_weight_selection": text,
        "sdnq_parameter_pinning": open,
        "resolved_resident_module_patterns": names,
        "planner_decisions": open,
        "setup_runtime": open,
        "quantized_backend": open,
        "offload_type": text,
        "use_stream": boolean,
        "record_stream": boolean,
        "low_cpu_mem_usage": boolean,
        "num_blocks_per_group": count,
        "unmanaged_module_moved_to_execution_device": boolean,
    });
    json!({
        "description": "Version 1: the published library's layout (route a string, its keys), or ddo's first \
            layout (route an object with ddo's route as name). Sections are open.",
        "type": "object",
        "properties": {
            "schema_version": {"description": "Layout version 1.", "const": 1},
            "route": {
                "description": "The published route string (dynamic_offload, diffusers_group_offload, none, or an \
                    observation such as model_load), or ddo's first layout: an object with ddo's route as name.",
                "oneOf": [
                    {"type": "string"},
                    {
                        "type": "object",
                        "properties": {
                            "name": text,
                            "component": text,
                            "backend": text,
                            "requested_preset": text,
                            "effective_preset": text,
                            "execution_mode": text,
                        },
                        "required": ["name"],
                        "additionalProperties": true,
                    },
                ],
            },
            "configuration": {
                "description": "The settings as dynamic_offload_<field> keys, and dynamic_offload_component_policies.",
                "type": "object",
                "additionalProperties": true,
            },
            "setup": {
                "description": "What attaching did: the published event payload (dynamic route), the group-offload \
                    parameters (diffusers_group_offload), or unmanaged_module_moved_to_execution_device (none).",
                "type": "object",
                "properties": setup_keys,
                "additionalProperties": true,
            },
            "runtime": {
                "description": "What running did: the published state, vmm store counters, ownership and timing \
                    sections (a counter a route lacks is absent).",
                "type": "object",
                "properties": {
                    "completion_collection": open,
                    "state": open,
                    "vmm": open,
                    "component_ownership": open,
                    "execution_auxiliary_ownership": open,
                    "execution_timing": {"$ref": "#/$defs/ExecutionTiming"},
                    "native_timeline": open,
                    "allocation_diagnostics": open,
                    "operator_diagnostics": open,
                },
                "additionalProperties": true,
            },
        },
        "required": ["schema_version", "route"],
    })
}
