//! Resolution: from what the user, the environment and the preset say, to one [`Plan`] per
//! component.
//!
//! Precedence, highest first:
//! 1. explicit arguments ([`Request::arguments`], [`Request::group`]);
//! 2. the explicit configuration ([`Request::config`]); without one, route `linear_convolution`
//!    brings its own (the published library's defaults for that route);
//! 3. the per-component policy (`components[name]` of the arguments, then of the config);
//! 4. `DDO_<COMPONENT>_*` variables (then `DDO_RUNNER_<COMPONENT>_*` for component keys);
//! 5. `DDO_*` variables;
//! 6. the resolved preset's values (and, for a component named `vae`, the preset's VAE rule);
//! 7. defaults.
//!
//! A preset's component default never replaces an explicit route or configuration: when the
//! request carries a config, any argument, or an explicit group/dynamic choice, the VAE rule is
//! skipped.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::config::{ENV_ALIASES, parse_setting};
use crate::env::component_env_name;
use crate::preset::{Backend, ExecutionMode, Preset, VaeDefault, resolve_backend};
use crate::route::{GroupOffload, LAYER_ROUTE_RESIDENT_KIB, Placement, Route, RouteChoice};
use crate::value::{AutoBudgetPolicy, OffloadType, ReadBackend, SettingValue, WeightEncoding};
use crate::variables::{COMPONENT_KEYS, unknown_variable_warnings};
use crate::{ComponentPolicy, ConfigError, DynamicOffloadConfig, Environment, Origin, Settings};

/// Everything resolution needs for one component.
#[derive(Debug, Clone, Default)]
pub struct Request<'a> {
    /// The component's name (`transformer`, `vae`, `text_encoder`; empty = `model`).
    pub component: &'a str,
    /// Explicit arguments (keyword arguments, CLI flags).
    pub arguments: DynamicOffloadConfig,
    /// Explicit component arguments (`route` lives in `arguments.route`).
    pub group: ComponentPolicy,
    /// The explicit configuration object, if the caller passed one.
    pub config: Option<DynamicOffloadConfig>,
    /// The environment (the process's, or an injected map; empty to ignore it).
    pub environment: Environment,
    /// Whether the process runs on WSL.
    pub running_on_wsl: bool,
}

/// The resolved plan of one component: route, backend, preset and every setting with its origin.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// The component.
    pub component: String,
    /// The backend.
    pub backend: Backend,
    /// The preset as requested.
    pub requested_preset: Preset,
    /// The preset after backend resolution (`auto` resolved).
    pub effective_preset: Preset,
    /// The execution mode of the effective preset.
    pub execution_mode: ExecutionMode,
    /// What ddo does with the component.
    pub route: Route,
    /// Every setting, decided.
    pub settings: Settings,
    /// Where each setting and route key came from.
    pub origins: BTreeMap<String, Origin>,
    /// Whether the process runs on WSL.
    pub running_on_wsl: bool,
    /// Whether weights are pinned after the WSL rule.
    pub effective_pin_cpu_memory: bool,
    /// Whether `execution_device` is the default (no argument, config, variable or preset set
    /// it): a host may then run on `cpu` when the machine has no CUDA device.
    pub execution_device_is_default: bool,
    /// What the host should log and report: one line per `DDO_*` variable of the environment
    /// that ddo does not read, with the closest name it does read when one is near.
    pub warnings: Vec<String>,
}

impl Plan {
    /// The configuration section of metrics: `dynamic_offload_<setting>` for every setting, plus
    /// the preset, backend, mode and route keys.
    pub fn configuration(&self) -> BTreeMap<String, serde_json::Value> {
        let mut out: BTreeMap<String, serde_json::Value> = self
            .settings
            .to_json_pairs()
            .into_iter()
            .map(|(k, v)| (format!("dynamic_offload_{k}"), v))
            .collect();
        let extra = [
            ("dynamic_offload_component", self.component.clone().into()),
            ("dynamic_offload_backend", self.backend.as_str().into()),
            ("dynamic_offload_requested_preset", self.requested_preset.as_str().into()),
            ("dynamic_offload_effective_preset", self.effective_preset.as_str().into()),
            ("dynamic_offload_execution_mode", self.execution_mode.as_str().into()),
            ("dynamic_offload_route", self.route.name().into()),
            ("dynamic_offload_running_on_wsl", self.running_on_wsl.into()),
            ("dynamic_offload_effective_pin_cpu_memory", self.effective_pin_cpu_memory.into()),
        ];
        out.extend(extra.into_iter().map(|(k, v)| (k.to_owned(), v)));
        out
    }
}

impl Plan {
    /// Whether reading the checkpoint's files into the page cache while the module is built
    /// pays: the native route will map them whole (no retained or registered host tier, no
    /// encoding, the mapping read backend). Admission still decides whether the host can hold them.
    pub fn reads_ahead(&self) -> bool {
        let s = &self.settings;
        self.route == Route::VmmFastRuntime
            && s.vmm_source_cache_gb == 0.0
            && s.vmm_source_registered_gb == 0.0
            && matches!(s.load_safetensors_backend, ReadBackend::Auto | ReadBackend::Mmap)
            && s.vmm_weight_encoding == WeightEncoding::Off
    }
}

/// Resolves one component's plan. Every error names the setting, the value, where it came from
/// and what is allowed.
pub fn resolve(request: &Request<'_>) -> Result<Plan, ConfigError> {
    let env = &request.environment;
    let config = request.config.as_ref();
    let pick = |get: &dyn Fn(&DynamicOffloadConfig) -> Option<String>, var: &str| {
        get(&request.arguments)
            .map(|v| (v, Origin::Argument))
            .or_else(|| config.and_then(get).map(|v| (v, Origin::Config)))
            .or_else(|| env.get(var).map(|v| (v.to_owned(), Origin::Env(var.to_owned()))))
    };

    let (preset_text, preset_origin) =
        pick(&|c| c.preset.clone(), "DDO_PRESET").unwrap_or(("auto".into(), Origin::Default));
    let requested_preset = Preset::parse(&preset_text, preset_origin)?;
    let mode = match pick(&|c| c.execution_mode.clone(), "DDO_EXECUTION_MODE") {
        Some((text, origin)) => {
            let mode = ExecutionMode::parse_text(&text).ok_or_else(|| ConfigError::InvalidChoice {
                field: "execution_mode".into(),
                value: text.clone(),
                origin: origin.clone(),
                allowed: format!(
                    "{} (ddo has no sdnq_runtime: offload SDNQ-quantized modules with route diffusers_group_offload)",
                    ExecutionMode::allowed()
                ),
            })?;
            Some((mode, origin))
        }
        None => None,
    };
    let native_mode =
        matches!(mode, Some((ExecutionMode::VmmRuntime | ExecutionMode::VmmFastRuntime, _)));
    let backend = match pick(&|c| c.backend.clone(), "DDO_BACKEND") {
        Some((text, origin)) => {
            Backend::parse_text(&text).ok_or_else(|| ConfigError::InvalidChoice {
                field: "backend".into(),
                value: text.clone(),
                origin,
                allowed: Backend::allowed(),
            })?
        }
        None if requested_preset.is_native() || native_mode => Backend::Vmm,
        None => Backend::Linear,
    };
    // `vmm_runtime` is the protected disk preset's mode.
    let preset_for_backend = match mode {
        Some((ExecutionMode::VmmRuntime, _)) if requested_preset == Preset::Auto => {
            Preset::NvmeBaseline
        }
        _ => requested_preset,
    };
    let effective_preset = resolve_backend(backend, preset_for_backend)?;
    let execution_mode = match mode {
        None => effective_preset.execution_mode(),
        Some((mode, origin)) => {
            let fits = match mode {
                ExecutionMode::Plan | ExecutionMode::LinearRuntime => backend == Backend::Linear,
                native => effective_preset.execution_mode() == native,
            };
            if !fits {
                return Err(ConfigError::RouteConflict(format!(
                    "execution_mode {mode} (from {origin}) does not fit backend {backend} with preset {effective_preset}: \
                     linear_runtime and plan run on backend linear, vmm_fast_runtime on backend vmm with preset auto, \
                     vmm_runtime on backend vmm with preset nvme_baseline; drop one of the two settings"
                )));
            }
            mode
        }
    };

    let component_env = component_env_name(request.component);
    let mut origins = BTreeMap::new();
    let keys =
        ComponentKeys { request, effective_preset, execution_mode, component_env: &component_env };
    let choice = keys.choice()?;
    // Route `linear_convolution` brings its own configuration when the caller gives none; a
    // config that names the route itself (its `route`, or its policy for this component) asks
    // for convolution offload without saying so twice.
    let route_config = match (choice.0, config, &choice.1) {
        (RouteChoice::LinearConvolution, None, _) => Some(linear_convolution_config()),
        (RouteChoice::LinearConvolution, Some(_), Origin::Config | Origin::ComponentPolicy(_)) => {
            Some(DynamicOffloadConfig {
                linear_convolution_offload: Some(true),
                ..DynamicOffloadConfig::default()
            })
        }
        _ => None,
    };
    let route_layer = route_config
        .as_ref()
        .map(|c| (c, Origin::Route(RouteChoice::LinearConvolution.as_str().into())));
    let typed: Vec<(&DynamicOffloadConfig, Origin)> =
        std::iter::once((&request.arguments, Origin::Argument))
            .chain(config.map(|c| (c, Origin::Config)))
            .chain(route_layer)
            .collect();
    let text = |key: &'static str| -> Option<(String, Origin)> {
        let component_var = format!("DDO_{component_env}_{key}");
        if let Some(v) = env.get(&component_var) {
            return Some((v.to_owned(), Origin::ComponentEnv(component_var)));
        }
        let aliases = ENV_ALIASES.iter().filter(|(k, _)| *k == key).map(|(_, alias)| *alias);
        for name in std::iter::once(key).chain(aliases) {
            let var = format!("DDO_{name}");
            if let Some(v) = env.get(&var) {
                return Some((v.to_owned(), Origin::Env(var)));
            }
        }
        effective_preset
            .value(key)
            .map(|v| (v.to_owned(), Origin::Preset(effective_preset.as_str().to_owned())))
    };
    let settings = Settings::resolve(&typed, &text, &mut origins)?;
    crate::validate::validate(&settings, &origins)?;

    let effective_pin_cpu_memory =
        settings.pin_cpu_memory && !(request.running_on_wsl && settings.disable_pin_on_wsl);
    let route = keys.route(choice, &settings, &mut origins)?;
    // The layer route runs the linear runtime whatever backend the other components use, and
    // a dynamic route asked for under a plan-only mode runs it too: the mode says what runs.
    let execution_mode = if route == Route::LinearConvolution
        || (route == Route::LinearRuntime && execution_mode == ExecutionMode::Plan)
    {
        ExecutionMode::LinearRuntime
    } else {
        execution_mode
    };
    if settings.auto_budget_policy == AutoBudgetPolicy::Balanced
        && route.is_dynamic()
        && !route.takes_auto_budget()
    {
        return Err(ConfigError::RouteConflict(format!(
            "auto_budget_policy = balanced (from {}) sizes the native arena's GPU budget from the card, and this \
             component takes route {}: use backend vmm (the native route), or leave auto_budget_policy off",
            origin_of(&origins, "auto_budget_policy"),
            route.name()
        )));
    }
    if route.is_native() && settings.vmm_resident_weight_budget_gb <= 0.0 {
        return Err(ConfigError::RouteConflict(format!(
            "route {} needs vmm_resident_weight_budget_gb > 0 (it is {}, from {}); set a GPU budget in GiB",
            route.name(),
            settings.vmm_resident_weight_budget_gb,
            origins["vmm_resident_weight_budget_gb"]
        )));
    }

    Ok(Plan {
        component: if request.component.is_empty() {
            "model".into()
        } else {
            request.component.into()
        },
        backend,
        requested_preset,
        effective_preset,
        execution_mode,
        route,
        running_on_wsl: request.running_on_wsl,
        effective_pin_cpu_memory,
        execution_device_is_default: origins["execution_device"] == Origin::Default,
        warnings: unknown_variable_warnings(env),
        settings,
        origins,
    })
}

/// Lookup of the component keys (route, group offload parameters) through their layers.
struct ComponentKeys<'r, 'a> {
    request: &'r Request<'a>,
    effective_preset: Preset,
    execution_mode: ExecutionMode,
    component_env: &'r str,
}

impl ComponentKeys<'_, '_> {
    /// The policies for this component: from the arguments, then from the config.
    fn policies(&self) -> Vec<&ComponentPolicy> {
        let name = self.request.component;
        let lower = name.to_ascii_lowercase();
        std::iter::once(&self.request.arguments)
            .chain(self.request.config.as_ref())
            .filter_map(|c| c.components.get(name).or_else(|| c.components.get(&lower)))
            .collect()
    }

    /// A component key from explicit arguments, policies, variables and the preset table.
    fn value<T: SettingValue>(
        &self,
        key: &'static str,
        get: impl Fn(&ComponentPolicy) -> Option<T>,
    ) -> Result<Option<(T, Origin)>, ConfigError> {
        debug_assert!(COMPONENT_KEYS.contains(&key), "{key} is missing from COMPONENT_KEYS");
        if let Some(v) = get(&self.request.group) {
            return Ok(Some((v, Origin::Argument)));
        }
        if let Some(v) = self.policies().into_iter().find_map(&get) {
            let name =
                if self.request.component.is_empty() { "model" } else { self.request.component };
            return Ok(Some((v, Origin::ComponentPolicy(name.to_owned()))));
        }
        let field = key.to_ascii_lowercase();
        let env = &self.request.environment;
        for var in [
            format!("DDO_{}_{key}", self.component_env),
            format!("DDO_RUNNER_{}_{key}", self.component_env),
        ] {
            if let Some(raw) = env.get(&var) {
                let origin = Origin::ComponentEnv(var);
                return Ok(Some((parse_setting(&field, raw, &origin)?, origin)));
            }
        }
        // Preset tables name text encoders once; `text_encoder_2` uses the same defaults.
        let preset_names = [
            self.component_env,
            if self.component_env.starts_with("TEXT_ENCODER") {
                "TEXT_ENCODER"
            } else {
                self.component_env
            },
        ];
        for name in preset_names {
            if let Some(raw) = self.effective_preset.value(&format!("RUNNER_{name}_{key}")) {
                let origin = Origin::Preset(self.effective_preset.as_str().to_owned());
                return Ok(Some((parse_setting(&field, raw, &origin)?, origin)));
            }
        }
        Ok(None)
    }

    /// Whether the call asks for a runtime itself (a config, settings or a route choice), so
    /// a preset's component default does not replace it. The preset, where the component runs
    /// and the published library's host keywords (device, target classes, patterns) are not such
    /// asks: a preset given as an argument routes components as the same preset from
    /// `DDO_PRESET` does.
    fn explicit_runtime(&self) -> bool {
        let runtime_arguments = DynamicOffloadConfig {
            preset: None,
            execution_device: None,
            offload_device: None,
            target_module_classes: None,
            skip_modules_pattern: None,
            always_resident_modules_pattern: None,
            ..self.request.arguments.clone()
        };
        self.request.config.is_some()
            || !runtime_arguments.is_empty()
            || self.request.group.group_offload.is_some()
            || self.request.group.dynamic_offload.is_some()
    }

    /// The route asked for (arguments, config, policies, variables, preset table) and where
    /// that came from; `auto` from the default when nothing asks.
    fn choice(&self) -> Result<(RouteChoice, Origin), ConfigError> {
        let explicit =
            self.request.arguments.route.clone().map(|r| (r, Origin::Argument)).or_else(|| {
                self.request
                    .config
                    .as_ref()
                    .and_then(|c| c.route.clone())
                    .map(|r| (r, Origin::Config))
            });
        let chosen = match explicit {
            Some(found) => Some(found),
            None => self.value("ROUTE", |p| p.route.clone())?,
        };
        Ok(match chosen {
            Some((text, origin)) => (RouteChoice::parse(&text, origin.clone())?, origin),
            None => (RouteChoice::Auto, Origin::Default),
        })
    }

    fn route(
        &self,
        (choice, origin): (RouteChoice, Origin),
        settings: &Settings,
        origins: &mut BTreeMap<String, Origin>,
    ) -> Result<Route, ConfigError> {
        origins.insert("route".into(), origin.clone());

        let is_vae = self.request.component.eq_ignore_ascii_case("vae");
        let vae_rule = (choice == RouteChoice::Auto
            && origin == Origin::Default
            && is_vae
            && !self.explicit_runtime())
        .then(|| self.effective_preset.vae_default())
        .filter(|rule| *rule != VaeDefault::Generic);
        let preset_origin = Origin::Preset(self.effective_preset.as_str().to_owned());

        let route = match (choice, vae_rule) {
            (RouteChoice::None, _) => Route::None { placement: Placement::Resident },
            (RouteChoice::DiffusersGroupOffload, _) => self.group(settings, None, origins)?,
            (RouteChoice::DynamicOffload, _) => self.runtime(settings, origins)?,
            (RouteChoice::LinearConvolution, _) => {
                self.linear_convolution(&origin, settings, origins)?
            }
            (RouteChoice::Auto, Some(rule)) => {
                origins.insert("route".into(), preset_origin);
                match rule {
                    VaeDefault::LeafOffloadWithoutStream => {
                        self.group(settings, Some(VAE_GROUP), origins)?
                    }
                    VaeDefault::Resident => Route::None { placement: Placement::Resident },
                    VaeDefault::Unmanaged | VaeDefault::Generic => {
                        Route::None { placement: Placement::Unmanaged }
                    }
                }
            }
            (RouteChoice::Auto, None) => {
                let group = self.value("GROUP_OFFLOAD", |p| p.group_offload)?;
                let dynamic = self.value("DYNAMIC_OFFLOAD", |p| p.dynamic_offload)?;
                let mode = self.execution_mode;
                if let Some((true, o)) = group {
                    origins.insert("route".into(), o);
                    self.group(settings, None, origins)?
                } else if dynamic.as_ref().map_or(mode != ExecutionMode::Plan, |(d, _)| *d) {
                    if let Some((_, o)) = dynamic {
                        origins.insert("route".into(), o);
                    }
                    self.runtime(settings, origins)?
                } else {
                    let placement = if self.effective_preset == Preset::Off {
                        Placement::Unmanaged
                    } else {
                        Placement::Resident
                    };
                    Route::None { placement }
                }
            }
        };
        Ok(route)
    }

    /// The runtime route of the execution mode; with `linear_convolution_offload` the linear
    /// runtime streams layer by layer, and the native runtimes refuse it.
    fn runtime(
        &self,
        settings: &Settings,
        origins: &BTreeMap<String, Origin>,
    ) -> Result<Route, ConfigError> {
        let route = runtime_route(self.execution_mode);
        if !settings.linear_convolution_offload {
            return Ok(route);
        }
        if route.is_native() {
            return Err(ConfigError::RouteConflict(format!(
                "linear_convolution_offload = true (from {}) streams layers on the linear runtime, but this component \
                 resolves to route {} (execution mode {}): use backend linear, give only this component route \
                 linear_convolution (DDO_{}_ROUTE=linear_convolution), or leave linear_convolution_offload false",
                origin_of(origins, "linear_convolution_offload"),
                route.name(),
                self.execution_mode,
                self.component_env,
            )));
        }
        Ok(Route::LinearConvolution)
    }

    /// Route `linear_convolution`: an explicit config must itself ask for it (the route's own
    /// configuration applies only when there is none), and nothing may turn it off.
    fn linear_convolution(
        &self,
        route_origin: &Origin,
        settings: &Settings,
        origins: &BTreeMap<String, Origin>,
    ) -> Result<Route, ConfigError> {
        let origin = origin_of(origins, "linear_convolution_offload");
        let explicit = matches!(origin, Origin::Argument | Origin::Config | Origin::Route(_));
        if self.request.config.is_some() && !explicit {
            return Err(ConfigError::RouteConflict(format!(
                "route linear_convolution (from {route_origin}) with an explicit config: the config must itself set \
                 linear_convolution_offload=True (it comes from {origin}); add it to the config (or name the route \
                 in it: route, or its policy for this component), or pass no config to use the route's own \
                 (registered host tensors, no resident units, small_tensor_threshold_kb 16)"
            )));
        }
        if !settings.linear_convolution_offload {
            return Err(ConfigError::RouteConflict(format!(
                "route linear_convolution (from {route_origin}) streams convolution layers, but \
                 linear_convolution_offload = false (from {origin}); drop that setting or choose another route"
            )));
        }
        Ok(Route::LinearConvolution)
    }

    fn group(
        &self,
        settings: &Settings,
        preset_default: Option<GroupOffload>,
        origins: &mut BTreeMap<String, Origin>,
    ) -> Result<Route, ConfigError> {
        let base = preset_default.unwrap_or(DEFAULT_GROUP);
        let default_origin = if preset_default.is_some() {
            Origin::Preset(self.effective_preset.as_str().to_owned())
        } else {
            Origin::Default
        };
        let (offload_type, _) = decide(
            origins,
            "offload_type",
            self.value("OFFLOAD_TYPE", |p| p.offload_type)?,
            base.offload_type,
            &default_origin,
        );
        let (mut use_stream, stream_origin) = decide(
            origins,
            "use_stream",
            self.value("OFFLOAD_STREAM", |p| p.use_stream)?,
            base.use_stream,
            &default_origin,
        );
        let (mut record_stream, record_origin) = decide(
            origins,
            "record_stream",
            self.value("OFFLOAD_RECORD_STREAM", |p| p.record_stream)?,
            base.record_stream,
            &default_origin,
        );
        let (low_cpu_mem_usage, _) = decide(
            origins,
            "low_cpu_mem_usage",
            self.value("OFFLOAD_LOW_CPU_MEM_USAGE", |p| p.low_cpu_mem_usage)?,
            base.low_cpu_mem_usage,
            &default_origin,
        );
        let num_blocks_per_group =
            match self.value("NUM_BLOCKS_PER_GROUP", |p| p.num_blocks_per_group)? {
                Some((0, o)) => {
                    return Err(ConfigError::OutOfRange {
                        field: "num_blocks_per_group".into(),
                        value: "0".into(),
                        origin: o,
                        range: "1 or more".into(),
                    });
                }
                Some((n, _)) => n,
                None => base.num_blocks_per_group,
            };
        // On WSL with pinning disabled, side streams would copy from pageable memory: turn them
        // off unless an explicit argument asks for them.
        if self.request.running_on_wsl && settings.disable_pin_on_wsl {
            if stream_origin != Origin::Argument {
                use_stream = false;
            }
            if record_origin != Origin::Argument {
                record_stream = false;
            }
        }
        Ok(Route::DiffusersGroupOffload(GroupOffload {
            offload_type,
            use_stream,
            record_stream,
            low_cpu_mem_usage,
            num_blocks_per_group,
        }))
    }
}

fn origin_of(origins: &BTreeMap<String, Origin>, field: &str) -> Origin {
    origins.get(field).cloned().unwrap_or(Origin::Default)
}

/// The configuration route `linear_convolution` brings when the caller gives none, as the
/// published library's: convolution offload, registered (pinned) host tensors, no resident
/// units, no automatic budget, no cache of pinned copies, and its 16 KiB small-tensor threshold
/// (parameters at most this size stay resident).
fn linear_convolution_config() -> DynamicOffloadConfig {
    DynamicOffloadConfig {
        linear_convolution_offload: Some(true),
        pin_cpu_memory: Some(true),
        resident_module_budget_gb: Some(0.0),
        auto_budget_policy: Some(AutoBudgetPolicy::Off),
        cache_pinned_weights: Some(false),
        small_tensor_threshold_kb: Some(LAYER_ROUTE_RESIDENT_KIB),
        ..DynamicOffloadConfig::default()
    }
}

/// Takes `found` or the default, recording the origin of the value under `name`.
fn decide<T>(
    origins: &mut BTreeMap<String, Origin>,
    name: &str,
    found: Option<(T, Origin)>,
    default: T,
    default_origin: &Origin,
) -> (T, Origin) {
    let (value, origin) = found.unwrap_or_else(|| (default, default_origin.clone()));
    origins.insert(name.into(), origin.clone());
    (value, origin)
}

const DEFAULT_GROUP: GroupOffload = GroupOffload {
    offload_type: OffloadType::LeafLevel,
    use_stream: true,
    record_stream: false,
    low_cpu_mem_usage: true,
    num_blocks_per_group: 1,
};

const VAE_GROUP: GroupOffload =
    GroupOffload { use_stream: false, low_cpu_mem_usage: false, ..DEFAULT_GROUP };

/// The runtime route of an execution mode; an explicit dynamic route under a plan-only preset
/// runs the linear runtime.
const fn runtime_route(mode: ExecutionMode) -> Route {
    match mode {
        ExecutionMode::Plan | ExecutionMode::LinearRuntime => Route::LinearRuntime,
        ExecutionMode::VmmRuntime => Route::VmmRuntime,
        ExecutionMode::VmmFastRuntime => Route::VmmFastRuntime,
    }
}
