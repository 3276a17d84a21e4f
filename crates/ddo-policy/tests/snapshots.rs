//! Snapshots: every preset's resolved values, the preset listing and the configuration schema.

use ddo_policy::{
    Environment, Preset, Request, SettingValue, config_schema, format_presets, resolve,
};

#[test]
fn every_presets_resolved_plan() {
    let mut out = serde_json::Map::new();
    for preset in Preset::ALL {
        let backend = if preset.is_native() { "vmm" } else { "linear" };
        let mut per_component = serde_json::Map::new();
        for component in ["transformer", "text_encoder", "vae"] {
            let request = Request {
                component,
                environment: Environment::from_pairs([
                    ("DDO_PRESET", preset.as_str()),
                    ("DDO_BACKEND", backend),
                ]),
                ..Request::default()
            };
            let plan = resolve(&request).unwrap_or_else(|e| panic!("{preset} {component}: {e}"));
            per_component.insert(
                component.into(),
                serde_json::json!({
                    "effective_preset": plan.effective_preset,
                    "execution_mode": plan.execution_mode,
                    "route": plan.route,
                }),
            );
            if component == "transformer" {
                let settings: serde_json::Map<_, _> = plan
                    .settings
                    .to_json_pairs()
                    .into_iter()
                    .map(|(k, v)| {
                        (
                            k.to_owned(),
                            serde_json::json!({"value": v, "from": plan.origins[k].to_string()}),
                        )
                    })
                    .collect();
                per_component.insert("settings".into(), settings.into());
            }
        }
        out.insert(preset.as_str().into(), per_component.into());
    }
    insta::assert_json_snapshot!("resolved_presets", out);
}

#[test]
fn every_preset_value_parses_into_its_setting() {
    // A preset table entry that names a setting must be valid for it; resolution would fail otherwise.
    for preset in Preset::ALL {
        let backend = if preset.is_native() { "vmm" } else { "linear" };
        let request = Request {
            component: "transformer",
            environment: Environment::from_pairs([
                ("DDO_PRESET", preset.as_str()),
                ("DDO_BACKEND", backend),
            ]),
            ..Request::default()
        };
        let plan = resolve(&request).unwrap();
        for (key, _) in preset.values() {
            if let Some((field, _)) = ddo_policy::SETTING_KEYS.iter().find(|(_, k)| k == key) {
                assert_eq!(
                    plan.origins[*field].to_string(),
                    format!("preset {}", plan.effective_preset),
                    "{preset} {key}"
                );
            }
        }
    }
    assert!(bool::parse_text("1").unwrap());
}

#[test]
fn preset_listing() {
    insta::assert_snapshot!("preset_listing", format_presets());
}

#[test]
fn config_json_schema() {
    insta::assert_json_snapshot!("config_schema", config_schema());
}
