//! Resolution: from what the user, the environment and the preset say, to one [`Plan`] per
//! component.
//!
//! Precedence, highest first:
//! 1. explicit arguments ([`Request::arguments`], [`Request::group`]);
//! 2. the explicit configuration ([`Request::config`]);
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
use crate::route::{GroupOffload, Placement, Route, RouteChoice};
use crate::value::{OffloadType, SettingValue};
use crate::variables::{COMPONENT_KEYS, unknown_variable_warnings};
use crate::{ComponentPolicy, ConfigError, DynamicOffloadConfig, Environment, Origin, Settings};

/// Size of one host registration segment.
pub const REGISTRATION_SEGMENT_MIB: u64 = 64;
/// Largest retained source storage ceiling, in GiB.
pub const MAX_SOURCE_CACHE_GB: f64 = 32.0;
/// Largest prefetch depth.
pub const MAX_PREFETCH_DEPTH: u32 = 16;

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
    let backend = match pick(&|c| c.backend.clone(), "DDO_BACKEND") {
        Some((text, origin)) => {
            Backend::parse_text(&text).ok_or_else(|| ConfigError::InvalidChoice {
                field: "backend".into(),
                value: text.clone(),
                origin,
                allowed: Backend::allowed(),
            })?
        }
        None if requested_preset.is_native() => Backend::Vmm,
        None => Backend::Linear,
    };
    let effective_preset = resolve_backend(backend, requested_preset)?;

    let component_env = component_env_name(request.component);
    let mut origins = BTreeMap::new();
    let typed: Vec<(&DynamicOffloadConfig, Origin)> =
        std::iter::once((&request.arguments, Origin::Argument))
            .chain(config.map(|c| (c, Origin::Config)))
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
    let keys = ComponentKeys { request, effective_preset, component_env: &component_env };
    let route = keys.route(&settings, &mut origins)?;
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
        execution_mode: effective_preset.execution_mode(),
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

    fn explicit_runtime(&self) -> bool {
        self.request.config.is_some()
            || !self.request.arguments.is_empty()
            || self.request.group.group_offload.is_some()
            || self.request.group.dynamic_offload.is_some()
    }

    fn route(
        &self,
        settings: &Settings,
        origins: &mut BTreeMap<String, Origin>,
    ) -> Result<Route, ConfigError> {
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
        let (choice, origin) = match chosen {
            Some((text, origin)) => (RouteChoice::parse(&text, origin.clone())?, origin),
            None => (RouteChoice::Auto, Origin::Default),
        };
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
            (RouteChoice::DynamicOffload, _) => {
                runtime_route(self.effective_preset.execution_mode())
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
                let mode = self.effective_preset.execution_mode();
                if let Some((true, o)) = group {
                    origins.insert("route".into(), o);
                    self.group(settings, None, origins)?
                } else if dynamic.as_ref().map_or(mode != ExecutionMode::Plan, |(d, _)| *d) {
                    if let Some((_, o)) = dynamic {
                        origins.insert("route".into(), o);
                    }
                    runtime_route(mode)
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
