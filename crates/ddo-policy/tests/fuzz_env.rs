//! Arbitrary variable values never panic: resolution answers with a plan or an error.

use ddo_policy::{Environment, Request, SETTING_KEYS, resolve};
use proptest::prelude::*;

fn var() -> impl Strategy<Value = String> {
    let mut names: Vec<String> = SETTING_KEYS.iter().map(|(_, k)| format!("DDO_{k}")).collect();
    names.extend(
        [
            "DDO_PRESET",
            "DDO_BACKEND",
            "DDO_VAE_ROUTE",
            "DDO_VAE_OFFLOAD_STREAM",
            "DDO_VAE_NUM_BLOCKS_PER_GROUP",
            "DDO_PREFETCH_DEPT",
            "DDO_",
            "DDO_vae_ROUTE",
        ]
        .map(String::from),
    );
    proptest::sample::select(names)
}

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("auto".to_owned()),
        Just("vmm".to_owned()),
        Just("nvme_baseline".to_owned()),
        Just("1".to_owned()),
        Just("-1".to_owned()),
        Just("NaN".to_owned()),
        Just("0.0625".to_owned()),
        Just("block_level".to_owned()),
        "\\PC{0,12}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    #[test]
    fn resolution_never_panics(pairs in proptest::collection::vec((var(), value()), 0..6), wsl: bool) {
        for component in ["transformer", "vae", "text_encoder", ""] {
            let request = Request {
                component,
                environment: Environment::from_pairs(pairs.clone()),
                running_on_wsl: wsl,
                ..Request::default()
            };
            match resolve(&request) {
                Ok(plan) => prop_assert!(plan.settings.prefetch_depth <= ddo_policy::MAX_PREFETCH_DEPTH),
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
        }
    }
}
