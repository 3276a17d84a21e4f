//! The configuration model: what users set ([`DynamicOffloadConfig`], every field optional) and
//! what resolution produces ([`Settings`], every field decided, with its [`Origin`]).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::value::{AutoBudgetPolicy, OffloadType, ReadBackend, Selection, SettingValue};

/// Declares every setting once: its field, type, default, variable key and documentation.
macro_rules! settings {
    ($( $(#[doc = $doc:literal])* $field:ident : $ty:ty = $default:expr, $key:literal; )*) => {
        /// What a user sets. Every field is optional; an unset field is decided by the layers below
        /// it (see [`crate::resolve`]). Deserializing refuses unknown fields, so a misspelt setting
        /// is an error, never silently ignored.
        #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
        #[serde(deny_unknown_fields)]
        pub struct DynamicOffloadConfig {
            /// Preset name (`auto`, `one_shot_fast`, ...).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub preset: Option<String>,
            /// Backend: `linear` or `vmm`.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub backend: Option<String>,
            /// Route for the component this configuration is applied to: `auto`,
            /// `dynamic_offload`, `diffusers_group_offload` or `none` (aliases accepted).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub route: Option<String>,
            /// Per-component policies, by component name (`transformer`, `vae`, ...).
            #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
            pub components: BTreeMap<String, ComponentPolicy>,
            $(
                $(#[doc = $doc])*
                #[doc = concat!("\n\nVariable: `DDO_", $key, "`.")]
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub $field: Option<$ty>,
            )*
        }

        /// Every setting, decided.
        #[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
        pub struct Settings {
            $( $(#[doc = $doc])* pub $field: $ty, )*
        }

        /// `(field, variable key without DDO_)` of every setting, in declaration order.
        pub const SETTING_KEYS: &[(&str, &str)] = &[ $( (stringify!($field), $key), )* ];

        impl DynamicOffloadConfig {
            /// Whether no field is set.
            pub fn is_empty(&self) -> bool {
                self.preset.is_none()
                    && self.backend.is_none()
                    && self.route.is_none()
                    && self.components.is_empty()
                    $( && self.$field.is_none() )*
            }
        }

        impl Settings {
            /// Resolves every setting: the first typed layer that sets it (arguments, config),
            /// else the first text layer `text(key)` that has it (variables, preset table), else
            /// the default. Records where each value came from in `origins`.
            pub(crate) fn resolve(
                typed: &[(&DynamicOffloadConfig, crate::Origin)],
                text: &dyn Fn(&'static str) -> Option<(String, crate::Origin)>,
                origins: &mut BTreeMap<String, crate::Origin>,
            ) -> Result<Settings, crate::ConfigError> {
                Ok(Settings {
                    $(
                        $field: {
                            let from_typed = typed.iter().find_map(|(layer, origin)| {
                                layer.$field.clone().map(|v| (v, origin.clone()))
                            });
                            let (value, origin) = match (from_typed, text($key)) {
                                (Some(found), _) => found,
                                (None, Some((raw, origin))) => {
                                    (parse_setting::<$ty>(stringify!($field), &raw, &origin)?, origin)
                                }
                                (None, None) => ($default, crate::Origin::Default),
                            };
                            origins.insert(stringify!($field).into(), origin);
                            value
                        },
                    )*
                })
            }

            /// Every setting as `(field, JSON value)`, in declaration order.
            pub fn to_json_pairs(&self) -> Vec<(&'static str, serde_json::Value)> {
                vec![ $( (stringify!($field), SettingValue::to_json(&self.$field)), )* ]
            }

            /// The `f64` settings (sizes and ratios), for validation.
            pub(crate) fn float_fields(&self) -> Vec<(&'static str, f64)> {
                let mut out = Vec::new();
                $( push_float(&mut out, stringify!($field), &self.$field); )*
                out
            }
        }
    };
}

/// Parses the text of a setting; the error names the variable (or preset) it came from.
pub(crate) fn parse_setting<T: SettingValue>(
    field: &str,
    raw: &str,
    origin: &crate::Origin,
) -> Result<T, crate::ConfigError> {
    T::parse_text(raw).ok_or_else(|| match origin {
        crate::Origin::Env(var) | crate::Origin::ComponentEnv(var) => {
            crate::ConfigError::InvalidEnv {
                var: var.clone(),
                value: raw.to_owned(),
                expected: T::expected(),
            }
        }
        other => crate::ConfigError::InvalidChoice {
            field: field.to_owned(),
            value: raw.to_owned(),
            origin: other.clone(),
            allowed: T::expected(),
        },
    })
}

fn push_float<T: 'static>(out: &mut Vec<(&'static str, f64)>, field: &'static str, value: &T) {
    if let Some(v) = (value as &dyn std::any::Any).downcast_ref::<f64>() {
        out.push((field, *v));
    }
}

/// The regex of modules kept whole on the execution device by default.
pub const DEFAULT_ALWAYS_RESIDENT_PATTERN: &str =
    r"(^|\.)(proj_in|time_embed|prompt_adaln|norm_out|proj_out)(\.|$)";

settings! {
    /// Device that runs the model (`cuda:0`, or `cpu` on the host backend).
    execution_device: String = "cuda:0".to_owned(), "EXECUTION_DEVICE";
    /// Device where offloaded weights live.
    offload_device: String = "cpu".to_owned(), "OFFLOAD_DEVICE";
    /// GPU residency ceiling of the native arena in GiB: resident units and execution slots.
    vmm_resident_weight_budget_gb: f64 = 4.0, "VMM_RESIDENT_WEIGHT_BUDGET_GB";
    /// GPU bytes (GiB) of whole modules the linear route keeps resident.
    resident_module_budget_gb: f64 = 0.0, "RESIDENT_MODULE_BUDGET_GB";
    /// Cap on an automatic resident-module budget (GiB; 0 = no cap).
    max_resident_module_budget_gb: f64 = 6.0, "MAX_RESIDENT_MODULE_BUDGET_GB";
    /// GPU memory (GiB) kept free for activations; 0 = the automatic headroom table.
    auto_vram_headroom_gb: f64 = 0.0, "AUTO_VRAM_HEADROOM_GB";
    /// Automatic budget policy of the linear route.
    auto_budget_policy: AutoBudgetPolicy = AutoBudgetPolicy::Off, "AUTO_BUDGET_POLICY";
    /// Model-to-VRAM ratio from which the balanced policy pins everything and keeps nothing resident.
    auto_full_pin_min_model_to_vram_ratio: f64 = 4.0, "AUTO_FULL_PIN_MIN_MODEL_TO_VRAM_RATIO";
    /// Pin (page-lock) offloaded weights for fast copies.
    pin_cpu_memory: bool = false, "PIN_CPU_MEMORY";
    /// On a pinning failure, continue unpinned instead of failing.
    allow_pin_memory_fallback: bool = true, "ALLOW_PIN_MEMORY_FALLBACK";
    /// Do not pin when running on WSL.
    disable_pin_on_wsl: bool = true, "DISABLE_PIN_ON_WSL";
    /// Threads that pin weights in parallel.
    pin_cpu_workers: u32 = 4, "PIN_CPU_WORKERS";
    /// Keep pinned weights in a process-wide cache across attaches.
    cache_pinned_weights: bool = false, "CACHE_PINNED_WEIGHTS";
    /// Explicit pin budget (GiB; 0 = automatic).
    pin_weight_budget_gb: f64 = 0.0, "PIN_WEIGHT_BUDGET_GB";
    /// Pin budget as a fraction of the candidate bytes (0..1; 0 = unset).
    pin_weight_budget_ratio: f64 = 0.0, "PIN_WEIGHT_BUDGET_RATIO";
    /// Cap on the pin budget (GiB; 0 = no cap).
    max_pin_weight_budget_gb: f64 = 0.0, "MAX_PIN_WEIGHT_BUDGET_GB";
    /// Which weights to pin first under a partial budget.
    pin_weight_selection: Selection = Selection::Spread, "PIN_WEIGHT_SELECTION";
    /// Host RAM (GiB) kept free when sizing pinned and retained memory.
    system_ram_headroom_gb: f64 = 6.0, "SYSTEM_RAM_HEADROOM_GB";
    /// Retained host storage ceiling of the checkpoint source (GiB, 0..32; 0 = read from the mapping).
    vmm_source_cache_gb: f64 = 0.0, "VMM_SOURCE_CACHE_GB";
    /// Host registration ceiling (GiB, whole 64 MiB segments, at most the storage; 0 = same as storage).
    vmm_source_registered_gb: f64 = 0.0, "VMM_SOURCE_REGISTERED_GB";
    /// Host staging memory (GiB) for the disk route's reads.
    vmm_staging_buffer_gb: f64 = 0.625, "VMM_STAGING_BUFFER_GB";
    /// How checkpoint bytes are read.
    load_safetensors_backend: ReadBackend = ReadBackend::Auto, "LOAD_SAFETENSORS_BACKEND";
    /// Regex of the modules whose weights the native arena owns.
    vmm_module_pattern: String = ".*".to_owned(), "VMM_MODULE_PATTERN";
    /// Regexes of modules left untouched.
    skip_modules_pattern: Vec<String> = Vec::new(), "SKIP_MODULES_PATTERN";
    /// Regexes of modules always kept whole on the execution device.
    always_resident_modules_pattern: Vec<String> = vec![DEFAULT_ALWAYS_RESIDENT_PATTERN.to_owned()], "ALWAYS_RESIDENT_MODULE_PATTERNS";
    /// Regexes of resident-module candidates; `auto` = the repeated block list.
    resident_module_patterns: Vec<String> = Vec::new(), "RESIDENT_MODULE_PATTERNS";
    /// Which candidates become resident first under the budget.
    resident_module_selection: Selection = Selection::Spread, "RESIDENT_MODULE_SELECTION";
    /// Tensors up to this size (KiB) stay resident on the execution device.
    small_tensor_threshold_kb: u32 = 1024, "SMALL_TENSOR_THRESHOLD_KB";
    /// Units kept in flight ahead of execution.
    prefetch_depth: u32 = 2, "PREFETCH_DEPTH";
    /// Allow explicit reclaim of idle execution-slot backing (addresses are kept).
    vmm_execution_backing_reclaim: bool = false, "VMM_EXECUTION_BACKING_RECLAIM";
    /// Print what ddo does.
    verbose: bool = false, "VERBOSE";
    /// Print the profile after runs.
    show_profile: bool = false, "SHOW_PROFILE";
}

/// Variables accepted under a second name.
pub const ENV_ALIASES: &[(&str, &str)] = &[("LOAD_SAFETENSORS_BACKEND", "SAFETENSORS_BACKEND")];

/// A component's route policy. Every field optional; see [`crate::resolve`] for precedence.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ComponentPolicy {
    /// Route: `auto`, `dynamic_offload`, `diffusers_group_offload`, `none` (aliases accepted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    /// Use Diffusers group offload when the route is `auto`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_offload: Option<bool>,
    /// Use ddo's dynamic offload when the route is `auto`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamic_offload: Option<bool>,
    /// Diffusers group-offload granularity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload_type: Option<OffloadType>,
    /// Diffusers group offload on a side stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_stream: Option<bool>,
    /// Diffusers `record_stream`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record_stream: Option<bool>,
    /// Diffusers `low_cpu_mem_usage`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_cpu_mem_usage: Option<bool>,
    /// Blocks per group for `block_level`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_blocks_per_group: Option<u32>,
}

impl ComponentPolicy {
    /// Whether no field is set.
    pub fn is_empty(&self) -> bool {
        *self == ComponentPolicy::default()
    }
}
