//! Sections of the host's phase helpers (each its own observation route), the execution timer
//! and named capacity profiles. Every value is what the helper measured or did; a helper that
//! did nothing says so in `status`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The execution timer's snapshot (`runtime.execution_timing`, timing schema version 1).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ExecutionTiming {
    /// Layout version of this section (1).
    pub schema_version: u32,
    /// `cuda_event` (events on the compute stream) or `host_perf_counter` (host backend).
    pub clock: String,
    /// `seconds`.
    pub unit: String,
    /// What the clock covers: `compute_stream_with_dependencies` or `host_thread`.
    pub scope: String,
    /// Whether the timed block raised.
    #[serde(default)]
    pub failed: bool,
    /// `disabled`, `not_finished`, `pending` (the GPU has not reached the end) or `complete`.
    pub status: String,
    /// The CUDA stream the events were recorded on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<u64>,
    /// The whole timed block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase_seconds: Option<f64>,
    /// Each step, between step marks (the first from the start).
    #[serde(default)]
    pub step_seconds: Vec<f64>,
    /// From the last step mark to the end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tail_seconds: Option<f64>,
    /// Mean of the steps after the first (two steps or more).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steady_state_seconds_per_step: Option<f64>,
    /// Step marks recorded.
    #[serde(default)]
    pub step_count: u64,
    /// Host waits for each step's completion, when asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diagnostic_step_wait: Option<DiagnosticStepWait>,
}

/// Host waits at step marks: they change the run's overlap, so such a run is never a benchmark.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DiagnosticStepWait {
    /// Whether the timer waited at each mark.
    pub enabled: bool,
    /// What was waited for.
    pub scope: String,
    /// Waits done.
    pub calls: u64,
    /// Host time spent waiting.
    pub host_seconds: f64,
    /// Always false.
    pub benchmark_eligible: bool,
}

/// Route `pytorch_host_cache_release`: PyTorch's pinned host cache given back to the driver.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct HostCacheRelease {
    /// The host's phase label.
    #[serde(default)]
    pub phase: String,
    /// `disabled`, `cuda_not_initialized`, `unsupported` or `released`.
    pub status: String,
    /// Why it was unsupported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The device synchronized.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Whether the device was synchronized (once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub synchronized: Option<bool>,
    /// Bytes PyTorch's pinned host allocator held before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator_bytes_before: Option<u64>,
    /// ... and after.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator_bytes_after: Option<u64>,
    /// After minus before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator_bytes_delta: Option<i64>,
}

/// Route `native_vmm_idle_cache_release`: idle execution slots of ddo's components released.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct IdleCacheRelease {
    /// The host's phase label.
    #[serde(default)]
    pub phase: String,
    /// `disabled`, `cuda_not_initialized` or `completed`.
    pub status: String,
    /// Why an optional part was not done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The device whose components were visited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Whether the device was synchronized (once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub synchronized: Option<bool>,
    /// Components whose idle slots were released.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sessions: Option<u64>,
    /// Components skipped because they are unloaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unloaded_sessions: Option<u64>,
    /// Slots whose backing was released.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots_released: Option<u64>,
    /// Device bytes released.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_released: Option<u64>,
    /// Whether cuBLAS workspaces were freed (when asked for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cublas_workspaces_cleared: Option<bool>,
}

/// Route `vmm_auxiliary_source_detachment`: CPU tensors of a native-route component taken off
/// the checkpoint's mapping.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AuxiliaryDetachment {
    /// `disabled`, `not_applicable`, `unsupported`, `nothing_to_detach` or `detached`.
    pub status: String,
    /// Why it did not apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The copy cap, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_copy_bytes: Option<u64>,
    /// Bytes copied into private memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copied_bytes: Option<u64>,
    /// Storages copied (aliases share one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copied_storage_groups: Option<u64>,
    /// Module tensors given their copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copied_tensor_owners: Option<u64>,
    /// References to loaded host tensors ddo no longer keeps (never read on this route).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropped_references: Option<u64>,
    /// Module tensors still inside a mapping of the checkpoint afterwards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mapped_module_tensors_after: Option<u64>,
    /// Parameters found inside the mapping and left alone (not arena views).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unmanaged_mapped_parameters: Option<u64>,
    /// Bytes of private mappings of the checkpoint (a loader's) before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loader_mapping_bytes_before: Option<u64>,
    /// ... and after (0 once nothing holds them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loader_mapping_bytes_after: Option<u64>,
    /// Always false: only host tensors change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_placement_changed: Option<bool>,
    /// Always false: a host commit recovery is not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit_recovery_proven: Option<bool>,
}

/// What a named capacity profile did at attach (`setup.capacity_profile`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CapacityProfileSetup {
    /// The profile's name.
    pub name: String,
    /// `applied`, `building`, `recorded`, `explicit_budget`, `not_found`, `device_changed` or
    /// `not_applicable`.
    pub status: String,
    /// The profile's key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The profile's file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The budget setting it sizes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setting: Option<String>,
    /// The budget the component attached with, GiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_gb: Option<f64>,
    /// The stored (or just recorded) recommendation, GiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recommended_budget_gb: Option<f64>,
    /// The measured peak of device memory in use, bytes (after a build).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_bytes: Option<u64>,
    /// Device memory that stayed free beyond the headroom, bytes (after a build).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_margin_bytes: Option<u64>,
}

/// What the automatic GPU budget did (`setup.auto_budget`, `auto_budget_policy = balanced`): the
/// arena's budget is the device's free memory plus the arena's own, less the headroom, measured
/// after a pass (the working set PyTorch keeps is not free), and planned again after the first
/// pass and whenever free memory falls below half the headroom.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AutoBudgetSetup {
    /// The policy (`balanced`).
    pub policy: String,
    /// Device memory kept free beyond the working set, bytes.
    pub headroom_bytes: u64,
    /// Times the arena was planned again under a new budget.
    pub replans: u64,
    /// The arena's budget now, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_bytes: Option<u64>,
    /// Free device memory measured after the last deciding pass, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_bytes: Option<u64>,
    /// The last decision: why the budget changed, or why it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<String>,
}
