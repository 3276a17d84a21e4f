//! The metrics JSON Schema against documents of both layouts: version 2 (what ddo writes) and
//! version 1 (the published library's layout, and ddo's first one).
//!
//! The validator below implements the JSON Schema keywords the schema uses (draft 2020-12
//! semantics) and refuses any other keyword, so a schema that grows a keyword it does not check
//! fails here instead of passing unchecked.

use ddo_metrics::{DynamicOffloadMetrics, ExecutionSection, metrics_schema};
use serde_json::{Value, json};

/// Keywords that only annotate.
const ANNOTATIONS: &[&str] = &["$schema", "title", "description", "default", "format", "$defs"];

fn resolve<'a>(root: &'a Value, reference: &str) -> &'a Value {
    let path = reference
        .strip_prefix("#/")
        .unwrap_or_else(|| panic!("only local references: {reference}"));
    path.split('/').fold(root, |node, part| {
        node.get(part).unwrap_or_else(|| panic!("unresolved reference {reference}"))
    })
}

fn type_matches(kind: &str, value: &Value) -> bool {
    match kind {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "boolean" => value.is_boolean(),
        "null" => value.is_null(),
        "number" => value.is_number(),
        "integer" => {
            value.is_i64() || value.is_u64() || value.as_f64().is_some_and(|f| f.fract() == 0.0)
        }
        other => panic!("unknown type {other}"),
    }
}

/// The errors of `value` against `schema` (empty: valid), each with its JSON path.
fn errors(root: &Value, schema: &Value, value: &Value, at: &str) -> Vec<String> {
    let schema = match schema {
        Value::Bool(true) => return vec![],
        Value::Bool(false) => return vec![format!("{at}: nothing is allowed here")],
        Value::Object(schema) => schema,
        other => panic!("a schema is an object or a boolean, not {other}"),
    };
    let mut out = Vec::new();
    for (keyword, arg) in schema {
        match keyword.as_str() {
            k if ANNOTATIONS.contains(&k) => {}
            "$ref" => out.extend(errors(root, resolve(root, arg.as_str().unwrap()), value, at)),
            "type" => {
                let kinds: Vec<&str> = match arg {
                    Value::String(s) => vec![s.as_str()],
                    Value::Array(a) => a.iter().map(|k| k.as_str().unwrap()).collect(),
                    other => panic!("type {other}"),
                };
                if !kinds.iter().any(|k| type_matches(k, value)) {
                    out.push(format!("{at}: {value} is not of type {kinds:?}"));
                }
            }
            "const" => {
                if value != arg {
                    out.push(format!("{at}: {value} is not {arg}"));
                }
            }
            "enum" => {
                if !arg.as_array().unwrap().contains(value) {
                    out.push(format!("{at}: {value} is not one of {arg}"));
                }
            }
            "minimum" => {
                if value.as_f64().is_some_and(|v| v < arg.as_f64().unwrap()) {
                    out.push(format!("{at}: {value} < {arg}"));
                }
            }
            "required" => {
                if let Value::Object(object) = value {
                    for name in arg.as_array().unwrap() {
                        if !object.contains_key(name.as_str().unwrap()) {
                            out.push(format!("{at}: {name} is required"));
                        }
                    }
                }
            }
            "properties" => {
                if let Value::Object(object) = value {
                    for (name, sub) in arg.as_object().unwrap() {
                        if let Some(v) = object.get(name) {
                            out.extend(errors(root, sub, v, &format!("{at}/{name}")));
                        }
                    }
                }
            }
            "additionalProperties" => {
                if let Value::Object(object) = value {
                    let known = schema.get("properties").and_then(Value::as_object);
                    for (name, v) in object {
                        if !known.is_some_and(|k| k.contains_key(name)) {
                            out.extend(errors(root, arg, v, &format!("{at}/{name}")));
                        }
                    }
                }
            }
            "items" => {
                if let Value::Array(items) = value {
                    for (i, v) in items.iter().enumerate() {
                        out.extend(errors(root, arg, v, &format!("{at}/{i}")));
                    }
                }
            }
            "anyOf" | "oneOf" => {
                let branches: Vec<Vec<String>> =
                    arg.as_array().unwrap().iter().map(|s| errors(root, s, value, at)).collect();
                let passing = branches.iter().filter(|e| e.is_empty()).count();
                let ok = if keyword == "oneOf" { passing == 1 } else { passing >= 1 };
                if !ok {
                    out.push(format!(
                        "{at}: {passing} of the {keyword} branches match ({})",
                        branches.iter().map(|e| e.join("; ")).collect::<Vec<_>>().join(" | ")
                    ));
                }
            }
            other => {
                panic!("the schema uses keyword {other:?}, which this validator does not check")
            }
        }
    }
    out
}

fn validate(value: &Value) -> Vec<String> {
    let schema = metrics_schema();
    errors(&schema, &schema, value, "")
}

fn assert_valid(value: &Value) {
    let e = validate(value);
    assert!(e.is_empty(), "{value}\n{}", e.join("\n"));
}

/// A version-2 document as ddo writes it (every section filled).
fn version_2() -> Value {
    let mut m = DynamicOffloadMetrics::new(ExecutionSection {
        route: "vmm_fast_runtime".into(),
        component: Some("transformer".into()),
        backend: Some("vmm".into()),
        requested_preset: Some("auto".into()),
        effective_preset: Some("vmm_fast".into()),
        execution_mode: Some("vmm_fast_runtime".into()),
    });
    m.configuration.insert("dynamic_offload_prefetch_depth".into(), json!(2));
    m.setup.module_count = Some(640);
    m.setup.unit_count = Some(57);
    m.setup.gpu_budget_bytes = Some(3 << 30);
    m.setup.setup_seconds = Some(0.25);
    m.setup.warnings = Some(vec!["DDO_PREFETCH_DEPT is not a ddo variable".into()]);
    m.runtime.passes = Some(4);
    m.runtime.upload_bytes = Some(123_456_789);
    m.runtime.wait_seconds = Some(0.5);
    m.as_dict()
}

/// A document in the published library's layout (schema version 1), as its hosts stored them.
fn published_version_1() -> Value {
    json!({
        "schema_version": 1,
        "route": "dynamic_offload",
        "configuration": {
            "dynamic_offload_requested_preset": "auto",
            "dynamic_offload_effective_preset": "one_shot_fast",
            "dynamic_offload_execution_mode": "linear_runtime",
            "dynamic_offload_pin_cpu_memory": true,
            "dynamic_offload_component_policies": {}
        },
        "setup": {
            "module_count": 640,
            "total_gb": 13.8021,
            "bytes_by_placement": {"streamed_large": 12.5, "resident_small": 0.3021, "resident_module": 1.0},
            "execution_mode": "linear_runtime",
            "pin_cpu_memory": true,
            "auto_budget_policy": "balanced",
            "patched_module_count": 620,
            "sdnq_parameter_pinning": {"pinned_count": 0, "pinned_gb": 0.0, "unpinned_count": 0, "unpinned_gb": 0.0},
            "resolved_resident_module_patterns": ["^transformer_blocks\\.\\d+$"],
            "planner_decisions": {"auto_pin_weight_decision": "budgeted", "plan_cache": "miss"},
            "setup_runtime": {"pin_linear_weights": {"seconds": 1.5, "gb": 12.5}}
        },
        "runtime": {
            "state": {"module_count": 640, "copy_runtime": {"linear_weight": {"calls": 10, "seconds": 0.1, "gb": 1.0}}},
            "vmm": {"reserved_bytes": 0, "resident_bytes": 0},
            "execution_timing": {
                "schema_version": 1, "clock": "cuda_event", "unit": "seconds",
                "scope": "compute_stream_with_dependencies", "failed": false, "status": "complete",
                "stream": 7, "phase_seconds": 207.4, "step_seconds": [30.0, 25.1], "tail_seconds": 0.012,
                "steady_state_seconds_per_step": 25.1, "step_count": 2
            }
        }
    })
}

#[test]
fn a_version_2_document_is_valid() {
    assert_valid(&version_2());
    assert_valid(&DynamicOffloadMetrics::observation("host_memory_observation").as_dict());
}

#[test]
fn published_and_ddo_s_first_version_1_documents_are_valid() {
    assert_valid(&published_version_1());
    let group = json!({
        "schema_version": 1, "route": "diffusers_group_offload", "configuration": {},
        "setup": {"offload_type": "leaf_level", "use_stream": true, "record_stream": false, "low_cpu_mem_usage": true},
        "runtime": {}
    });
    assert_valid(&group);
    let none = json!({"schema_version": 1, "route": "none", "setup": {"unmanaged_module_moved_to_execution_device": true}});
    assert_valid(&none);
    let ddo_first = json!({
        "schema_version": 1,
        "route": {"name": "linear_runtime", "component": "transformer", "backend": "linear"},
        "setup": {"module_count": 3},
        "runtime": {"passes": 2, "uploads": 4}
    });
    assert_valid(&ddo_first);
    // What the schema accepts, ddo reads.
    for doc in [published_version_1(), group, none, ddo_first] {
        let m: DynamicOffloadMetrics = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(m.schema_version, 1, "{doc}");
    }
}

#[test]
fn documents_of_neither_layout_are_refused() {
    let mut wrong_version = version_2();
    wrong_version["schema_version"] = json!(3);
    assert!(!validate(&wrong_version).is_empty());
    // A version-2 document must carry a string route.
    let mut object_route = version_2();
    object_route["route"] = json!({"name": "linear_runtime"});
    assert!(!validate(&object_route).is_empty());
    // Typed version-2 counters are checked.
    let mut text_counter = version_2();
    text_counter["runtime"]["passes"] = json!("four");
    assert!(!validate(&text_counter).is_empty());
    // Version 1 keeps the published keys' types.
    let mut published = published_version_1();
    published["setup"]["total_gb"] = json!("13.8");
    assert!(!validate(&published).is_empty());
    let mut no_route = published_version_1();
    no_route.as_object_mut().unwrap().remove("route");
    assert!(!validate(&no_route).is_empty());
    let mut bad_timing = published_version_1();
    bad_timing["runtime"]["execution_timing"]["step_seconds"] = json!("fast");
    assert!(!validate(&bad_timing).is_empty());
}

#[test]
fn the_schema_is_one_of_both_layouts() {
    let schema = metrics_schema();
    let branches: Vec<&str> =
        schema["oneOf"].as_array().unwrap().iter().map(|b| b["$ref"].as_str().unwrap()).collect();
    assert_eq!(branches, ["#/$defs/MetricsVersion2", "#/$defs/MetricsVersion1"]);
    let v2 = &schema["$defs"]["MetricsVersion2"];
    assert_eq!(v2["properties"]["schema_version"]["const"], 2);
    assert_eq!(v2["properties"]["route"]["type"], "string");
    assert!(v2["properties"].get("execution").is_some());
    assert_eq!(schema["$defs"]["MetricsVersion1"]["properties"]["schema_version"]["const"], 1);
}
