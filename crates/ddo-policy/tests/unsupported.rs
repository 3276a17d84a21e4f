//! Settings ddo does not implement: refused with a message naming the setting, the value, its
//! origin and what ddo does instead whenever they differ from the default, from every layer;
//! accepted at the default. No preset sets one, so every preset resolves.

use ddo_policy::{
    Backend, DynamicOffloadConfig, Environment, Preset, Request, SETTING_KEYS,
    UNSUPPORTED_SETTINGS, config_schema, resolve, resolve_backend,
};
use serde_json::{Value, json};

/// A refused setting: a value other than the default (JSON, variable text, as messages show it)
/// and the default (JSON, as messages show it).
struct Case {
    field: &'static str,
    other: Value,
    other_text: &'static str,
    other_shown: &'static str,
    default: Value,
    default_shown: &'static str,
}

fn cases() -> Vec<Case> {
    let case = |field, other, other_text, other_shown, default, default_shown| Case {
        field,
        other,
        other_text,
        other_shown,
        default,
        default_shown,
    };
    vec![
        case("offload_device", json!("cuda:0"), "cuda:0", "\"cuda:0\"", json!("cpu"), "\"cpu\""),
        case("max_resident_module_budget_gb", json!(0.0), "0", "0", json!(6.0), "6"),
        case("auto_full_pin_min_model_to_vram_ratio", json!(2.5), "2.5", "2.5", json!(4.0), "4"),
        case("cache_pinned_weights", json!(true), "1", "true", json!(false), "false"),
        case("pin_weight_budget_ratio", json!(0.5), "0.5", "0.5", json!(0.0), "0"),
        case("max_pin_weight_budget_gb", json!(8.0), "8", "8", json!(0.0), "0"),
        case(
            "pin_weight_selection",
            json!("largest"),
            "largest",
            "\"largest\"",
            json!("spread"),
            "\"spread\"",
        ),
        case("resident_module_patterns", json!(["auto"]), "auto", "[\"auto\"]", json!([]), "[]"),
        case(
            "resident_module_selection",
            json!("first"),
            "first",
            "\"first\"",
            json!("spread"),
            "\"spread\"",
        ),
        case("skip_modules_pattern", json!(["norm"]), "norm", "[\"norm\"]", json!([]), "[]"),
        case("vmm_execution_backing_reclaim", json!(true), "yes", "true", json!(false), "false"),
        case(
            "target_module_classes",
            json!(["Linear", "Conv2d"]),
            "Linear,Conv2d",
            "[\"Linear\", \"Conv2d\"]",
            json!(["Linear", "Embedding"]),
            "[\"Linear\", \"Embedding\"]",
        ),
        case(
            "linear_runtime_strategy",
            json!("swap"),
            "swap",
            "\"swap\"",
            json!("functional"),
            "\"functional\"",
        ),
        case("available_system_ram_gb", json!(64.0), "64", "64", json!(0.0), "0"),
        case("pinned_weight_cache_namespace", json!("flux"), "flux", "\"flux\"", json!(""), "\"\""),
        case("vmm_component_buffer_limit_mb", json!(8), "8", "8", json!(1), "1"),
        case("vmm_page_mb", json!(32), "32", "32", json!(0), "0"),
        case("vmm_float8_weight_only", json!(true), "1", "true", json!(false), "false"),
        case("vmm_host_cache_gb", json!(2.0), "2", "2", json!(0.0), "0"),
        case("vmm_native_source_cache_slot_mb", json!(64), "64", "64", json!(0), "0"),
        case("vmm_native_source_cache_slots", json!(4), "4", "4", json!(0), "0"),
        case("vmm_pin_source_weights", json!(true), "1", "true", json!(false), "false"),
        case("vmm_fault_fallback", json!(true), "1", "true", json!(false), "false"),
        case("vmm_windows_file_read_chunk_mb", json!(4), "4", "4", json!(2), "2"),
        case("vmm_virtual_host_transport", json!(true), "1", "true", json!(false), "false"),
        case("vmm_dxgi_local_headroom_gb", json!(1.0), "1", "1", json!(0.0), "0"),
        case("vmm_dxgi_shared_headroom_gb", json!(1.0), "1", "1", json!(0.0), "0"),
        case("vmm_dxgi_system_headroom_gb", json!(1.0), "1", "1", json!(0.0), "0"),
    ]
}

fn config(field: &str, value: &Value) -> DynamicOffloadConfig {
    serde_json::from_value(json!({ field: value })).unwrap_or_else(|e| panic!("{field}: {e}"))
}

fn key(field: &str) -> &'static str {
    SETTING_KEYS.iter().find(|(f, _)| *f == field).map(|(_, k)| *k).expect("a setting")
}

fn instead(field: &str) -> &'static str {
    UNSUPPORTED_SETTINGS.iter().find(|(f, _)| *f == field).map(|(_, i)| *i).expect("refused")
}

/// The requests that set `field` from each layer: argument, config, `DDO_*`, `DDO_<COMPONENT>_*`;
/// with the origin each message names.
fn from_every_layer(field: &str, json: &Value, text: &str) -> Vec<(Request<'static>, String)> {
    let global = format!("DDO_{}", key(field));
    let component = format!("DDO_TRANSFORMER_{}", key(field));
    let base = Request { component: "transformer", ..Request::default() };
    vec![
        (Request { arguments: config(field, json), ..base.clone() }, "argument".into()),
        (Request { config: Some(config(field, json)), ..base.clone() }, "config".into()),
        (
            Request {
                environment: Environment::from_pairs([(global.clone(), text)]),
                ..base.clone()
            },
            global,
        ),
        (
            Request { environment: Environment::from_pairs([(component.clone(), text)]), ..base },
            component,
        ),
    ]
}

#[test]
fn the_refused_settings_are_exactly_these() {
    let mut refused: Vec<&str> = UNSUPPORTED_SETTINGS.iter().map(|(f, _)| *f).collect();
    refused.sort_unstable();
    let mut tested: Vec<&str> = cases().iter().map(|c| c.field).collect();
    tested.sort_unstable();
    assert_eq!(refused, tested);
}

#[test]
fn a_refused_setting_other_than_its_default_is_an_error_from_every_layer() {
    for case in cases() {
        for (request, origin) in from_every_layer(case.field, &case.other, case.other_text) {
            let e = resolve(&request).expect_err(case.field).to_string();
            assert_eq!(
                e,
                format!(
                    "{} = {} (from {origin}) is not supported by ddo: {}; leave it unset or at its default {}",
                    case.field,
                    case.other_shown,
                    instead(case.field),
                    case.default_shown
                )
            );
        }
    }
}

#[test]
fn a_refused_setting_at_its_default_is_accepted_from_every_layer() {
    for case in cases() {
        let default_text = match &case.default {
            Value::Array(items) => {
                items.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(",")
            }
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        for (request, origin) in from_every_layer(case.field, &case.default, &default_text) {
            let plan =
                resolve(&request).unwrap_or_else(|e| panic!("{} from {origin}: {e}", case.field));
            let value = plan.settings.to_json_pairs().into_iter().find(|(f, _)| *f == case.field);
            assert_eq!(value.map(|(_, v)| v), Some(case.default.clone()), "{}", case.field);
        }
    }
}

#[test]
fn the_message_names_setting_value_origin_and_what_ddo_does() {
    let request = Request {
        component: "transformer",
        environment: Environment::from_pairs([("DDO_MAX_RESIDENT_MODULE_BUDGET_GB", "8")]),
        ..Request::default()
    };
    assert_eq!(
        resolve(&request).unwrap_err().to_string(),
        "max_resident_module_budget_gb = 8 (from DDO_MAX_RESIDENT_MODULE_BUDGET_GB) is not supported by ddo: it caps the published library's heuristic resident budget; ddo's automatic budget (auto_budget_policy = balanced) follows the GPU's free memory less auto_vram_headroom_gb, and fixed budgets are vmm_resident_weight_budget_gb / resident_module_budget_gb; leave it unset or at its default 6"
    );
    let request = Request {
        component: "vae",
        arguments: config("offload_device", &json!("disk")),
        ..Request::default()
    };
    assert_eq!(
        resolve(&request).unwrap_err().to_string(),
        "offload_device = \"disk\" (from argument) is not supported by ddo: ddo keeps offloaded weights in host memory; leave it unset or at its default \"cpu\""
    );
}

#[test]
fn a_refusal_comes_before_the_range_checks() {
    // A ratio above 1 is not "out of range": no ratio is accepted.
    let request = Request {
        component: "transformer",
        arguments: config("pin_weight_budget_ratio", &json!(1.5)),
        ..Request::default()
    };
    let e = resolve(&request).unwrap_err().to_string();
    assert!(
        e.starts_with("pin_weight_budget_ratio = 1.5 (from argument) is not supported by ddo"),
        "{e}"
    );
}

#[test]
fn each_refused_setting_documents_what_ddo_does_instead() {
    let schema = config_schema();
    for (field, instead) in UNSUPPORTED_SETTINGS {
        let description = schema["properties"][field]["description"].as_str().unwrap_or_default();
        assert!(
            description.contains(&format!(
                "Not supported by ddo: only the default is accepted; {instead}."
            )),
            "{field}: {description}"
        );
    }
}

#[test]
fn every_preset_resolves_for_every_backend_and_component() {
    let components = ["transformer", "unet", "text_encoder", "text_encoder_2", "vae", ""];
    let mut resolved = 0;
    for preset in Preset::ALL {
        for backend in Backend::ALL {
            if resolve_backend(*backend, *preset).is_err() {
                continue;
            }
            for component in components {
                for running_on_wsl in [false, true] {
                    let request = Request {
                        component,
                        environment: Environment::from_pairs([
                            ("DDO_PRESET", preset.as_str()),
                            ("DDO_BACKEND", backend.as_str()),
                        ]),
                        running_on_wsl,
                        ..Request::default()
                    };
                    let plan = resolve(&request)
                        .unwrap_or_else(|e| panic!("{preset} {backend} {component:?}: {e}"));
                    assert!(plan.warnings.is_empty(), "{preset}: {:?}", plan.warnings);
                    resolved += 1;
                }
            }
        }
    }
    // 8 linear presets (auto included) and 3 vmm ones (auto, nvme_baseline, vmm_fast).
    assert_eq!(resolved, 11 * components.len() * 2);
}
