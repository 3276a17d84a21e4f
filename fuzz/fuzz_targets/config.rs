//! Configuration resolution never panics: any JSON object as arguments and as a config, any
//! `DDO_*` variables, any component name. Errors are fine; a panic is a finding.
#![no_main]

use ddo_policy::{ComponentPolicy, DynamicOffloadConfig, Environment, Origin, Request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(4, '\u{1e}');
    let (args, config, env, component) = (parts.next(), parts.next(), parts.next(), parts.next());
    let typed = |json: Option<&str>, origin| {
        let value: serde_json::Value = serde_json::from_str(json?).ok()?;
        DynamicOffloadConfig::from_json_value(&value, origin).ok()
    };
    let arguments = typed(args, Origin::Argument).unwrap_or_default();
    let config = typed(config, Origin::Config);
    let pairs = env.unwrap_or_default().lines().filter_map(|l| {
        let (k, v) = l.split_once('=')?;
        Some((format!("DDO_{k}"), v.to_owned()))
    });
    let request = Request {
        component: component.unwrap_or("transformer"),
        arguments,
        group: ComponentPolicy::default(),
        config,
        environment: Environment::from_pairs(pairs),
        running_on_wsl: data.first().is_some_and(|b| b & 1 == 1),
    };
    if let Ok(plan) = ddo_policy::resolve(&request) {
        let _ = plan.configuration();
    }
});
