//! The configuration model: what users set ([`DynamicOffloadConfig`], every field optional) and
//! what resolution produces ([`Settings`], every field decided, with its [`Origin`]).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::value::{
    AutoBudgetPolicy, ConversionSite, LinearRuntimeStrategy, OffloadType, ReadBackend, Selection,
    SettingValue, WeightEncoding,
};

/// Declares every setting once: its field, type, default, variable key and documentation; a
/// setting ddo does not implement carries `unsupported = "what ddo does instead"`, which adds
/// that text to its documentation and refuses any value other than the default at resolution.
macro_rules! settings {
    ($(
        $(#[doc = $doc:literal])*
        $field:ident : $ty:ty = $default:expr, $key:literal $(, unsupported = $instead:literal)? ;
    )*) => {
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
            /// `dynamic_offload`, `linear_convolution`, `diffusers_group_offload` or `none`
            /// (aliases accepted).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub route: Option<String>,
            /// The peer library's execution mode (`plan`, `linear_runtime`, `vmm_runtime`,
            /// `vmm_fast_runtime`): picks the backend, and `plan` turns dynamic offload off.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub execution_mode: Option<String>,
            /// Per-component policies, by component name (`transformer`, `vae`, ...).
            #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
            pub components: BTreeMap<String, ComponentPolicy>,
            $(
                $(#[doc = $doc])*
                $( #[doc = concat!("\n\nNot supported by ddo: only the default is accepted; ", $instead, ".")] )?
                #[doc = concat!("\n\nVariable: `DDO_", $key, "`.")]
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub $field: Option<$ty>,
            )*
        }

        /// Every setting, decided.
        #[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
        pub struct Settings {
            $(
                $(#[doc = $doc])*
                $( #[doc = concat!("\n\nNot supported by ddo: only the default is accepted; ", $instead, ".")] )?
                pub $field: $ty,
            )*
        }

        /// `(field, variable key without DDO_)` of every setting, in declaration order.
        pub const SETTING_KEYS: &[(&str, &str)] = &[ $( (stringify!($field), $key), )* ];

        /// `(field, what ddo does instead)` of every setting ddo does not implement: resolution
        /// refuses any value of these other than the default.
        pub const UNSUPPORTED_SETTINGS: &[(&str, &str)] = &[ $( $( (stringify!($field), $instead), )? )* ];

        impl DynamicOffloadConfig {
            /// Parses a configuration object (JSON) given as `origin` (arguments or a config).
            /// Every error names the field, the value, the origin and what is allowed; a
            /// setting may also be given as text (`"nan"`, `"1.5"`, `"true"`), parsed as its
            /// variable would be, so values JSON cannot carry (NaN, infinities) reach validation.
            pub fn from_json_value(
                value: &serde_json::Value,
                origin: crate::Origin,
            ) -> Result<DynamicOffloadConfig, crate::ConfigError> {
                let invalid = |field: &str, value: &serde_json::Value, allowed: String| {
                    crate::ConfigError::InvalidChoice {
                        field: field.to_owned(),
                        value: match value {
                            serde_json::Value::String(s) => s.clone(),
                            other => other.to_string(),
                        },
                        origin: origin.clone(),
                        allowed,
                    }
                };
                let object = value.as_object().ok_or_else(|| {
                    invalid("config", value, "an object of settings".to_owned())
                })?;
                let mut config = DynamicOffloadConfig::default();
                let mut threshold_from_bytes: Option<u32> = None;
                for (key, v) in object {
                    if v.is_null() {
                        continue;
                    }
                    match key.as_str() {
                        "preset" | "backend" | "route" | "execution_mode" => {
                            let text = v.as_str().ok_or_else(|| invalid(key, v, "a name".into()))?;
                            match key.as_str() {
                                "preset" => config.preset = Some(text.to_owned()),
                                "backend" => config.backend = Some(text.to_owned()),
                                "route" => config.route = Some(text.to_owned()),
                                _ => config.execution_mode = Some(text.to_owned()),
                            }
                        }
                        // The peer library's threshold in bytes; ddo's is whole KiB.
                        "small_tensor_threshold_bytes" => {
                            let kib = v
                                .as_u64()
                                .filter(|b| b % 1024 == 0)
                                .and_then(|b| u32::try_from(b / 1024).ok())
                                .ok_or_else(|| {
                                    invalid(key, v, "a multiple of 1024 bytes (ddo's threshold is whole KiB: small_tensor_threshold_kb)".into())
                                })?;
                            threshold_from_bytes = Some(kib);
                        }
                        "components" => {
                            config.components = serde_json::from_value(v.clone()).map_err(|e| {
                                invalid(key, v, format!("a mapping of component policies ({e})"))
                            })?;
                        }
                        $(
                            stringify!($field) => {
                                config.$field = Some(setting_from_json::<$ty>(v).ok_or_else(|| {
                                    invalid(key, v, <$ty as SettingValue>::expected())
                                })?);
                            }
                        )*
                        other => {
                            return Err(crate::ConfigError::UnknownField {
                                field: other.to_owned(),
                                origin: origin.clone(),
                            });
                        }
                    }
                }
                if let Some(kib) = threshold_from_bytes {
                    if config.small_tensor_threshold_kb.is_some_and(|k| k != kib) {
                        return Err(crate::ConfigError::RouteConflict(
                            "small_tensor_threshold_bytes and small_tensor_threshold_kb disagree; set one of them".into(),
                        ));
                    }
                    config.small_tensor_threshold_kb = Some(kib);
                }
                Ok(config)
            }

            /// Whether no field is set.
            pub fn is_empty(&self) -> bool {
                self.preset.is_none()
                    && self.backend.is_none()
                    && self.route.is_none()
                    && self.execution_mode.is_none()
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

            /// The unsupported settings whose value is not the default, in declaration order.
            pub(crate) fn unsupported_values(&self) -> Vec<UnsupportedValue> {
                #[allow(unused_mut)]
                let mut out = Vec::new();
                $( $(
                    let default: $ty = $default;
                    if self.$field != default {
                        out.push(UnsupportedValue {
                            field: stringify!($field),
                            value: self.$field.to_text(),
                            default: default.to_text(),
                            instead: $instead,
                        });
                    }
                )? )*
                out
            }
        }
    };
}

/// An unsupported setting set to something other than its default.
pub(crate) struct UnsupportedValue {
    /// The setting.
    pub(crate) field: &'static str,
    /// Its value, as error messages show it.
    pub(crate) value: String,
    /// Its default, as error messages show it.
    pub(crate) default: String,
    /// What ddo does instead.
    pub(crate) instead: &'static str,
}

/// A setting from JSON: its own JSON form, or text parsed as its variable would be.
fn setting_from_json<T: SettingValue + serde::de::DeserializeOwned>(
    value: &serde_json::Value,
) -> Option<T> {
    match value {
        serde_json::Value::String(text) => {
            T::parse_text(text).or_else(|| serde_json::from_value(value.clone()).ok())
        }
        other => serde_json::from_value(other.clone()).ok(),
    }
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

settings! {
    /// Device that runs the model: `cuda` (the current CUDA device), `cuda:N` or `cpu` (the host
    /// backend); any other text is refused at resolution. The plan's
    /// `execution_device_is_default` says whether it came from the default, so a host without
    /// CUDA picks `cpu` only when the user said nothing.
    execution_device: String = "cuda:0".to_owned(), "EXECUTION_DEVICE";
    /// Device where offloaded weights live.
    offload_device: String = "cpu".to_owned(), "OFFLOAD_DEVICE",
        unsupported = "ddo keeps offloaded weights in host memory";
    /// GPU weight budget (GiB) of the arena on the native route (`vmm_fast_runtime`): resident
    /// units and execution slots.
    vmm_resident_weight_budget_gb: f64 = 4.0, "VMM_RESIDENT_WEIGHT_BUDGET_GB";
    /// On the linear route, GPU bytes (GiB) of units kept resident beyond the execution slots: the
    /// arena budget is this plus the slots.
    resident_module_budget_gb: f64 = 0.0, "RESIDENT_MODULE_BUDGET_GB";
    /// Cap on the peer library's automatic resident-module budget (GiB; 0 = no cap).
    max_resident_module_budget_gb: f64 = 6.0, "MAX_RESIDENT_MODULE_BUDGET_GB",
        unsupported = "it caps the published library's heuristic resident budget; ddo's automatic budget (auto_budget_policy = balanced) follows the GPU's free memory less auto_vram_headroom_gb, and fixed budgets are vmm_resident_weight_budget_gb / resident_module_budget_gb";
    /// GPU memory (GiB) of the arena budget kept free for activations: the arena plans its units
    /// and slots under the budget minus this headroom (0 = none).
    auto_vram_headroom_gb: f64 = 0.0, "AUTO_VRAM_HEADROOM_GB";
    /// The GPU budget from the card (`off` or `balanced`). `balanced`, on the native route: after
    /// the first pass, and whenever free device memory falls below half of the headroom, the
    /// arena is planned again under the device's free memory plus its own, less
    /// `auto_vram_headroom_gb` (1 GiB when 0): what PyTorch keeps for the working set is not free.
    auto_budget_policy: AutoBudgetPolicy = AutoBudgetPolicy::Off, "AUTO_BUDGET_POLICY";
    /// Model-to-VRAM ratio from which the peer library's balanced policy pins everything.
    auto_full_pin_min_model_to_vram_ratio: f64 = 4.0, "AUTO_FULL_PIN_MIN_MODEL_TO_VRAM_RATIO",
        unsupported = "it tunes the published library's heuristic budget; ddo's automatic budget (auto_budget_policy = balanced) follows the GPU's free memory less auto_vram_headroom_gb, and fixed budgets are vmm_resident_weight_budget_gb / resident_module_budget_gb";
    /// On the linear route, register (page-lock) the module's host tensors in place so copies
    /// run at full speed; the plan's `effective_pin_cpu_memory` applies `disable_pin_on_wsl`.
    pin_cpu_memory: bool = false, "PIN_CPU_MEMORY";
    /// When the host refuses registration: continue unregistered (true) or fail (false).
    allow_pin_memory_fallback: bool = true, "ALLOW_PIN_MEMORY_FALLBACK";
    /// Do not register host tensors on WSL: `effective_pin_cpu_memory` is `pin_cpu_memory` and
    /// not (WSL and this); on WSL it also turns Diffusers group-offload streams off unless an
    /// argument asks for them.
    disable_pin_on_wsl: bool = true, "DISABLE_PIN_ON_WSL";
    /// Threads that read checkpoint bytes into retained host memory (1 to 64).
    pin_cpu_workers: u32 = 4, "PIN_CPU_WORKERS";
    /// The peer library's process-wide cache of pinned weights kept across attaches.
    cache_pinned_weights: bool = false, "CACHE_PINNED_WEIGHTS",
        unsupported = "ddo registers host tensors in place up to pin_weight_budget_gb; there is no cache of pinned copies to keep across attaches";
    /// Registration ceiling (GiB) of the linear route: host bytes it registers in place at most
    /// (0 = everything).
    pin_weight_budget_gb: f64 = 0.0, "PIN_WEIGHT_BUDGET_GB";
    /// The peer library's pin budget as a fraction of the candidate bytes.
    pin_weight_budget_ratio: f64 = 0.0, "PIN_WEIGHT_BUDGET_RATIO",
        unsupported = "ddo registers host tensors in place up to pin_weight_budget_gb; set that ceiling in GiB";
    /// The peer library's cap on an automatic pin budget (GiB).
    max_pin_weight_budget_gb: f64 = 0.0, "MAX_PIN_WEIGHT_BUDGET_GB",
        unsupported = "ddo registers host tensors in place up to pin_weight_budget_gb; set that ceiling directly (there is no automatic pin budget to cap)";
    /// The peer library's order of weights to pin under a partial budget.
    pin_weight_selection: Selection = Selection::Spread, "PIN_WEIGHT_SELECTION",
        unsupported = "ddo registers host tensors in place up to pin_weight_budget_gb and chooses which itself";
    /// Host RAM (GiB) kept free by host-memory admission (the safety margin of admission).
    system_ram_headroom_gb: f64 = 6.0, "SYSTEM_RAM_HEADROOM_GB";
    /// Retained host storage ceiling of the checkpoint source (GiB, 0..32; 0 = read from the mapping).
    vmm_source_cache_gb: f64 = 0.0, "VMM_SOURCE_CACHE_GB";
    /// Host registration ceiling (GiB, whole 64 MiB segments, at most the storage; 0 = same as storage).
    vmm_source_registered_gb: f64 = 0.0, "VMM_SOURCE_REGISTERED_GB";
    /// Host staging (GiB) of checkpoint reads: on the disk route (vmm_runtime) one staging buffer
    /// of two, so host memory stays within twice this and the largest unit must fit in it; on
    /// the native route with part of the checkpoint retained, the read-ahead of the rest.
    vmm_staging_buffer_gb: f64 = 0.625, "VMM_STAGING_BUFFER_GB";
    /// A GPU (`cuda:N`, the execution device itself included) whose memory holds the native
    /// route's streamed units: each is uploaded once, copied into that device's memory, and from
    /// then on streamed over the peer link instead of from host memory. Where the execution
    /// device cannot read that GPU's memory (no peer access) the plan says so and host memory
    /// serves. Empty (the default): host memory.
    vmm_peer_store_device: String = String::new(), "VMM_PEER_STORE_DEVICE";
    /// Bytes (GiB) of the peer store's device the store may take, in whole units in execution
    /// order; the rest stream from host memory. 0 (the default): every streamed unit.
    vmm_peer_store_gb: f64 = 0.0, "VMM_PEER_STORE_GB";
    /// How the native route reads the checkpoint: `auto` and `mmap` = the mapping; `pread` =
    /// positioned reads; `direct` = O_DIRECT reads.
    load_safetensors_backend: ReadBackend = ReadBackend::Auto, "LOAD_SAFETENSORS_BACKEND";
    /// Where the native route converts tensors stored in another dtype than their parameters':
    /// `auto` (widening on the device, the rest at load on the host unless the host is short),
    /// `host` (at load), `device` (on the GPU after each upload).
    dtype_conversion: ConversionSite = ConversionSite::Auto, "DTYPE_CONVERSION";
    /// Entropy-coded streaming on the native route: bf16 and fp16 tensors uploaded with
    /// Huffman-coded exponents (bf16: about two thirds of their bytes) and decoded on the
    /// device, bit for bit. `off`; `on` (every unit's, at load); `auto` (on a GPU: raw while
    /// the first passes are timed, then, if they run at their copy floor, the streamed units'
    /// tensors the device decodes faster than the link copies them; on the host backend the
    /// streamed units' tensors of 1 MiB or more, at load). A tensor is encoded only when its
    /// encoding is smaller. On a GPU with an encoded-file folder, encodings no file holds yet
    /// are written in the background while passes stream raw, and the switch to encoded
    /// streaming comes once the file is complete.
    vmm_weight_encoding: WeightEncoding = WeightEncoding::Off, "VMM_WEIGHT_ENCODING";
    /// A folder of encoded files for `vmm_weight_encoding`: the encodings of a checkpoint's
    /// chosen tensors are written there once (`<16 hex digits>.ddoenc`, named after the
    /// checkpoint's files and the tensors), and a later load maps that file instead of encoding
    /// again when it records the same checkpoint files (path, size, modification time), tensors
    /// and format, and every encoding in it checks; otherwise it encodes and writes the file
    /// again (atomically). A folder that cannot be written only leaves the encodings unsaved.
    /// Empty (the default): `$DDO_CACHE_DIR/encoded`, else `$HF_HOME/ddo/encoded`, else
    /// `$XDG_CACHE_HOME/huggingface/ddo/encoded`, else `~/.cache/huggingface/ddo/encoded`,
    /// kept within 64 GiB (least recently used files removed); none of them set: encode at
    /// every load.
    vmm_encoded_cache_dir: String = String::new(), "VMM_ENCODED_CACHE_DIR";
    /// Regex (Python `re.search` semantics on the module path) of the modules whose repeated
    /// blocks are streamed; other parameters stay resident. It must also compile as a Rust
    /// `regex` (no look-around, no back-references): resolution refuses one that does not.
    vmm_module_pattern: String = ".*".to_owned(), "VMM_MODULE_PATTERN";
    /// The peer library's regexes of modules left untouched.
    skip_modules_pattern: Vec<String> = Vec::new(), "SKIP_MODULES_PATTERN",
        unsupported = "use always_resident_modules_pattern (modules kept on the device) or vmm_module_pattern (modules whose blocks are streamed)";
    /// Regexes (Python `re.search` semantics on the module path) of modules kept whole on the
    /// execution device; none by default. Each must also compile as a Rust `regex`: resolution
    /// refuses one that does not.
    always_resident_modules_pattern: Vec<String> = Vec::new(), "ALWAYS_RESIDENT_MODULE_PATTERNS";
    /// The peer library's regexes of resident-module candidates (`auto` = the repeated blocks).
    resident_module_patterns: Vec<String> = Vec::new(), "RESIDENT_MODULE_PATTERNS",
        unsupported = "ddo chooses resident units itself (the repeated blocks of the module tree); use always_resident_modules_pattern to keep modules on the device";
    /// The peer library's order of resident-module candidates under the budget.
    resident_module_selection: Selection = Selection::Spread, "RESIDENT_MODULE_SELECTION",
        unsupported = "ddo chooses resident units itself (the repeated blocks of the module tree); use always_resident_modules_pattern to keep modules on the device";
    /// On the linear route, tensors up to this size (KiB) are packed together into one host
    /// buffer per unit so a unit uploads in few copies (0 = pack nothing).
    small_tensor_threshold_kb: u32 = 1024, "SMALL_TENSOR_THRESHOLD_KB";
    /// Streamed units kept in flight ahead of execution (0 to 16).
    prefetch_depth: u32 = 2, "PREFETCH_DEPTH";
    /// The peer library's reclaim of idle execution-slot backing.
    vmm_execution_backing_reclaim: bool = false, "VMM_EXECUTION_BACKING_RECLAIM",
        unsupported = "call result.reclaim() to release idle slot memory";
    /// Print what ddo does.
    verbose: bool = false, "VERBOSE";
    /// Print the profile after runs.
    show_profile: bool = false, "SHOW_PROFILE";
    /// The peer library's layer classes whose weights it streams.
    target_module_classes: Vec<String> = vec!["Linear".to_owned(), "Embedding".to_owned()], "TARGET_MODULE_CLASSES",
        unsupported = "ddo streams every parameter of each block whatever its layer class; choose blocks with vmm_module_pattern and keep modules on the device with always_resident_modules_pattern";
    /// The peer library's way of running a streamed layer.
    linear_runtime_strategy: LinearRuntimeStrategy = LinearRuntimeStrategy::Functional, "LINEAR_RUNTIME_STRATEGY",
        unsupported = "ddo publishes arena views as the parameters, so layers run their own forward on them";
    /// Streams the convolution weights of a component without repeated blocks (a VAE) layer by
    /// layer: the `linear_convolution` route.
    linear_convolution_offload: bool = false, "LINEAR_CONVOLUTION_OFFLOAD";
    /// A named capacity profile: its recommended GPU budget applies when no budget is set.
    profile_name: String = String::new(), "PROFILE_NAME";
    /// Measure this run (`result.profile_run()`) and record it under `profile_name`.
    build_profile: bool = false, "BUILD_PROFILE";
    /// GPU memory (GiB) a profile's recommendation leaves free.
    profile_vram_headroom_gb: f64 = 1.0, "PROFILE_VRAM_HEADROOM_GB";
    /// A GPU budget (GiB) taken from a profile (set when one is applied).
    profile_resident_module_budget_gb: f64 = 0.0, "PROFILE_RESIDENT_MODULE_BUDGET_GB";
    /// The peer library's process-wide plan cache. ddo plans each attach (planning is cheap) and
    /// records the value.
    cache_plan: bool = true, "CACHE_PLAN";
    /// The peer library's override of observed host RAM (GiB).
    available_system_ram_gb: f64 = 0.0, "AVAILABLE_SYSTEM_RAM_GB",
        unsupported = "ddo's host admission observes MemAvailable, the cgroup and rlimits itself before every growth; keep more memory free with system_ram_headroom_gb";
    /// The peer library's namespace of its pinned-copy cache.
    pinned_weight_cache_namespace: String = String::new(), "PINNED_WEIGHT_CACHE_NAMESPACE",
        unsupported = "ddo registers host tensors in place up to pin_weight_budget_gb; there is no cache of pinned copies to name";
    /// The peer library's registered host ring. ddo's native route always uses its registered
    /// transport, so both values are accepted.
    vmm_native_transport: bool = false, "VMM_NATIVE_TRANSPORT";
    /// The peer library's whole-component ownership. ddo's native route owns every parameter of
    /// the component, so both values are accepted.
    vmm_component_tensor_ownership: bool = false, "VMM_COMPONENT_TENSOR_OWNERSHIP";
    /// The peer library's batching of non-Linear block parameters. ddo streams every parameter of
    /// a block with it, so both values are accepted.
    vmm_execution_auxiliary_ownership: bool = false, "VMM_EXECUTION_AUXILIARY_OWNERSHIP";
    /// The peer library's device bytes (MiB) for component buffers.
    vmm_component_buffer_limit_mb: u32 = 1, "VMM_COMPONENT_BUFFER_LIMIT_MB",
        unsupported = "ddo keeps module buffers on the execution device, outside the weight budget";
    /// The peer library's arena page size (MiB).
    vmm_page_mb: u32 = 0, "VMM_PAGE_MB",
        unsupported = "the arena maps memory in the device's allocation granularity";
    /// The peer library's TorchAO fp8 weight-only route.
    vmm_float8_weight_only: bool = false, "VMM_FLOAT8_WEIGHT_ONLY",
        unsupported = "ddo streams fp8 checkpoints as stored and widens them on the device (dtype_conversion)";
    /// The peer library's registration of CPU weights (GiB).
    vmm_host_cache_gb: f64 = 0.0, "VMM_HOST_CACHE_GB",
        unsupported = "ddo registers host weights in place up to pin_weight_budget_gb (linear route) or vmm_source_registered_gb (native route)";
    /// The peer library's micro source cache slot size (MiB).
    vmm_native_source_cache_slot_mb: u32 = 0, "VMM_NATIVE_SOURCE_CACHE_SLOT_MB",
        unsupported = "retained source memory is sized by vmm_source_cache_gb";
    /// The peer library's micro source cache slot count.
    vmm_native_source_cache_slots: u32 = 0, "VMM_NATIVE_SOURCE_CACHE_SLOTS",
        unsupported = "retained source memory is sized by vmm_source_cache_gb";
    /// The peer library's pinning of CPU weights on its disk route.
    vmm_pin_source_weights: bool = false, "VMM_PIN_SOURCE_WEIGHTS",
        unsupported = "the disk route (vmm_runtime) reads into registered staging buffers sized by vmm_staging_buffer_gb; vmm_source_cache_gb retains and registers checkpoint bytes";
    /// The peer library's temporary-tensor fallback on its disk route.
    vmm_fault_fallback: bool = false, "VMM_FAULT_FALLBACK",
        unsupported = "ddo's arena never falls back to temporary tensors: the disk route (vmm_runtime) uploads every unit from its staging buffers";
    /// The peer library's Windows read chunk (MiB).
    vmm_windows_file_read_chunk_mb: u32 = 2, "VMM_WINDOWS_FILE_READ_CHUNK_MB",
        unsupported = "ddo runs on Linux";
    /// The peer library's Windows staging transport.
    vmm_virtual_host_transport: bool = false, "VMM_VIRTUAL_HOST_TRANSPORT",
        unsupported = "ddo runs on Linux";
    /// The peer library's Windows DXGI local reserve (GiB).
    vmm_dxgi_local_headroom_gb: f64 = 0.0, "VMM_DXGI_LOCAL_HEADROOM_GB",
        unsupported = "ddo runs on Linux";
    /// The peer library's Windows DXGI shared reserve (GiB).
    vmm_dxgi_shared_headroom_gb: f64 = 0.0, "VMM_DXGI_SHARED_HEADROOM_GB",
        unsupported = "ddo runs on Linux";
    /// The peer library's Windows DXGI system reserve (GiB).
    vmm_dxgi_system_headroom_gb: f64 = 0.0, "VMM_DXGI_SYSTEM_HEADROOM_GB",
        unsupported = "ddo runs on Linux";
}

/// Variables accepted under a second name.
pub const ENV_ALIASES: &[(&str, &str)] = &[
    ("LOAD_SAFETENSORS_BACKEND", "SAFETENSORS_BACKEND"),
    // The field's own name, beside the published library's variable.
    ("ALWAYS_RESIDENT_MODULE_PATTERNS", "ALWAYS_RESIDENT_MODULES_PATTERN"),
];

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
