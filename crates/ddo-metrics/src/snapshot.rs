//! The snapshot and its sections.

use std::collections::BTreeMap;

use ddo_core::HostMemoryObservation;

use crate::phases::{
    AutoBudgetSetup, AuxiliaryDetachment, CapacityProfileSetup, ExecutionTiming, HostCacheRelease,
    IdleCacheRelease,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Version of the snapshot layout. It changes when a field changes meaning or is removed.
/// Version 2: `route` is the published library's route string (`dynamic_offload`,
/// `diffusers_group_offload`, `none`, or an observation) and ddo's detail moved to `execution`;
/// version 1 had the detail under `route`, and still reads.
pub const SCHEMA_VERSION: u32 = 2;

/// The published route of one of ddo's runtime routes: every route that streams through ddo's
/// arena is `dynamic_offload`; the others keep their name.
pub fn published_route(route: &str) -> &str {
    match route {
        "linear_runtime" | "linear_convolution" | "vmm_fast_runtime" | "vmm_runtime" => {
            "dynamic_offload"
        }
        other => other,
    }
}

/// Which of ddo's routes, component, backend and preset produced the snapshot (ddo's addition
/// beside the published `route`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ExecutionSection {
    /// ddo's route (`linear_runtime`, `vmm_fast_runtime`, `vmm_runtime`,
    /// `diffusers_group_offload`, `none`).
    pub route: String,
    /// The component (`transformer`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub component: Option<String>,
    /// The backend (`linear`, `vmm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// The preset as requested.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_preset: Option<String>,
    /// The preset after resolution.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effective_preset: Option<String>,
    /// The execution mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution_mode: Option<String>,
}

/// Diffusers group-offload parameters as applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GroupOffloadSetup {
    /// `leaf_level` or `block_level`.
    pub offload_type: String,
    /// Side-stream copies.
    pub use_stream: bool,
    /// Diffusers `record_stream`.
    pub record_stream: bool,
    /// Diffusers `low_cpu_mem_usage`.
    pub low_cpu_mem_usage: bool,
    /// Blocks per group (block_level only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_blocks_per_group: Option<u32>,
}

macro_rules! optional_section {
    ($(#[$meta:meta])* $name:ident { $($(#[doc = $doc:literal])* $field:ident : $ty:ty,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
        pub struct $name {
            $(
                $(#[doc = $doc])*
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub $field: Option<$ty>,
            )*
        }

        impl $name {
            /// Names of the fields that are present.
            pub fn present(&self) -> Vec<&'static str> {
                let mut out = Vec::new();
                $( if self.$field.is_some() { out.push(stringify!($field)); } )*
                out
            }
        }
    };
}

optional_section! {
    /// What attaching the route did.
    SetupSection {
        /// Modules walked.
        module_count: u64,
        /// Tensors managed.
        tensor_count: u64,
        /// Bytes of all managed weights.
        total_bytes: u64,
        /// Wall time of the attach, seconds.
        setup_seconds: f64,
        /// Of it, opening the source (headers, host tier, retained windows or staging,
        /// conversion and encoding at load), seconds.
        source_seconds: f64,
        /// Bytes of the checkpoint's mapping read in before registration: a cold file is
        /// read from disk here, on many threads, in large requests.
        read_in_bytes: u64,
        /// Seconds the read-in took; it overlaps registration (each range is registered as
        /// soon as it is read in, while the next is read).
        read_in_seconds: f64,
        /// Seconds registration took, waits for the read-in included.
        registration_seconds: f64,
        /// Seconds the resident units took to upload.
        resident_upload_seconds: f64,
        /// Execution units found.
        unit_count: u64,
        /// Units kept resident on the device.
        resident_units: u64,
        /// Units streamed each pass.
        streamed_units: u64,
        /// Execution slots streamed units take turns in.
        execution_slots: u64,
        /// Bytes of one execution slot.
        slot_bytes: u64,
        /// GPU budget of the arena (resident units + slots), bytes.
        gpu_budget_bytes: u64,
        /// GPU memory kept free for activations, bytes.
        headroom_bytes: u64,
        /// Bytes uploaded per pass (the streamed units).
        streamed_bytes_per_pass: u64,
        /// Link speed the plan assumes, bytes per second.
        link_bytes_per_second: f64,
        /// Streamed bytes / link speed: the copy floor of one pass, seconds.
        expected_copy_floor_seconds: f64,
        /// Host bytes pinned for copies.
        pinned_bytes: u64,
        /// Host bytes registered for DMA.
        registered_bytes: u64,
        /// Host bytes retained by the source store.
        retained_bytes: u64,
        /// Checkpoint bytes the retained store could not hold (read on demand).
        unretained_bytes: u64,
        /// Host bytes copied unregistered (slower copies, same bytes).
        unregistered_bytes: u64,
        /// Why some host bytes stayed unregistered (the first reason).
        unregistered_reason: String,
        /// Threads reading checkpoint bytes (retained windows or reads on demand).
        read_workers: u64,
        /// Bytes of small tensors packed per unit so it uploads in few copies.
        packed_bytes: u64,
        /// Host bytes of the staging buffers disk reads land in (allocated once).
        staging_bytes: u64,
        /// Staging buffers.
        staging_buffers: u64,
        /// How staging reads the disk: `direct` (O_DIRECT) or `pread`.
        staging_read: String,
        /// Where checkpoint tensors stored in another dtype than their parameters' are
        /// converted: `host` (once at load, into retained memory), `device` (streamed in the
        /// checkpoint's dtype, converted on the GPU after each upload), or `host+device`.
        conversion: String,
        /// Tensors converted to their parameters' dtypes (at load and on the device).
        converted_tensors: u64,
        /// Of those, the tensors converted on the device after each upload.
        device_converted_tensors: u64,
        /// Checkpoint bytes read for conversion, in the checkpoint's dtypes.
        conversion_source_bytes: u64,
        /// Bytes the converted tensors take in the parameters' dtypes.
        converted_bytes: u64,
        /// Seconds conversion took.
        conversion_seconds: f64,
        /// Entropy-coded streaming (`vmm_weight_encoding`): `off`, or what was encoded and why
        /// (`on`, `auto: transfer-bound`), or why nothing was (`auto: no decoder on this device`).
        weight_encoding: String,
        /// Tensors streamed encoded and decoded on the device.
        encoded_tensors: u64,
        /// Their bytes as served (bf16).
        encoding_source_bytes: u64,
        /// Bytes of their encodings, retained in host memory.
        encoded_bytes: u64,
        /// Seconds encoding took at load (0 when read from an encoded file).
        encoding_seconds: f64,
        /// The encoded file the encodings were read from or written to, when one is used.
        encoded_file: String,
        /// The GPU whose memory holds streamed units (`vmm_peer_store_device`), when it does.
        peer_store_device: String,
        /// Streamed units held there, streamed over the peer link.
        peer_store_units: u64,
        /// Their bytes in the peer's memory.
        peer_store_bytes: u64,
        /// Streamed units left to host memory (beyond `vmm_peer_store_gb`).
        peer_store_host_units: u64,
        /// Where each unit's weights come from, as unit-id ranges per tier: `device`
        /// (resident), `peer` (the peer weight store), and the host tier feeding the rest
        /// (`mapping`, `retained`, `disk`, ...): `device=0-3,5 mapping=4,6-9`.
        unit_tiers: String,
        /// The peer link's copy speed measured at attach, bytes per second (two devices).
        peer_link_bytes_per_second: f64,
        /// Where uploads read host bytes: `mapping`, `retained`, `reads`, `disk`, `host_tensors`.
        host_source: String,
        /// Why the host tier was chosen (mapping, retained windows or disk) from what host
        /// memory admits, or that a setting chose it.
        host_tier_reason: String,
        /// The device the component runs on (`cuda:0`, `cpu`).
        execution_device: String,
        /// What the host should know (misspelt variables, fallbacks).
        warnings: Vec<String>,
        /// Tensors bound to checkpoint slices.
        source_bound_tensors: u64,
        /// Diffusers group-offload parameters (compatibility route).
        group_offload: GroupOffloadSetup,
        /// Who places the component (route none): `resident` or `unmanaged`.
        placement: String,
        /// What a named capacity profile did at attach.
        capacity_profile: CapacityProfileSetup,
        /// What the automatic GPU budget did.
        auto_budget: AutoBudgetSetup,
    }
}

optional_section! {
    /// What running the route did.
    RuntimeSection {
        /// Forward passes observed.
        passes: u64,
        /// Unit uploads (or weight copies on the linear route).
        uploads: u64,
        /// Bytes uploaded.
        upload_bytes: u64,
        /// Host-to-device copies the uploads took (adjacent tensors share one).
        upload_copies: u64,
        /// Tensors converted on the device after their upload (checkpoint dtype -> parameter dtype).
        device_conversions: u64,
        /// Tensors uploaded entropy-coded and decoded on the device.
        device_decodes: u64,
        /// Bytes of those encodings (part of `upload_bytes`).
        encoded_upload_bytes: u64,
        /// Bytes the decodes wrote: the link saved `decoded_bytes - encoded_upload_bytes`.
        decoded_bytes: u64,
        /// Device seconds the decodes took (their kernels, as the device timed them).
        decode_seconds: f64,
        /// Host time spent enqueuing uploads, seconds.
        upload_seconds: f64,
        /// Time compute waited for uploads, seconds.
        wait_seconds: f64,
        /// Acquisitions whose unit was already in flight or resident thanks to prefetch.
        prefetch_hits: u64,
        /// Acquisitions that had to upload on demand.
        prefetch_misses: u64,
        /// Look-ahead uploads cancelled because the order changed.
        prefetch_cancels: u64,
        /// Units evicted from a slot.
        evictions: u64,
        /// Slot backings released and recreated by explicit reclaim.
        reclaim_cycles: u64,
        /// Device bytes of resident units.
        resident_bytes: u64,
        /// Device bytes of execution slots.
        slot_bytes: u64,
        /// Peak device bytes held by the arena.
        peak_bytes: u64,
        /// Bytes kept owned (never reused) after a release that could not be proven safe.
        unsafe_retained_bytes: u64,
        /// Checkpoint bytes read from disk into staging buffers (routes that read the disk).
        disk_bytes: u64,
        /// `disk_bytes` per pass.
        disk_bytes_per_pass: u64,
        /// Seconds at least one disk read was in flight.
        disk_read_seconds: f64,
        /// `disk_bytes / disk_read_seconds`: the disk speed the route got, bytes per second.
        disk_bytes_per_second: f64,
        /// Seconds uploads waited for their bytes' disk reads to land.
        read_stall_seconds: f64,
        /// Ranges read from disk when an upload asked for them, not ahead (none read ahead in
        /// time: a first pass before the order is learned, a unit larger than a staging buffer,
        /// or no buffer given back by the device in time).
        disk_reads_on_demand: u64,
        /// Uploads copied from the peer weight store (part of `uploads`).
        peer_uploads: u64,
        /// Bytes those uploads copied over the peer link (not part of `upload_bytes`).
        peer_upload_bytes: u64,
        /// The execution timer's snapshot, attached by the host (any route).
        execution_timing: ExecutionTiming,
        /// What releasing PyTorch's pinned host cache did (its own route).
        host_cache_release: HostCacheRelease,
        /// What releasing idle execution slots did (its own route).
        idle_cache_release: IdleCacheRelease,
        /// What detaching CPU tensors from the checkpoint's mapping did (its own route).
        auxiliary_detachment: AuxiliaryDetachment,
    }
}

/// Host memory as observed, plus ddo's own host ceilings' use.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct HostMemorySection {
    /// The observation (absent fields could not be read).
    #[serde(flatten)]
    pub observation: HostMemoryObservation,
    /// When the observation was taken (`after_attach`, `after_pass`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
}

/// A versioned snapshot of one component's offload.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct DynamicOffloadMetrics {
    /// Layout version ([`SCHEMA_VERSION`]).
    pub schema_version: u32,
    /// The published route: `dynamic_offload`, `diffusers_group_offload`, `none`, or an
    /// observation such as `host_memory_observation` or `model_load`.
    pub route: String,
    /// ddo's route and what chose it (absent for observations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution: Option<ExecutionSection>,
    /// Resolved settings (`dynamic_offload_<setting>` keys).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub configuration: BTreeMap<String, serde_json::Value>,
    /// What attaching did.
    #[serde(default)]
    pub setup: SetupSection,
    /// What running did.
    #[serde(default)]
    pub runtime: RuntimeSection,
    /// Host memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory: Option<HostMemorySection>,
}

/// What deserializing accepts: this version's layout, or version 1's (`route` a mapping with
/// ddo's route as `name`).
#[derive(Deserialize)]
struct SnapshotForm {
    #[serde(default = "current_version")]
    schema_version: u32,
    route: RouteForm,
    #[serde(default)]
    execution: Option<ExecutionSection>,
    #[serde(default)]
    configuration: BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    setup: SetupSection,
    #[serde(default)]
    runtime: RuntimeSection,
    #[serde(default)]
    host_memory: Option<HostMemorySection>,
}

const fn current_version() -> u32 {
    SCHEMA_VERSION
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RouteForm {
    Published(String),
    Version1 {
        name: String,
        #[serde(default)]
        component: Option<String>,
        #[serde(default)]
        backend: Option<String>,
        #[serde(default)]
        requested_preset: Option<String>,
        #[serde(default)]
        effective_preset: Option<String>,
        #[serde(default)]
        execution_mode: Option<String>,
    },
}

impl<'de> Deserialize<'de> for DynamicOffloadMetrics {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        SnapshotForm::deserialize(d).map(Into::into)
    }
}

impl From<SnapshotForm> for DynamicOffloadMetrics {
    fn from(f: SnapshotForm) -> Self {
        let (route, execution) = match f.route {
            RouteForm::Published(route) => (route, f.execution),
            RouteForm::Version1 {
                name,
                component,
                backend,
                requested_preset,
                effective_preset,
                execution_mode,
            } => {
                let detailed = component.is_some() || backend.is_some() || execution_mode.is_some();
                let execution = detailed.then(|| ExecutionSection {
                    route: name.clone(),
                    component,
                    backend,
                    requested_preset,
                    effective_preset,
                    execution_mode,
                });
                (published_route(&name).to_owned(), execution.or(f.execution))
            }
        };
        DynamicOffloadMetrics {
            schema_version: f.schema_version,
            route,
            execution,
            configuration: f.configuration,
            setup: f.setup,
            runtime: f.runtime,
            host_memory: f.host_memory,
        }
    }
}

/// A snapshot that reports counters its route cannot measure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("route {route} has no counter(s) {}; a counter a route does not have must be absent", counters.join(", "))]
pub struct MetricsError {
    /// The route.
    pub route: String,
    /// The counters it cannot have.
    pub counters: Vec<&'static str>,
}

/// The runtime counters a route can measure. Routes not in the table (observations such as
/// `host_memory_observation`) measure none.
pub fn runtime_counters_of(route: &str) -> &'static [&'static str] {
    /// The counters of streaming through the arena, then `$extra`.
    macro_rules! streaming {
        ($($extra:literal),*) => {
            &[
                "passes",
                "uploads",
                "upload_bytes",
                "upload_copies",
                "device_conversions",
                "device_decodes",
                "encoded_upload_bytes",
                "decoded_bytes",
                "decode_seconds",
                "upload_seconds",
                "wait_seconds",
                "prefetch_hits",
                "prefetch_misses",
                "prefetch_cancels",
                "evictions",
                "reclaim_cycles",
                "resident_bytes",
                "slot_bytes",
                "peak_bytes",
                "unsafe_retained_bytes",
                $($extra),*
            ]
        };
    }
    const STREAMING: &[&str] = streaming!();
    /// The streaming counters and those of reads from disk into staging.
    const READING: &[&str] = streaming!(
        "disk_bytes",
        "disk_bytes_per_pass",
        "disk_read_seconds",
        "disk_bytes_per_second",
        "read_stall_seconds",
        "disk_reads_on_demand",
        "peer_uploads",
        "peer_upload_bytes"
    );
    match route {
        // Every ddo route streams through the arena (linear_runtime from the module's own host
        // tensors), so all measure the same counters; the checkpoint routes may read the disk
        // (vmm_runtime always, vmm_fast_runtime for bytes it does not retain).
        "linear_runtime" | "linear_convolution" => STREAMING,
        "vmm_fast_runtime" | "vmm_runtime" | "dynamic_offload" => READING,
        // Diffusers' hooks do the copies; ddo only counts passes.
        "diffusers_group_offload" => &["passes"],
        // Phase helpers: each reports its own section.
        "pytorch_host_cache_release" => &["host_cache_release"],
        "native_vmm_idle_cache_release" => &["idle_cache_release"],
        "vmm_auxiliary_source_detachment" => &["auxiliary_detachment"],
        _ => &[],
    }
}

impl DynamicOffloadMetrics {
    /// An empty snapshot of one of ddo's routes (`execution.route`); `route` is its published
    /// name.
    pub fn new(execution: ExecutionSection) -> Self {
        let mut m = DynamicOffloadMetrics::observation(published_route(&execution.route));
        m.execution = Some(execution);
        m
    }

    /// An empty snapshot of an observation (`host_memory_observation`, `model_load`, ...).
    pub fn observation(route: &str) -> Self {
        DynamicOffloadMetrics {
            schema_version: SCHEMA_VERSION,
            route: route.to_owned(),
            execution: None,
            configuration: BTreeMap::new(),
            setup: SetupSection::default(),
            runtime: RuntimeSection::default(),
            host_memory: None,
        }
    }

    /// ddo's route when known, else the published one: what decides the counters.
    pub fn runtime_route(&self) -> &str {
        self.execution.as_ref().map_or(self.route.as_str(), |e| e.route.as_str())
    }

    /// Refuses a snapshot whose runtime section has counters the route cannot measure.
    pub fn validate(&self) -> Result<(), MetricsError> {
        let route = self.runtime_route();
        let allowed = runtime_counters_of(route);
        // The execution timer's snapshot is an attachment, not a counter: any route may carry it.
        let extra: Vec<&'static str> = self
            .runtime
            .present()
            .into_iter()
            .filter(|c| !allowed.contains(c) && *c != "execution_timing")
            .collect();
        if extra.is_empty() {
            Ok(())
        } else {
            Err(MetricsError { route: route.to_owned(), counters: extra })
        }
    }

    /// The snapshot as JSON (`schema_version`, `route`, `configuration`, `setup`, `runtime`,
    /// `host_memory`); absent counters are absent keys.
    pub fn as_dict(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("metrics serialize")
    }

    /// The text profile; see [`crate::format_profile`].
    pub fn format_profile(&self) -> String {
        crate::format_profile(self)
    }
}
