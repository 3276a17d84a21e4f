//! `DDO_*` variables ddo does not read are reported on the plan (a warning with the closest known
//! name), never an error; variables without the prefix are ignored.

use ddo_policy::{Environment, Request, SETTING_KEYS, resolve};

fn warnings(pairs: &[(&str, &str)], component: &str) -> Vec<String> {
    let request = Request {
        component,
        environment: Environment::from_pairs(pairs.iter().copied()),
        ..Request::default()
    };
    resolve(&request).unwrap_or_else(|e| panic!("{e}")).warnings
}

#[test]
fn a_misspelt_variable_is_reported_with_a_suggestion() {
    assert_eq!(
        warnings(&[("DDO_PREFETCH_DEPT", "3")], "transformer"),
        ["DDO_PREFETCH_DEPT is not a ddo variable; did you mean DDO_PREFETCH_DEPTH?"]
    );
    assert_eq!(
        warnings(&[("DDO_VAE_ROUT", "none"), ("DDO_PRSET", "off")], "transformer"),
        [
            "DDO_PRSET is not a ddo variable; did you mean DDO_PRESET?",
            "DDO_VAE_ROUT is not a ddo variable; did you mean DDO_VAE_ROUTE?",
        ]
    );
}

#[test]
fn a_misspelt_variable_changes_nothing_else() {
    let request = Request {
        component: "transformer",
        environment: Environment::from_pairs([("DDO_PREFETCH_DEPT", "9")]),
        ..Request::default()
    };
    let plan = resolve(&request).unwrap();
    let clean = resolve(&Request { component: "transformer", ..Request::default() }).unwrap();
    assert_eq!(plan.settings.prefetch_depth, clean.settings.prefetch_depth);
    let json = serde_json::to_value(&plan).unwrap();
    assert_eq!(
        json["warnings"],
        serde_json::json!([
            "DDO_PREFETCH_DEPT is not a ddo variable; did you mean DDO_PREFETCH_DEPTH?"
        ])
    );
}

#[test]
fn a_variable_far_from_every_name_is_reported_without_a_suggestion() {
    assert_eq!(
        warnings(&[("DDO_VMM_LIBRARY_PATH", "/opt/lib.so")], "vae"),
        ["DDO_VMM_LIBRARY_PATH is not a ddo variable; ddo ignores it"]
    );
}

/// A setting's resolved value in its variable form.
fn text(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Bool(b) => (if *b { "1" } else { "0" }).into(),
        serde_json::Value::Array(items) => items.iter().map(text).collect::<Vec<_>>().join(";"),
        other => other.to_string(),
    }
}

#[test]
fn every_variable_resolution_reads_is_known() {
    let defaults = resolve(&Request { component: "transformer", ..Request::default() }).unwrap();
    let mut pairs: Vec<(String, String)> = Vec::new();
    for (field, value) in defaults.settings.to_json_pairs() {
        let key = SETTING_KEYS.iter().find(|(f, _)| *f == field).unwrap().1;
        pairs.push((format!("DDO_{key}"), text(&value)));
        pairs.push((format!("DDO_TEXT_ENCODER_2_{key}"), text(&value)));
    }
    for (name, value) in [
        ("DDO_PRESET", "auto"),
        ("DDO_BACKEND", "linear"),
        ("DDO_SAFETENSORS_BACKEND", "auto"),
        ("DDO_VAE_ROUTE", "none"),
        ("DDO_RUNNER_VAE_ROUTE", "none"),
        ("DDO_TRANSFORMER_GROUP_OFFLOAD", "0"),
        ("DDO_RUNNER_TRANSFORMER_OFFLOAD_LOW_CPU_MEM_USAGE", "1"),
        ("DDO_UNET_NUM_BLOCKS_PER_GROUP", "1"),
        // Keys presets carry for hosts.
        ("DDO_EXECUTION_MODE", "plan"),
        ("DDO_PLAN", "0"),
        ("DDO_RUNNER_ATTENTION_BACKEND", "native"),
        ("DDO_RUNNER_GENERATION_REPEATS", "2"),
        ("DDO_PURGE_WINDOWS_STANDBY_AFTER_TEXT_ENCODER", "1"),
    ] {
        pairs.push((name.into(), value.into()));
    }
    for component in ["transformer", "text_encoder_2", "vae"] {
        let request = Request {
            component,
            environment: Environment::from_pairs(pairs.clone()),
            ..Request::default()
        };
        let plan = resolve(&request).unwrap_or_else(|e| panic!("{component}: {e}"));
        assert_eq!(plan.warnings, Vec::<String>::new(), "{component}");
    }
}

#[test]
fn variables_without_the_prefix_are_ignored() {
    assert_eq!(
        warnings(&[("PATH", "/usr/bin"), ("XDDO_PRESET", "off"), ("ddo_preset", "off")], ""),
        Vec::<String>::new()
    );
}
