//! Resolution: the route table, every preset, every precedence rule and every validation error.

use ddo_policy::{
    Backend, ComponentPolicy, ConfigError, DynamicOffloadConfig, Environment, GroupOffload,
    OffloadType, Origin, Placement, Plan, Preset, Request, Route, resolve,
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

// ---- the route table (DESIGN section 5) ----

#[test]
fn linear_auto_streams_the_transformer_with_the_linear_runtime() {
    let p = plan(&req("transformer"));
    assert_eq!(p.backend, Backend::Linear);
    assert_eq!(p.requested_preset, Preset::Auto);
    assert_eq!(p.effective_preset, Preset::OneShotFast);
    assert_eq!(p.route, Route::LinearRuntime);
}

#[test]
fn vmm_auto_is_the_native_fast_route() {
    let r = Request { arguments: args(|c| c.backend = Some("vmm".into())), ..req("transformer") };
    let p = plan(&r);
    assert_eq!(p.effective_preset, Preset::VmmFast);
    assert_eq!(p.route, Route::VmmFastRuntime);
    assert_eq!(p.settings.vmm_resident_weight_budget_gb, 4.0);
    assert_eq!(p.origins["vmm_resident_weight_budget_gb"], Origin::Preset("vmm_fast".into()));
}

#[test]
fn vmm_nvme_baseline_reads_from_disk() {
    let r = Request {
        arguments: args(|c| {
            c.backend = Some("vmm".into());
            c.preset = Some("nvme_baseline".into());
        }),
        ..req("transformer")
    };
    let p = plan(&r);
    assert_eq!(p.route, Route::VmmRuntime);
    assert_eq!(p.settings.load_safetensors_backend, ddo_policy::ReadBackend::Direct);
}

#[test]
fn a_native_preset_alone_selects_the_vmm_backend() {
    let r = Request { environment: env(&[("DDO_PRESET", "vmm_fast")]), ..req("transformer") };
    let p = plan(&r);
    assert_eq!(p.backend, Backend::Vmm);
    assert_eq!(p.route, Route::VmmFastRuntime);
}

#[test]
fn route_diffusers_group_offload_is_the_compatibility_route() {
    let r = Request { arguments: args(|c| c.route = Some("group".into())), ..req("transformer") };
    assert_eq!(
        plan(&r).route,
        Route::DiffusersGroupOffload(GroupOffload {
            offload_type: OffloadType::LeafLevel,
            use_stream: true,
            record_stream: false,
            low_cpu_mem_usage: true,
            num_blocks_per_group: 1,
        })
    );
}

#[test]
fn route_none_and_preset_off() {
    let r = Request { arguments: args(|c| c.route = Some("none".into())), ..req("transformer") };
    assert_eq!(plan(&r).route, Route::None { placement: Placement::Resident });
    let r = Request { environment: env(&[("DDO_PRESET", "off")]), ..req("transformer") };
    assert_eq!(plan(&r).route, Route::None { placement: Placement::Unmanaged });
}

#[test]
fn compat_presets_give_the_transformer_to_diffusers() {
    let block = Request {
        environment: env(&[("DDO_PRESET", "diffusers_offload_compat")]),
        ..req("transformer")
    };
    match plan(&block).route {
        Route::DiffusersGroupOffload(g) => {
            assert_eq!(g.offload_type, OffloadType::BlockLevel);
            assert!(g.use_stream && g.record_stream && g.low_cpu_mem_usage);
        }
        other => panic!("unexpected {other:?}"),
    }
    let leaf = Request {
        environment: env(&[("DDO_PRESET", "diffusers_leaf_offload_compat")]),
        ..req("transformer")
    };
    assert!(matches!(
        plan(&leaf).route,
        Route::DiffusersGroupOffload(GroupOffload { offload_type: OffloadType::LeafLevel, .. })
    ));
}

// ---- VAE and text-encoder defaults ----

#[test]
fn vae_defaults_follow_the_resolved_preset() {
    let leaf = Route::DiffusersGroupOffload(GroupOffload {
        offload_type: OffloadType::LeafLevel,
        use_stream: false,
        record_stream: false,
        low_cpu_mem_usage: false,
        num_blocks_per_group: 1,
    });
    let resident = Route::None { placement: Placement::Resident };
    let cases: &[(&[(&str, &str)], Route)] = &[
        (&[], leaf),
        (&[("DDO_PRESET", "one_shot_fast")], leaf),
        (&[("DDO_PRESET", "low_ram_safe")], leaf),
        (&[("DDO_BACKEND", "vmm")], leaf),
        (&[("DDO_PRESET", "warm_process")], resident),
        (&[("DDO_PRESET", "wsl_compat")], resident),
        (&[("DDO_PRESET", "nvme_baseline")], resident),
        (&[("DDO_PRESET", "off")], Route::None { placement: Placement::Unmanaged }),
        // No VAE rule: the generic auto rule (dynamic disabled) keeps it resident.
        (&[("DDO_PRESET", "diffusers_offload_compat")], resident),
    ];
    for (vars, want) in cases {
        let r = Request { environment: env(vars), ..req("vae") };
        assert_eq!(plan(&r).route, *want, "{vars:?}");
    }
}

#[test]
fn text_encoders_get_diffusers_leaf_offload_with_the_presets_stream() {
    for (preset, stream) in
        [("auto", true), ("wsl_compat", false), ("low_ram_safe", false), ("warm_process", true)]
    {
        for name in ["text_encoder", "text_encoder_2"] {
            let r = Request { environment: env(&[("DDO_PRESET", preset)]), ..req(name) };
            match plan(&r).route {
                Route::DiffusersGroupOffload(g) => {
                    assert_eq!(g.offload_type, OffloadType::LeafLevel);
                    assert_eq!(g.use_stream, stream, "{preset} {name}");
                }
                other => panic!("{preset} {name}: {other:?}"),
            }
        }
    }
}

#[test]
fn wsl_turns_off_pinning_and_group_streams_unless_explicit() {
    let r = Request { running_on_wsl: true, ..req("text_encoder") };
    let p = plan(&r);
    assert!(p.settings.pin_cpu_memory);
    assert!(!p.effective_pin_cpu_memory);
    assert!(matches!(
        p.route,
        Route::DiffusersGroupOffload(GroupOffload { use_stream: false, .. })
    ));
    let explicit = Request {
        running_on_wsl: true,
        group: ComponentPolicy { use_stream: Some(true), ..Default::default() },
        ..req("text_encoder")
    };
    assert!(matches!(
        plan(&explicit).route,
        Route::DiffusersGroupOffload(GroupOffload { use_stream: true, .. })
    ));
    let keep_pin = Request {
        running_on_wsl: true,
        environment: env(&[("DDO_DISABLE_PIN_ON_WSL", "0")]),
        ..req("transformer")
    };
    assert!(plan(&keep_pin).effective_pin_cpu_memory);
}

// ---- precedence, one rule per test ----

#[test]
fn explicit_argument_beats_explicit_config() {
    let r = Request {
        arguments: args(|c| c.prefetch_depth = Some(5)),
        config: Some(args(|c| c.prefetch_depth = Some(3))),
        ..req("transformer")
    };
    let p = plan(&r);
    assert_eq!(p.settings.prefetch_depth, 5);
    assert_eq!(p.origins["prefetch_depth"], Origin::Argument);
}

#[test]
fn explicit_config_beats_component_variables_and_global_variables() {
    let r = Request {
        config: Some(args(|c| c.prefetch_depth = Some(3))),
        environment: env(&[("DDO_TRANSFORMER_PREFETCH_DEPTH", "7"), ("DDO_PREFETCH_DEPTH", "9")]),
        ..req("transformer")
    };
    let p = plan(&r);
    assert_eq!(p.settings.prefetch_depth, 3);
    assert_eq!(p.origins["prefetch_depth"], Origin::Config);
}

#[test]
fn explicit_config_route_beats_component_policy() {
    let policy = ComponentPolicy { route: Some("none".into()), ..Default::default() };
    let r = Request {
        config: Some(args(|c| {
            c.route = Some("group".into());
            c.components.insert("transformer".into(), policy.clone());
        })),
        ..req("transformer")
    };
    assert_eq!(plan(&r).route.name(), "diffusers_group_offload");
}

#[test]
fn component_policy_beats_component_variable() {
    let policy = ComponentPolicy { route: Some("none".into()), ..Default::default() };
    let r = Request {
        config: Some(args(|c| {
            c.components.insert("transformer".into(), policy.clone());
        })),
        environment: env(&[("DDO_TRANSFORMER_ROUTE", "group")]),
        ..req("transformer")
    };
    let p = plan(&r);
    assert_eq!(p.route.name(), "none");
    assert_eq!(p.origins["route"], Origin::ComponentPolicy("transformer".into()));
}

#[test]
fn component_variable_beats_runner_variable_and_global_variable() {
    let r = Request {
        environment: env(&[
            ("DDO_TRANSFORMER_ROUTE", "none"),
            ("DDO_RUNNER_TRANSFORMER_ROUTE", "group"),
            ("DDO_TRANSFORMER_PREFETCH_DEPTH", "7"),
            ("DDO_PREFETCH_DEPTH", "9"),
        ]),
        ..req("transformer")
    };
    let p = plan(&r);
    assert_eq!(p.route.name(), "none");
    assert_eq!(p.origins["route"], Origin::ComponentEnv("DDO_TRANSFORMER_ROUTE".into()));
    assert_eq!(p.settings.prefetch_depth, 7);
    assert_eq!(
        p.origins["prefetch_depth"],
        Origin::ComponentEnv("DDO_TRANSFORMER_PREFETCH_DEPTH".into())
    );
    // The component variable of another component does not apply.
    let other =
        Request { environment: env(&[("DDO_VAE_PREFETCH_DEPTH", "7")]), ..req("transformer") };
    assert_eq!(
        plan(&other).settings.prefetch_depth,
        plan(&req("transformer")).settings.prefetch_depth
    );
}

#[test]
fn global_variable_beats_preset_value() {
    let r = Request { environment: env(&[("DDO_PIN_CPU_MEMORY", "0")]), ..req("transformer") };
    let p = plan(&r);
    assert!(!p.settings.pin_cpu_memory);
    assert_eq!(p.origins["pin_cpu_memory"], Origin::Env("DDO_PIN_CPU_MEMORY".into()));
}

#[test]
fn preset_value_beats_default() {
    let p = plan(&req("transformer"));
    assert!(p.settings.pin_cpu_memory);
    assert_eq!(p.origins["pin_cpu_memory"], Origin::Preset("one_shot_fast".into()));
    assert!(!p.settings.verbose);
    assert_eq!(p.origins["verbose"], Origin::Default);
}

#[test]
fn variable_aliases_are_read() {
    let r =
        Request { environment: env(&[("DDO_SAFETENSORS_BACKEND", "pread")]), ..req("transformer") };
    assert_eq!(plan(&r).settings.load_safetensors_backend, ddo_policy::ReadBackend::Pread);
}

#[test]
fn an_explicit_route_is_never_replaced_by_the_vae_default() {
    let r = Request { arguments: args(|c| c.route = Some("dynamic".into())), ..req("vae") };
    assert_eq!(plan(&r).route, Route::LinearRuntime);
    let r = Request {
        arguments: args(|c| c.route = Some("none".into())),
        environment: env(&[("DDO_PRESET", "off")]),
        ..req("vae")
    };
    assert_eq!(plan(&r).route, Route::None { placement: Placement::Resident });
}

#[test]
fn an_explicit_config_is_never_replaced_by_the_vae_default() {
    // With a config, the VAE rule is skipped and the generic auto rule streams it.
    let r = Request { config: Some(args(|c| c.pin_cpu_memory = Some(true))), ..req("vae") };
    assert_eq!(plan(&r).route, Route::LinearRuntime);
    // Explicit overrides too.
    let r = Request { arguments: args(|c| c.prefetch_depth = Some(1)), ..req("vae") };
    assert_eq!(plan(&r).route, Route::LinearRuntime);
}

#[test]
fn explicit_dynamic_under_preset_off_runs_the_linear_runtime() {
    let r = Request {
        group: ComponentPolicy { dynamic_offload: Some(true), ..Default::default() },
        environment: env(&[("DDO_PRESET", "off")]),
        ..req("transformer")
    };
    assert_eq!(plan(&r).route, Route::LinearRuntime);
}

#[test]
fn empty_environment_means_presets_and_defaults_only() {
    let with_env = Request { environment: env(&[("DDO_PRESET", "off")]), ..req("transformer") };
    let without = req("transformer");
    assert_eq!(plan(&with_env).effective_preset, Preset::Off);
    assert_eq!(plan(&without).effective_preset, Preset::OneShotFast);
}

// ---- validation errors (the message is the contract) ----

#[test]
fn unknown_preset_lists_the_valid_ones() {
    let r = Request { arguments: args(|c| c.preset = Some("turbo".into())), ..req("transformer") };
    assert_eq!(
        err(&r),
        "unknown preset \"turbo\" (from argument); valid presets: auto, one_shot_fast, low_ram_safe, wsl_compat, warm_process, nvme_baseline, vmm_fast, off, diffusers_offload_compat, diffusers_leaf_offload_compat"
    );
}

#[test]
fn unknown_backend_and_route() {
    let r = Request { environment: env(&[("DDO_BACKEND", "rocm")]), ..req("transformer") };
    assert_eq!(err(&r), "backend = \"rocm\" (from DDO_BACKEND) is not valid; allowed: linear, vmm");
    let r = Request { environment: env(&[("DDO_VAE_ROUTE", "tiled")]), ..req("vae") };
    assert_eq!(
        err(&r),
        "route = \"tiled\" (from DDO_VAE_ROUTE) is not valid; allowed: auto, dynamic_offload, linear_convolution, diffusers_group_offload, none"
    );
}

#[test]
fn vmm_backend_refuses_linear_presets_and_linear_refuses_native_ones() {
    let r = Request {
        arguments: args(|c| {
            c.backend = Some("vmm".into());
            c.preset = Some("low_ram_safe".into());
        }),
        ..req("transformer")
    };
    assert_eq!(
        err(&r),
        "backend vmm does not accept preset \"low_ram_safe\"; backend vmm accepts: auto, nvme_baseline, vmm_fast (use --ddo-backend linear for preset low_ram_safe)"
    );
    let r = Request {
        arguments: args(|c| {
            c.backend = Some("linear".into());
            c.preset = Some("vmm_fast".into());
        }),
        ..req("transformer")
    };
    assert_eq!(
        err(&r),
        "backend linear does not accept preset \"vmm_fast\"; backend linear accepts: auto, one_shot_fast, low_ram_safe, wsl_compat, warm_process, off, diffusers_offload_compat, diffusers_leaf_offload_compat (preset vmm_fast needs --ddo-backend vmm)"
    );
}

#[test]
fn negative_nan_and_infinite_sizes() {
    let r =
        Request { arguments: args(|c| c.vmm_source_cache_gb = Some(-1.0)), ..req("transformer") };
    assert_eq!(
        err(&r),
        "vmm_source_cache_gb = -1 (from argument) must be a finite number >= 0 (GiB)"
    );
    let r = Request {
        config: Some(args(|c| c.resident_module_budget_gb = Some(f64::NAN))),
        ..req("transformer")
    };
    assert_eq!(
        err(&r),
        "resident_module_budget_gb = NaN (from config) must be a finite number >= 0 (GiB)"
    );
    let r = Request {
        environment: env(&[("DDO_SYSTEM_RAM_HEADROOM_GB", "inf")]),
        ..req("transformer")
    };
    assert_eq!(
        err(&r),
        "system_ram_headroom_gb = inf (from DDO_SYSTEM_RAM_HEADROOM_GB) must be a finite number >= 0 (GiB)"
    );
    // Extreme magnitudes are written in exponent form, not as hundreds of digits.
    let r = Request {
        arguments: args(|c| c.vmm_source_cache_gb = Some(-1e-300)),
        ..req("transformer")
    };
    assert_eq!(
        err(&r),
        "vmm_source_cache_gb = -1e-300 (from argument) must be a finite number >= 0 (GiB)"
    );
    let r = Request {
        arguments: args(|c| c.vmm_source_registered_gb = Some(1e-300)),
        ..req("transformer")
    };
    assert!(
        err(&r).starts_with("vmm_source_registered_gb = 1e-300 (from argument) exceeds"),
        "{}",
        err(&r)
    );
    let r =
        Request { arguments: args(|c| c.vmm_source_cache_gb = Some(1e300)), ..req("transformer") };
    assert_eq!(
        err(&r),
        "vmm_source_cache_gb = 1e300 (from argument) is out of range; allowed: 0 to 32 GiB"
    );
}

#[test]
fn a_size_past_64_bits_of_bytes_names_its_origin() {
    let r = Request {
        arguments: args(|c| c.vmm_resident_weight_budget_gb = Some(2e10)),
        ..req("transformer")
    };
    assert_eq!(
        err(&r),
        "vmm_resident_weight_budget_gb = 20000000000 (from argument) is out of range; allowed: 0 to below 17179869184 GiB (a 64-bit byte count)"
    );
    let r = Request {
        environment: env(&[("DDO_SYSTEM_RAM_HEADROOM_GB", "1e300")]),
        ..req("transformer")
    };
    assert_eq!(
        err(&r),
        "system_ram_headroom_gb = 1e300 (from DDO_SYSTEM_RAM_HEADROOM_GB) is out of range; allowed: 0 to below 17179869184 GiB (a 64-bit byte count)"
    );
    // A setting with a range of its own names that range, however large the value.
    let r =
        Request { arguments: args(|c| c.vmm_source_cache_gb = Some(1e11)), ..req("transformer") };
    assert_eq!(
        err(&r),
        "vmm_source_cache_gb = 100000000000 (from argument) is out of range; allowed: 0 to 32 GiB"
    );
}

#[test]
fn ranges() {
    let r =
        Request { arguments: args(|c| c.vmm_source_cache_gb = Some(40.0)), ..req("transformer") };
    assert_eq!(
        err(&r),
        "vmm_source_cache_gb = 40 (from argument) is out of range; allowed: 0 to 32 GiB"
    );
    let r = Request { environment: env(&[("DDO_PREFETCH_DEPTH", "99")]), ..req("transformer") };
    assert_eq!(
        err(&r),
        "prefetch_depth = 99 (from DDO_PREFETCH_DEPTH) is out of range; allowed: 0 to 16 units"
    );
    let r = Request { arguments: args(|c| c.pin_cpu_workers = Some(0)), ..req("transformer") };
    assert_eq!(
        err(&r),
        "pin_cpu_workers = 0 (from argument) is out of range; allowed: 1 to 64 threads"
    );
    let r = Request {
        group: ComponentPolicy { num_blocks_per_group: Some(0), ..Default::default() },
        arguments: args(|c| c.route = Some("group".into())),
        ..req("transformer")
    };
    assert_eq!(
        err(&r),
        "num_blocks_per_group = 0 (from argument) is out of range; allowed: 1 or more"
    );
}

#[test]
fn registration_larger_than_storage() {
    let r = Request {
        arguments: args(|c| {
            c.vmm_source_cache_gb = Some(2.0);
            c.vmm_source_registered_gb = Some(3.0);
        }),
        ..req("transformer")
    };
    assert_eq!(
        err(&r),
        "vmm_source_registered_gb = 3 (from argument) exceeds vmm_source_cache_gb = 2: registration must fit the retained storage; lower vmm_source_registered_gb, raise vmm_source_cache_gb, or set vmm_source_registered_gb to 0 (same as storage)"
    );
}

#[test]
fn registration_in_whole_segments() {
    let r = Request {
        arguments: args(|c| {
            c.vmm_source_cache_gb = Some(8.0);
            c.vmm_source_registered_gb = Some(1.1);
        }),
        ..req("transformer")
    };
    assert_eq!(
        err(&r),
        "vmm_source_registered_gb = 1.1 (from argument) is not a whole number of 64 MiB segments; use a multiple of 0.0625 GiB (for example 1.0625)"
    );
    let ok = Request {
        arguments: args(|c| {
            c.vmm_source_cache_gb = Some(8.0);
            c.vmm_source_registered_gb = Some(1.0625);
        }),
        ..req("transformer")
    };
    assert_eq!(plan(&ok).settings.vmm_source_registered_gb, 1.0625);
    // 0 means "same as storage" and is always accepted.
    let zero =
        Request { arguments: args(|c| c.vmm_source_cache_gb = Some(8.0)), ..req("transformer") };
    assert_eq!(plan(&zero).settings.vmm_source_registered_gb, 0.0);
}

#[test]
fn unparsable_variables_name_the_variable() {
    let cases = [
        (
            "DDO_PIN_CPU_MEMORY",
            "maybe",
            "environment variable DDO_PIN_CPU_MEMORY=\"maybe\" is not a boolean (1/0, true/false, yes/no, on/off)",
        ),
        (
            "DDO_PIN_CPU_WORKERS",
            "-2",
            "environment variable DDO_PIN_CPU_WORKERS=\"-2\" is not a whole number >= 0",
        ),
        (
            "DDO_VMM_SOURCE_CACHE_GB",
            "lots",
            "environment variable DDO_VMM_SOURCE_CACHE_GB=\"lots\" is not a number",
        ),
        (
            "DDO_LOAD_SAFETENSORS_BACKEND",
            "random",
            "environment variable DDO_LOAD_SAFETENSORS_BACKEND=\"random\" is not one of: auto, mmap, pread, direct",
        ),
        (
            "DDO_TRANSFORMER_OFFLOAD_STREAM",
            "2",
            "environment variable DDO_TRANSFORMER_OFFLOAD_STREAM=\"2\" is not a boolean (1/0, true/false, yes/no, on/off)",
        ),
    ];
    for (var, value, message) in cases {
        let r = Request {
            environment: env(&[(var, value), ("DDO_TRANSFORMER_GROUP_OFFLOAD", "1")]),
            ..req("transformer")
        };
        assert_eq!(err(&r), message);
    }
}

#[test]
fn native_routes_need_a_budget() {
    let r = Request {
        arguments: args(|c| {
            c.backend = Some("vmm".into());
            c.vmm_resident_weight_budget_gb = Some(0.0);
        }),
        ..req("transformer")
    };
    assert_eq!(
        err(&r),
        "route vmm_fast_runtime needs vmm_resident_weight_budget_gb > 0 (it is 0, from argument); set a GPU budget in GiB"
    );
}

#[test]
fn execution_device_accepts_cuda_cuda_n_and_cpu() {
    for device in ["cuda", "cuda:0", "cuda:3", "cpu"] {
        let r = Request {
            arguments: args(|c| c.execution_device = Some(device.into())),
            ..req("transformer")
        };
        assert_eq!(plan(&r).settings.execution_device, device);
    }
    let r = Request { arguments: args(|c| c.execution_device = Some("abc".into())), ..req("vae") };
    assert_eq!(
        err(&r),
        "execution_device = \"abc\" (from argument) is not valid; allowed: cuda, cuda:N, cpu"
    );
    let r =
        Request { environment: env(&[("DDO_EXECUTION_DEVICE", "cuda:x")]), ..req("transformer") };
    assert_eq!(
        err(&r),
        "execution_device = \"cuda:x\" (from DDO_EXECUTION_DEVICE) is not valid; allowed: cuda, cuda:N, cpu"
    );
    let r = Request {
        config: Some(args(|c| c.execution_device = Some("cpu:0".into()))),
        ..req("transformer")
    };
    assert_eq!(
        err(&r),
        "execution_device = \"cpu:0\" (from config) is not valid; allowed: cuda, cuda:N, cpu"
    );
}

#[test]
fn the_plan_says_whether_the_execution_device_is_the_default() {
    let p = plan(&req("transformer"));
    assert_eq!(p.settings.execution_device, "cuda:0");
    assert!(p.execution_device_is_default);
    // Set to the default's own value, it is still the user's choice.
    let r = Request {
        arguments: args(|c| c.execution_device = Some("cuda:0".into())),
        ..req("transformer")
    };
    assert!(!plan(&r).execution_device_is_default);
    let r = Request {
        environment: env(&[("DDO_TRANSFORMER_EXECUTION_DEVICE", "cpu")]),
        ..req("transformer")
    };
    let p = plan(&r);
    assert_eq!(p.settings.execution_device, "cpu");
    assert!(!p.execution_device_is_default);
    let json = serde_json::to_value(&p).unwrap();
    assert_eq!(json["execution_device_is_default"], false);
}

#[test]
fn module_patterns_must_be_valid_regular_expressions() {
    let r = Request {
        arguments: args(|c| {
            c.vmm_module_pattern = Some(r"transformer_blocks\.\d+".into());
            c.always_resident_modules_pattern =
                Some(vec![r"(^|\.)proj_out$".into(), "norm_out".into()]);
        }),
        ..req("transformer")
    };
    let p = plan(&r);
    assert_eq!(p.settings.always_resident_modules_pattern.len(), 2);
    let r = Request {
        arguments: args(|c| c.vmm_module_pattern = Some("(abc".into())),
        ..req("transformer")
    };
    assert_eq!(
        err(&r),
        "vmm_module_pattern = \"(abc\" (from argument) is not a valid regular expression: unclosed group"
    );
    let r = Request {
        environment: env(&[("DDO_ALWAYS_RESIDENT_MODULE_PATTERNS", "norm_out;[a-")]),
        ..req("transformer")
    };
    assert_eq!(
        err(&r),
        "always_resident_modules_pattern = \"[a-\" (from DDO_ALWAYS_RESIDENT_MODULE_PATTERNS) is not a valid regular expression: unclosed character class"
    );
    let r = Request {
        config: Some(args(|c| c.vmm_module_pattern = Some("blocks(?=\\.)".into()))),
        ..req("transformer")
    };
    assert_eq!(
        err(&r),
        "vmm_module_pattern = \"blocks(?=\\\\.)\" (from config) is not a valid regular expression: look-around, including look-ahead and look-behind, is not supported"
    );
}

#[test]
fn nothing_is_always_resident_by_default() {
    for preset in Preset::ALL {
        let r =
            Request { environment: env(&[("DDO_PRESET", preset.as_str())]), ..req("transformer") };
        let p = plan(&r);
        assert!(p.settings.always_resident_modules_pattern.is_empty(), "{preset}");
        assert_eq!(p.origins["always_resident_modules_pattern"], Origin::Default, "{preset}");
    }
}

#[test]
fn unknown_config_fields_are_refused() {
    let e = serde_json::from_str::<DynamicOffloadConfig>(r#"{"prefetch_dept": 2}"#).unwrap_err();
    assert!(e.to_string().starts_with("unknown field `prefetch_dept`, expected one of"), "{e}");
}

#[test]
fn config_error_is_a_closed_enum_with_origins() {
    let r = Request { environment: env(&[("DDO_PRESET", "x")]), ..req("transformer") };
    assert!(matches!(resolve(&r), Err(ConfigError::UnknownPreset { origin: Origin::Env(_), .. })));
}

#[test]
fn typed_configs_from_json_name_the_field_of_a_bad_value() {
    use ddo_policy::{ConfigError, DynamicOffloadConfig, Origin, Request, resolve};
    let parse = |text: &str, origin| {
        DynamicOffloadConfig::from_json_value(&serde_json::from_str(text).unwrap(), origin)
    };
    let err = parse(r#"{"prefetch_depth": 1.5}"#, Origin::Argument).unwrap_err();
    assert_eq!(
        err.to_string(),
        "prefetch_depth = \"1.5\" (from argument) is not valid; allowed: a whole number >= 0"
    );
    let err = parse(r#"{"prefetch_dept": 2}"#, Origin::Config).unwrap_err();
    assert!(matches!(err, ConfigError::UnknownField { .. }), "{err}");
    assert!(err.to_string().starts_with("prefetch_dept (from config) is not a ddo setting"));
    // Text is parsed as the variable would be, so NaN reaches validation with its origin.
    let config =
        parse(r#"{"vmm_source_cache_gb": "nan", "pin_cpu_memory": "on"}"#, Origin::Config).unwrap();
    assert_eq!(config.pin_cpu_memory, Some(true));
    let request = Request { component: "transformer", config: Some(config), ..Request::default() };
    let err = resolve(&request).unwrap_err().to_string();
    assert!(err.starts_with("vmm_source_cache_gb = NaN (from config)"), "{err}");
    let typed = parse(
        r#"{"backend": "vmm", "prefetch_depth": 3, "components": {"vae": {"route": "none"}}}"#,
        Origin::Argument,
    )
    .unwrap();
    assert_eq!(typed.prefetch_depth, Some(3));
    assert_eq!(typed.components["vae"].route.as_deref(), Some("none"));
}

// ---- the automatic budget ----

#[test]
fn the_automatic_budget_is_refused_on_every_arena_route_but_the_native_one() {
    let balanced = |backend: &str| Request {
        arguments: args(|c| {
            c.backend = Some(backend.into());
            c.auto_budget_policy = Some(ddo_policy::AutoBudgetPolicy::Balanced);
        }),
        ..req("transformer")
    };
    let p = plan(&balanced("vmm"));
    let auto = ddo_policy::auto_budget::AutoBudget::for_plan(&p).expect("balanced");
    assert_eq!(auto.headroom_bytes(), 1 << 30);
    let e = err(&balanced("linear"));
    assert!(e.contains("takes route linear_runtime: use backend vmm"), "{e}");
    // A route ddo does not stream has no arena to size: nothing to refuse.
    let group = Request {
        group: ComponentPolicy {
            route: Some("diffusers_group_offload".into()),
            ..Default::default()
        },
        ..balanced("linear")
    };
    assert!(ddo_policy::auto_budget::AutoBudget::for_plan(&plan(&group)).is_some());
    assert!(ddo_policy::auto_budget::AutoBudget::for_plan(&plan(&req("transformer"))).is_none());
}

#[test]
fn only_a_whole_mapping_of_the_checkpoint_reads_ahead() {
    let native = |f: fn(&mut DynamicOffloadConfig)| Request {
        arguments: args(|c| {
            c.backend = Some("vmm".into());
            f(c);
        }),
        ..req("transformer")
    };
    assert!(plan(&native(|_| {})).reads_ahead());
    assert!(!plan(&native(|c| c.vmm_source_cache_gb = Some(2.0))).reads_ahead());
    assert!(
        !plan(&native(|c| c.load_safetensors_backend = Some(ddo_policy::ReadBackend::Direct)))
            .reads_ahead()
    );
    assert!(
        !plan(&native(|c| c.vmm_weight_encoding = Some(ddo_policy::WeightEncoding::On)))
            .reads_ahead()
    );
    assert!(!plan(&native(|c| c.preset = Some("nvme_baseline".into()))).reads_ahead());
    assert!(!plan(&req("transformer")).reads_ahead());
}
