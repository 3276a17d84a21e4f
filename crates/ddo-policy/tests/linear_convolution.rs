//! Route `linear_convolution`: how it is asked for, the configuration it brings, and what it
//! refuses at resolution.

use ddo_policy::{
    ComponentPolicy, DynamicOffloadConfig, Environment, ExecutionMode, Origin, Plan, Request,
    Route, RouteChoice, resolve,
};

fn req(component: &str) -> Request<'_> {
    Request { component, ..Request::default() }
}

fn env(pairs: &[(&str, &str)]) -> Environment {
    Environment::from_pairs(pairs.iter().copied())
}

fn args(f: impl FnOnce(&mut DynamicOffloadConfig)) -> DynamicOffloadConfig {
    let mut c = DynamicOffloadConfig::default();
    f(&mut c);
    c
}

fn plan(r: &Request<'_>) -> Plan {
    resolve(r).unwrap_or_else(|e| panic!("resolution failed: {e}"))
}

fn err(r: &Request<'_>) -> String {
    resolve(r).expect_err("resolution should fail").to_string()
}

#[test]
fn the_route_parses_and_is_listed() {
    assert_eq!(
        RouteChoice::parse("linear_convolution", Origin::Argument),
        Ok(RouteChoice::LinearConvolution)
    );
    assert!(RouteChoice::allowed().contains("dynamic_offload, linear_convolution,"));
    assert_eq!(Route::LinearConvolution.name(), "linear_convolution");
    assert!(Route::LinearConvolution.is_dynamic() && !Route::LinearConvolution.is_native());
}

#[test]
fn without_a_config_the_route_brings_the_published_one() {
    let r =
        Request { arguments: args(|c| c.route = Some("linear_convolution".into())), ..req("vae") };
    let p = plan(&r);
    assert_eq!(p.route, Route::LinearConvolution);
    assert_eq!(p.execution_mode, ExecutionMode::LinearRuntime);
    let s = &p.settings;
    assert!(s.linear_convolution_offload && s.pin_cpu_memory && !s.cache_pinned_weights);
    assert_eq!(s.resident_module_budget_gb, 0.0);
    assert_eq!(s.small_tensor_threshold_kb, 16);
    let route = Origin::Route("linear_convolution".into());
    for field in ["linear_convolution_offload", "pin_cpu_memory", "small_tensor_threshold_kb"] {
        assert_eq!(p.origins[field], route, "{field}");
    }
    assert_eq!(route.to_string(), "route linear_convolution");
    assert!(p.effective_pin_cpu_memory);
    assert_eq!(p.configuration()["dynamic_offload_route"], "linear_convolution");
}

#[test]
fn the_routes_configuration_sits_below_arguments_and_above_variables() {
    let r = Request {
        arguments: args(|c| {
            c.route = Some("linear_convolution".into());
            c.small_tensor_threshold_kb = Some(4);
        }),
        environment: env(&[("DDO_PIN_CPU_MEMORY", "0"), ("DDO_RESIDENT_MODULE_BUDGET_GB", "2")]),
        ..req("vae")
    };
    let s = plan(&r).settings;
    assert_eq!(s.small_tensor_threshold_kb, 4);
    assert!(s.pin_cpu_memory);
    assert_eq!(s.resident_module_budget_gb, 0.0);
}

#[test]
fn the_component_variable_and_policy_select_it() {
    let r = Request { environment: env(&[("DDO_VAE_ROUTE", "linear_convolution")]), ..req("vae") };
    let p = plan(&r);
    assert_eq!(p.route, Route::LinearConvolution);
    assert_eq!(p.origins["route"], Origin::ComponentEnv("DDO_VAE_ROUTE".into()));
    // The other components keep their routes.
    let r = Request {
        environment: env(&[("DDO_VAE_ROUTE", "linear_convolution")]),
        ..req("transformer")
    };
    assert_eq!(plan(&r).route, Route::LinearRuntime);
    let mut arguments = DynamicOffloadConfig::default();
    arguments.components.insert(
        "vae".into(),
        ComponentPolicy { route: Some("linear_convolution".into()), ..ComponentPolicy::default() },
    );
    assert_eq!(plan(&Request { arguments, ..req("vae") }).route, Route::LinearConvolution);
}

#[test]
fn the_route_runs_the_linear_runtime_beside_native_components() {
    let r = Request {
        arguments: args(|c| {
            c.backend = Some("vmm".into());
            c.vmm_resident_weight_budget_gb = Some(2.0);
        }),
        environment: env(&[("DDO_VAE_ROUTE", "linear_convolution")]),
        ..req("vae")
    };
    let p = plan(&r);
    assert_eq!(p.route, Route::LinearConvolution);
    assert_eq!(p.execution_mode, ExecutionMode::LinearRuntime);
}

#[test]
fn a_config_with_convolution_offload_streams_layers_on_the_linear_runtime() {
    let config = args(|c| c.linear_convolution_offload = Some(true));
    let p = plan(&Request { config: Some(config.clone()), ..req("vae") });
    assert_eq!(p.route, Route::LinearConvolution);
    // The config is the caller's: the route's own configuration does not apply.
    assert_eq!(p.settings.small_tensor_threshold_kb, 1024);
    assert!(!p.origins.values().any(|o| matches!(o, Origin::Route(_))));
    let with_route = DynamicOffloadConfig { route: Some("linear_convolution".into()), ..config };
    assert_eq!(
        plan(&Request { config: Some(with_route), ..req("vae") }).route,
        Route::LinearConvolution
    );
    // Routes that do not run ddo's runtime ignore the setting.
    let r = Request {
        arguments: args(|c| {
            c.route = Some("none".into());
            c.linear_convolution_offload = Some(true);
        }),
        ..req("vae")
    };
    assert!(matches!(plan(&r).route, Route::None { .. }));
}

#[test]
fn an_explicit_config_must_itself_ask_for_convolution_offload() {
    let config = args(|c| c.pin_cpu_memory = Some(true));
    let r = Request {
        arguments: args(|c| c.route = Some("linear_convolution".into())),
        config: Some(config.clone()),
        environment: env(&[("DDO_LINEAR_CONVOLUTION_OFFLOAD", "1")]),
        ..req("vae")
    };
    assert_eq!(
        err(&r),
        "route linear_convolution (from argument) with an explicit config: the config must itself set \
         linear_convolution_offload=True (it comes from DDO_LINEAR_CONVOLUTION_OFFLOAD); add it to the config (or \
         name the route in it: route, or its policy for this component), or pass no config to use the route's own \
         (registered host tensors, no resident units, small_tensor_threshold_kb 16)"
    );
    // An argument beside the config counts as explicit.
    let r = Request {
        arguments: args(|c| {
            c.route = Some("linear_convolution".into());
            c.linear_convolution_offload = Some(true);
        }),
        config: Some(config),
        ..req("vae")
    };
    assert_eq!(plan(&r).route, Route::LinearConvolution);
}

#[test]
fn a_pipeline_config_naming_the_route_for_its_vae_streams_it_beside_native_components() {
    let mut config = args(|c| {
        c.backend = Some("vmm".into());
        c.vmm_resident_weight_budget_gb = Some(2.0);
    });
    config.components.insert(
        "vae".into(),
        ComponentPolicy { route: Some("linear_convolution".into()), ..ComponentPolicy::default() },
    );
    let p = plan(&Request { config: Some(config.clone()), ..req("vae") });
    assert_eq!(p.route, Route::LinearConvolution);
    assert_eq!(p.origins["linear_convolution_offload"], Origin::Route("linear_convolution".into()));
    // The config's own settings stand: the route's defaults do not replace them.
    assert_eq!(p.origins["pin_cpu_memory"], Origin::Default);
    assert_eq!(
        plan(&Request { config: Some(config), ..req("transformer") }).route,
        Route::VmmFastRuntime
    );
}

#[test]
fn turning_convolution_offload_off_contradicts_the_route() {
    let r = Request {
        arguments: args(|c| {
            c.route = Some("linear_convolution".into());
            c.linear_convolution_offload = Some(false);
        }),
        ..req("vae")
    };
    assert_eq!(
        err(&r),
        "route linear_convolution (from argument) streams convolution layers, but linear_convolution_offload = \
         false (from argument); drop that setting or choose another route"
    );
}

#[test]
fn convolution_offload_outside_the_linear_runtime_is_refused() {
    let r = Request {
        arguments: args(|c| {
            c.backend = Some("vmm".into());
            c.vmm_resident_weight_budget_gb = Some(2.0);
        }),
        config: Some(args(|c| c.linear_convolution_offload = Some(true))),
        ..req("vae")
    };
    assert_eq!(
        err(&r),
        "linear_convolution_offload = true (from config) streams layers on the linear runtime, but this component \
         resolves to route vmm_fast_runtime (execution mode vmm_fast_runtime): use backend linear, give only this \
         component route linear_convolution (DDO_VAE_ROUTE=linear_convolution), or leave linear_convolution_offload \
         false"
    );
    let r = Request {
        environment: env(&[("DDO_PRESET", "vmm_fast"), ("DDO_LINEAR_CONVOLUTION_OFFLOAD", "true")]),
        ..req("transformer")
    };
    assert!(
        err(&r)
            .starts_with("linear_convolution_offload = true (from DDO_LINEAR_CONVOLUTION_OFFLOAD)")
    );
}
