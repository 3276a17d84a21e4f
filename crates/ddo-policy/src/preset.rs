//! Presets: named sets of setting values, and how they map to backends and execution modes.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::value::{SettingValue, choice};
use crate::{ConfigError, Origin};

choice! {
    /// A named preset. `auto` resolves per backend: `one_shot_fast` on linear, `vmm_fast` on vmm.
    Preset {
        /// Resolves per backend.
        Auto = "auto",
        /// Linear route, registered host copies, nothing resident beyond the execution slots.
        OneShotFast = "one_shot_fast",
        /// Linear route, no registration, a small resident budget.
        LowRamSafe = "low_ram_safe",
        /// Linear route for WSL: no registration, no group-offload streams.
        WslCompat = "wsl_compat",
        /// Linear route for a long-lived process: registered host copies, a larger resident
        /// budget, the VAE resident.
        WarmProcess = "warm_process",
        /// Native route reading weights from disk every pass, bounded host memory.
        NvmeBaseline = "nvme_baseline",
        /// The native arena route.
        VmmFast = "vmm_fast",
        /// No offload: the caller owns placement.
        Off = "off",
        /// Diffusers' block-level group offload for the transformer.
        DiffusersOffloadCompat = "diffusers_offload_compat",
        /// Diffusers' leaf-level group offload for the transformer.
        DiffusersLeafOffloadCompat = "diffusers_leaf_offload_compat"
    }
}

choice! {
    /// The offload backend a host selects (`--ddo-backend`).
    Backend {
        /// The arena fed by a module's own host tensors.
        Linear = "linear",
        /// The arena fed by the checkpoint (its mapping, retained windows or reads).
        Vmm = "vmm"
    }
}

choice! {
    /// What the dynamic-offload runtime does for a component.
    ExecutionMode {
        /// Plan only: nothing is streamed (offload disabled).
        Plan = "plan",
        /// The linear runtime.
        LinearRuntime = "linear_runtime",
        /// The native disk route.
        VmmRuntime = "vmm_runtime",
        /// The native arena route.
        VmmFastRuntime = "vmm_fast_runtime"
    }
}

impl Preset {
    /// Parses a preset name (trimmed, case-insensitive); an unknown name lists the valid ones.
    pub fn parse(value: &str, origin: Origin) -> Result<Preset, ConfigError> {
        Preset::parse_text(value).ok_or_else(|| ConfigError::UnknownPreset {
            value: value.to_owned(),
            origin,
            valid: Preset::allowed(),
        })
    }

    /// Whether this preset belongs to the vmm backend.
    pub const fn is_native(self) -> bool {
        matches!(self, Preset::VmmFast | Preset::NvmeBaseline)
    }

    /// The execution mode the (resolved) preset selects.
    pub const fn execution_mode(self) -> ExecutionMode {
        match self {
            Preset::Off | Preset::DiffusersOffloadCompat | Preset::DiffusersLeafOffloadCompat => {
                ExecutionMode::Plan
            }
            Preset::Auto
            | Preset::OneShotFast
            | Preset::LowRamSafe
            | Preset::WslCompat
            | Preset::WarmProcess => ExecutionMode::LinearRuntime,
            Preset::NvmeBaseline => ExecutionMode::VmmRuntime,
            Preset::VmmFast => ExecutionMode::VmmFastRuntime,
        }
    }

    /// The preset's value table: `(KEY, value)` pairs, keys without the `DDO_` prefix. Keys that
    /// name a setting feed that setting; `RUNNER_<COMPONENT>_*` keys feed component routes; the
    /// remaining host hints (`RUNNER_ATTENTION_BACKEND`, ...) are kept for hosts and not acted on.
    /// Native presets never inherit linear preset values. Tables set only settings ddo implements
    /// (see [`crate::UNSUPPORTED_SETTINGS`]), so every preset resolves.
    pub const fn values(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Preset::Auto | Preset::OneShotFast => ONE_SHOT_FAST,
            Preset::LowRamSafe => LOW_RAM_SAFE,
            Preset::WslCompat => WSL_COMPAT,
            Preset::WarmProcess => WARM_PROCESS,
            Preset::NvmeBaseline => NVME_BASELINE,
            Preset::VmmFast => VMM_FAST,
            Preset::Off => OFF,
            Preset::DiffusersOffloadCompat => DIFFUSERS_OFFLOAD_COMPAT,
            Preset::DiffusersLeafOffloadCompat => DIFFUSERS_LEAF_OFFLOAD_COMPAT,
        }
    }

    /// The value of `key` in this preset's table.
    pub fn value(self, key: &str) -> Option<&'static str> {
        self.values().iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
    }
}

/// Resolves a requested backend and preset to the effective preset and execution mode.
///
/// - linear + any linear preset: that preset (`auto` = `one_shot_fast`), linear_runtime (or plan
///   for `off` and the Diffusers compatibility presets);
/// - vmm + `auto` = `vmm_fast` (vmm_fast_runtime); vmm + `nvme_baseline` (vmm_runtime); vmm +
///   `vmm_fast` is accepted as the name `auto` resolves to;
/// - every other pair is an error that says which backend the preset needs.
pub fn resolve_backend(backend: Backend, preset: Preset) -> Result<Preset, ConfigError> {
    match (backend, preset) {
        (Backend::Linear, Preset::Auto) => Ok(Preset::OneShotFast),
        (Backend::Linear, p) if p.is_native() => Err(ConfigError::PresetNotForBackend {
            backend: Backend::Linear.to_string(),
            preset: p.to_string(),
            allowed: linear_presets(),
            hint: format!("preset {p} needs --ddo-backend vmm"),
        }),
        (Backend::Linear, p) => Ok(p),
        (Backend::Vmm, Preset::Auto | Preset::VmmFast) => Ok(Preset::VmmFast),
        (Backend::Vmm, Preset::NvmeBaseline) => Ok(Preset::NvmeBaseline),
        (Backend::Vmm, p) => Err(ConfigError::PresetNotForBackend {
            backend: Backend::Vmm.to_string(),
            preset: p.to_string(),
            allowed: "auto, nvme_baseline, vmm_fast".into(),
            hint: format!("use --ddo-backend linear for preset {p}"),
        }),
    }
}

fn linear_presets() -> String {
    Preset::ALL.iter().filter(|p| !p.is_native()).map(|p| p.as_str()).collect::<Vec<_>>().join(", ")
}

const TEXT_ENCODER_LEAF: [(&str, &str); 2] = [
    ("RUNNER_TEXT_ENCODER_GROUP_OFFLOAD", "1"),
    ("RUNNER_TEXT_ENCODER_OFFLOAD_TYPE", "leaf_level"),
];

const OFF: &[(&str, &str)] = &[("EXECUTION_MODE", "plan"), ("PLAN", "0")];

const DIFFUSERS_LEAF_OFFLOAD_COMPAT: &[(&str, &str)] = &[
    ("EXECUTION_MODE", "plan"),
    ("PLAN", "0"),
    TEXT_ENCODER_LEAF[0],
    TEXT_ENCODER_LEAF[1],
    ("RUNNER_TEXT_ENCODER_OFFLOAD_STREAM", "1"),
    ("RUNNER_TEXT_ENCODER_DYNAMIC_OFFLOAD", "0"),
    ("RUNNER_TRANSFORMER_MEMORY_MANAGER", "off"),
    ("RUNNER_TRANSFORMER_GROUP_OFFLOAD", "1"),
    ("RUNNER_TRANSFORMER_OFFLOAD_TYPE", "leaf_level"),
    ("RUNNER_TRANSFORMER_OFFLOAD_STREAM", "1"),
    ("RUNNER_TRANSFORMER_OFFLOAD_RECORD_STREAM", "1"),
    ("RUNNER_TRANSFORMER_OFFLOAD_LOW_CPU_MEM_USAGE", "1"),
    ("RUNNER_ATTENTION_BACKEND", "native"),
    ("RUNNER_PRE_VAE_CLEANUP_REPEATS", "1"),
];

const DIFFUSERS_OFFLOAD_COMPAT: &[(&str, &str)] = &[
    ("EXECUTION_MODE", "plan"),
    ("PLAN", "0"),
    TEXT_ENCODER_LEAF[0],
    TEXT_ENCODER_LEAF[1],
    ("RUNNER_TEXT_ENCODER_OFFLOAD_STREAM", "1"),
    ("RUNNER_TEXT_ENCODER_DYNAMIC_OFFLOAD", "0"),
    ("RUNNER_TRANSFORMER_MEMORY_MANAGER", "off"),
    ("RUNNER_TRANSFORMER_GROUP_OFFLOAD", "1"),
    ("RUNNER_TRANSFORMER_OFFLOAD_TYPE", "block_level"),
    ("RUNNER_TRANSFORMER_NUM_BLOCKS_PER_GROUP", "1"),
    ("RUNNER_TRANSFORMER_OFFLOAD_STREAM", "1"),
    ("RUNNER_TRANSFORMER_OFFLOAD_RECORD_STREAM", "1"),
    ("RUNNER_TRANSFORMER_OFFLOAD_LOW_CPU_MEM_USAGE", "1"),
    ("RUNNER_ATTENTION_BACKEND", "native"),
    ("RUNNER_PRE_VAE_CLEANUP_REPEATS", "1"),
];

const ONE_SHOT_FAST: &[(&str, &str)] = &[
    ("EXECUTION_MODE", "linear_runtime"),
    ("PIN_CPU_MEMORY", "1"),
    ("ALLOW_PIN_MEMORY_FALLBACK", "1"),
    ("PIN_CPU_WORKERS", "4"),
    ("SYSTEM_RAM_HEADROOM_GB", "8"),
    ("RESIDENT_MODULE_BUDGET_GB", "0"),
    ("SMALL_TENSOR_THRESHOLD_KB", "1024"),
    // Four slots: on the H200 the Flux-shaped model streamed at 1.023x its copy floor with
    // four and 1.03-1.04x with three (bench_gpu.py, linear variant).
    ("PREFETCH_DEPTH", "3"),
    TEXT_ENCODER_LEAF[0],
    TEXT_ENCODER_LEAF[1],
    ("RUNNER_TEXT_ENCODER_OFFLOAD_STREAM", "1"),
    ("RUNNER_TEXT_ENCODER_DYNAMIC_OFFLOAD", "0"),
    ("RUNNER_TRANSFORMER_MEMORY_MANAGER", "off"),
    ("RUNNER_TRANSFORMER_GROUP_OFFLOAD", "0"),
    ("RUNNER_ATTENTION_BACKEND", "native"),
    ("RUNNER_PRE_VAE_CLEANUP_REPEATS", "1"),
    ("PURGE_WINDOWS_STANDBY_BEFORE_RUN", "1"),
    ("PURGE_WINDOWS_STANDBY_AFTER_TEXT_ENCODER", "1"),
    ("PURGE_WINDOWS_STANDBY_BEFORE_TRANSFORMER", "1"),
];

const WSL_COMPAT: &[(&str, &str)] = &[
    ("EXECUTION_MODE", "linear_runtime"),
    ("PIN_CPU_MEMORY", "0"),
    ("ALLOW_PIN_MEMORY_FALLBACK", "1"),
    ("DISABLE_PIN_ON_WSL", "1"),
    ("PIN_CPU_WORKERS", "1"),
    ("RESIDENT_MODULE_BUDGET_GB", "6"),
    ("SMALL_TENSOR_THRESHOLD_KB", "1024"),
    TEXT_ENCODER_LEAF[0],
    TEXT_ENCODER_LEAF[1],
    ("RUNNER_TEXT_ENCODER_OFFLOAD_STREAM", "0"),
    ("RUNNER_TRANSFORMER_MEMORY_MANAGER", "off"),
    ("RUNNER_TRANSFORMER_GROUP_OFFLOAD", "0"),
    ("RUNNER_ATTENTION_BACKEND", "native"),
    ("RUNNER_PRE_VAE_CLEANUP_REPEATS", "3"),
];

const WARM_PROCESS: &[(&str, &str)] = &[
    ("EXECUTION_MODE", "linear_runtime"),
    ("PIN_CPU_MEMORY", "1"),
    ("ALLOW_PIN_MEMORY_FALLBACK", "1"),
    ("PIN_CPU_WORKERS", "4"),
    ("RESIDENT_MODULE_BUDGET_GB", "6"),
    ("SMALL_TENSOR_THRESHOLD_KB", "1024"),
    ("PREFETCH_DEPTH", "3"),
    TEXT_ENCODER_LEAF[0],
    TEXT_ENCODER_LEAF[1],
    ("RUNNER_TEXT_ENCODER_OFFLOAD_STREAM", "1"),
    ("RUNNER_TEXT_ENCODER_DYNAMIC_OFFLOAD", "0"),
    ("RUNNER_TRANSFORMER_MEMORY_MANAGER", "off"),
    ("RUNNER_TRANSFORMER_GROUP_OFFLOAD", "0"),
    ("RUNNER_ATTENTION_BACKEND", "native"),
    ("RUNNER_GENERATION_REPEATS", "2"),
];

const LOW_RAM_SAFE: &[(&str, &str)] = &[
    ("EXECUTION_MODE", "linear_runtime"),
    ("PIN_CPU_MEMORY", "0"),
    ("ALLOW_PIN_MEMORY_FALLBACK", "1"),
    ("PIN_CPU_WORKERS", "1"),
    ("RESIDENT_MODULE_BUDGET_GB", "3"),
    ("SMALL_TENSOR_THRESHOLD_KB", "1024"),
    TEXT_ENCODER_LEAF[0],
    TEXT_ENCODER_LEAF[1],
    ("RUNNER_TEXT_ENCODER_OFFLOAD_STREAM", "0"),
    ("RUNNER_TEXT_ENCODER_DYNAMIC_OFFLOAD", "0"),
    ("RUNNER_TRANSFORMER_MEMORY_MANAGER", "off"),
    ("RUNNER_TRANSFORMER_GROUP_OFFLOAD", "0"),
    ("RUNNER_ATTENTION_BACKEND", "native"),
];

const VMM_FAST: &[(&str, &str)] = &[
    ("EXECUTION_MODE", "vmm_fast_runtime"),
    ("VMM_RESIDENT_WEIGHT_BUDGET_GB", "4"),
    // Four slots kept streaming overlapped with compute within 1.2% on the H200 where three
    // slots reached 1.3-3.7% (stream_gemm --bench).
    ("PREFETCH_DEPTH", "3"),
    ("LOAD_SAFETENSORS_BACKEND", "mmap"),
    TEXT_ENCODER_LEAF[0],
    TEXT_ENCODER_LEAF[1],
    ("RUNNER_TEXT_ENCODER_OFFLOAD_STREAM", "1"),
];

const NVME_BASELINE: &[(&str, &str)] = &[
    ("EXECUTION_MODE", "vmm_runtime"),
    ("VMM_RESIDENT_WEIGHT_BUDGET_GB", "4"),
    ("PREFETCH_DEPTH", "1"),
    ("LOAD_SAFETENSORS_BACKEND", "direct"),
    TEXT_ENCODER_LEAF[0],
    TEXT_ENCODER_LEAF[1],
    ("RUNNER_TEXT_ENCODER_OFFLOAD_STREAM", "1"),
];

/// What a preset does with a component named `vae` when nothing explicit says otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum VaeDefault {
    /// Diffusers leaf-level group offload without a stream, low_cpu_mem_usage off.
    LeafOffloadWithoutStream,
    /// Kept resident on the execution device.
    Resident,
    /// Left unmanaged (the caller owns placement).
    Unmanaged,
    /// No VAE rule: the generic `auto` route rule applies.
    Generic,
}

impl Preset {
    /// The VAE default of the resolved preset.
    pub const fn vae_default(self) -> VaeDefault {
        match self {
            Preset::Auto | Preset::OneShotFast | Preset::LowRamSafe | Preset::VmmFast => {
                VaeDefault::LeafOffloadWithoutStream
            }
            Preset::WarmProcess | Preset::WslCompat | Preset::NvmeBaseline => VaeDefault::Resident,
            Preset::Off => VaeDefault::Unmanaged,
            Preset::DiffusersOffloadCompat | Preset::DiffusersLeafOffloadCompat => {
                VaeDefault::Generic
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_table_parses_its_execution_mode() {
        for p in Preset::ALL {
            let mode = p.value("EXECUTION_MODE");
            match p {
                Preset::Auto => assert_eq!(mode, Some("linear_runtime")),
                _ => assert_eq!(mode, Some(p.execution_mode().as_str()), "{p}"),
            }
        }
    }

    #[test]
    fn no_preset_sets_an_unsupported_setting() {
        for p in Preset::ALL {
            for (key, _) in p.values() {
                let field = crate::SETTING_KEYS.iter().find(|(_, k)| k == key).map(|(f, _)| *f);
                assert!(
                    !crate::UNSUPPORTED_SETTINGS.iter().any(|(u, _)| Some(*u) == field),
                    "{p} sets {key}"
                );
            }
        }
    }

    #[test]
    fn unknown_preset_lists_valid_names() {
        let err = Preset::parse("fastest", Origin::Env("DDO_PRESET".into())).unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown preset \"fastest\" (from DDO_PRESET); valid presets: auto, one_shot_fast, low_ram_safe, wsl_compat, warm_process, nvme_baseline, vmm_fast, off, diffusers_offload_compat, diffusers_leaf_offload_compat"
        );
    }
}
