//! The component session: one component's weights streamed through one arena.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use ddo_arena::{Arena, ArenaError, Budget, Layout, Lease, ReclaimReport, UnitSpec};
use ddo_core::{
    Admission, ByteSize, Dtype, GrowthKind, GrowthRequest, HostRegion, HostSlice, RefusalReason,
    SourceError, StreamId, TensorSlice, UnitId, WeightSource,
};
use ddo_policy::{ConversionSite, Origin, Plan, ReadBackend, Route, WeightEncoding};
use ddo_source::{
    Checkpoint, CheckpointSource, ConversionReport, ConvertedSource, EncodedFileIdentity,
    EncodedFileRefusal, EncodedSource, EncodingReport, HostTensor, HostTensorSource, MmapChoice,
    PackReport, REGISTRATION_SEGMENT, ReadOptions, RegisteredRange, Registrar, RetainedReport,
    RetainedSource, RetainedStore, StagedSource, StagingOptions, StagingPool,
};

use crate::SessionError;
use crate::device::{ExecutionDevice, ExecutionTarget};
use ddo_arena::{Assignment, ModuleTree, UnitRule};

const GIB: f64 = (1u64 << 30) as f64;

/// Retained windows of about one registration segment: whole tensors, so a unit's range uploads
/// in copies of link-speed size.
const RETAINED_WINDOW: u64 = REGISTRATION_SEGMENT;

/// Retained windows of the automatic host tier hold at least this much (or a quarter of the
/// checkpoint), else the disk serves it all.
const MIN_RETAINED: u64 = 1 << 30;
/// Host memory the automatic retained tier leaves beside its windows and staging (or an
/// eighth of the checkpoint, when smaller).
const TIER_SLACK: u64 = 256 << 20;

/// The host tier a checkpoint no setting places is served from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HostTier {
    /// The checkpoint's mapping, page-locked.
    Mapping,
    /// Retained windows of this many bytes, the rest read from disk into `staging` bytes of
    /// staging.
    Retained { windows: u64, staging: u64 },
    /// Every pass read from disk into two staging buffers of `buffer` bytes.
    Disk { buffer: u64 },
}

/// The host-memory bound a refusal met, in a few words.
fn host_bound(reason: &RefusalReason) -> String {
    match reason {
        RefusalReason::MemAvailable { available, margin } => {
            format!("MemAvailable ({}, {} kept free)", ByteSize(*available), ByteSize(*margin))
        }
        RefusalReason::Commit { commit_limit, committed, margin } => format!(
            "the commit limit leaves ({} of {}, {} kept free)",
            ByteSize(commit_limit.saturating_sub(*committed)),
            ByteSize(*commit_limit),
            ByteSize(*margin)
        ),
        RefusalReason::Cgroup { cgroup, limit, current, margin } => format!(
            "cgroup {cgroup} allows ({} with {} in use, {} kept free)",
            ByteSize(*limit),
            ByteSize(*current),
            ByteSize(*margin)
        ),
        RefusalReason::AddressSpace { limit, vm_size } => {
            format!("RLIMIT_AS leaves ({} with {} mapped)", ByteSize(*limit), ByteSize(*vm_size))
        }
        RefusalReason::Memlock { limit, locked } => format!(
            "RLIMIT_MEMLOCK leaves ({} with {} locked)",
            ByteSize(*limit),
            ByteSize(*locked)
        ),
        RefusalReason::ObservationUnavailable { what, error } => format!("{what}: {error}"),
    }
}

/// Where a component's weights come from.
#[derive(Debug, Clone)]
pub enum Weights {
    /// A safetensors checkpoint: one file, a folder of shards, or an `*.index.json`.
    Checkpoint {
        /// Where it is.
        path: PathBuf,
        /// Whether its files may be mapped (the owner's promise that they do not change).
        mmap: MmapChoice,
    },
    /// Tensors already in host memory (a module loaded by its framework), served in place.
    Host {
        /// The allocations holding the tensors.
        storages: Vec<HostSlice>,
        /// The tensors, each inside one storage.
        tensors: Vec<HostTensor>,
        /// Whether files backing storages (a lazily loaded checkpoint's private mapping) may be
        /// mapped again, shared and read-only (the owner's promise that they do not change).
        mmap: MmapChoice,
    },
}

/// What a session runs: the resolved plan, the weights and (optionally) the module tree.
#[derive(Debug, Clone)]
pub struct SessionSpec {
    /// The component's resolved plan (route and settings).
    pub plan: Plan,
    /// The weights.
    pub weights: Weights,
    /// The module's structure; `None` derives it from the tensor names.
    pub tree: Option<ModuleTree>,
}

/// The routes a session runs: all on the arena, fed by different sources.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionRoute {
    /// `linear_runtime` and `linear_convolution` (whose units are layers): the module's own host
    /// tensors, registered in place.
    Linear,
    /// `vmm_fast_runtime`: the checkpoint's mapping or retained windows.
    Native,
    /// `vmm_runtime`: the checkpoint read from disk each pass into registered staging buffers,
    /// host memory bounded by the staging ceiling.
    Disk,
}

impl SessionRoute {
    /// The session route of a resolved route, or why it has none.
    pub fn of(route: &Route) -> Result<SessionRoute, SessionError> {
        match route {
            Route::LinearRuntime | Route::LinearConvolution => Ok(SessionRoute::Linear),
            Route::VmmFastRuntime => Ok(SessionRoute::Native),
            Route::VmmRuntime => Ok(SessionRoute::Disk),
            Route::DiffusersGroupOffload(_) | Route::None { .. } => Err(SessionError::Route {
                route: route.name(),
                reason: "does not stream through the arena; the host applies it",
            }),
        }
    }

    /// The route's name.
    pub fn name(self) -> &'static str {
        match self {
            SessionRoute::Linear => "linear_runtime",
            SessionRoute::Native => "vmm_fast_runtime",
            SessionRoute::Disk => "vmm_runtime",
        }
    }
}

/// One unit of the session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitInfo {
    /// The arena's id.
    pub id: UnitId,
    /// The block's module path (`transformer_blocks.3`), or `resident` for the pinned rest.
    pub name: String,
    /// Kept resident whatever the budget (acquired for the whole pass).
    pub pinned: bool,
    /// Kept resident by the plan.
    pub resident: bool,
}

/// Where a tensor lives in the arena: fixed for the life of one attach.
#[derive(Clone)]
pub struct TensorView {
    /// Device address (a host address on the host backend).
    pub address: u64,
    /// Bytes.
    pub len: u64,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// Keeps the attach's memory alive: hold it as long as anything reads `address` (a view
    /// handed to another framework). Unload frees the memory when the last owner lets go.
    pub owner: Arc<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for TensorView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorView")
            .field("address", &self.address)
            .field("len", &self.len)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

/// A live lease handed to a host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId(pub u64);

/// Where host bytes came from and what was registered, for the profile.
#[derive(Debug, Clone, Default)]
struct HostReport {
    kind: &'static str,
    /// Why small tensors were not packed (the host refused the bytes).
    not_packed: Option<String>,
    read_workers: Option<u64>,
    registered: u64,
    unregistered: u64,
    unregistered_reason: Option<String>,
    retained: Option<RetainedReport>,
    packed: PackReport,
    conversion: Option<ConversionReport>,
    /// Tensors converted on the device after each upload: slice -> the parameter's dtype.
    device_conversions: HashMap<usize, Dtype>,
    /// Conversion moved to the device because the host could not hold the converted copy.
    host_short: bool,
    /// Widening moved to the host because the GPU budget had no room for staging buffers.
    staging_short: bool,
    /// The staging pool disk reads land in (the disk route; the unretained rest of a
    /// checkpoint on the native route).
    staging: Option<Arc<StagingPool>>,
    /// Why the unretained rest is read on demand instead of ahead (no staging buffer fits).
    staging_note: Option<String>,
    /// Why this host tier (mapping, retained windows, disk) serves the checkpoint.
    tier_reason: Option<String>,
    /// What `vmm_weight_encoding` chose, and why.
    encoding_note: Option<String>,
    /// What encoding the chosen tensors did.
    encoding: Option<EncodingReport>,
    /// Ranges of file mappings to read in (populate) just before they are registered.
    read_in: Vec<ReadIn>,
    /// The streamed units held in a peer device's memory (`vmm_peer_store_device`).
    peer: Option<ddo_arena::PeerStoreReport>,
    /// Why no peer store serves (it was asked for and refused), or how fast its link is.
    peer_note: Option<String>,
    /// The peer link's speed measured at attach, bytes per second (two CUDA devices).
    peer_link: Option<f64>,
    /// How long the attach's stages took.
    stages: SetupStages,
}

/// A range (an index into the attach's host ranges) of a file mapping, read in from the page
/// cache or the disk before registration pins it.
#[derive(Debug, Clone)]
struct ReadIn {
    range: usize,
    file: Arc<ddo_source::MappedFile>,
}

/// Seconds the attach's stages took, and the bytes read in.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SetupStages {
    /// Opening the source: headers, host tier, retained windows or staging, conversions and
    /// encodings at load.
    pub source_seconds: f64,
    /// Bytes of file mappings read in before registration (a cold file arrives here).
    pub read_in_bytes: u64,
    /// Seconds the read-in of those bytes took (overlapping registration).
    pub read_in_seconds: f64,
    /// Seconds registration took, waits for the read-in included.
    pub registration_seconds: f64,
    /// Seconds the resident units took to upload.
    pub resident_seconds: f64,
}

/// The device memory of one attach and the host registrations its copies use. Shared by the
/// session and by every tensor view handed out ([`TensorView::owner`]): it is closed (after
/// every fence completed) when the last of them lets go, so a view never outlives its memory.
struct Memory {
    arena: Arena,
    registrar: Registrar,
    registered: Mutex<Vec<RegisteredRange>>,
}

impl Memory {
    /// Closes the arena, then unregisters (a phase boundary). A failure keeps what is left.
    fn close(&self) -> Result<(), SessionError> {
        self.arena.close()?;
        let mut registered = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        ComponentSession::unregister_all(&self.registrar, &mut registered)
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        // Live leases make close refuse: the memory then stays owned, never freed early, and
        // the failure is noted (the arena's drop, right after, does not note it again).
        let reported = self.arena.close_failure().is_some();
        match self.close() {
            Ok(()) => {}
            // A close failure a caller was given is not reported again.
            Err(SessionError::Arena(_)) if reported => {}
            Err(SessionError::Arena(e)) => {
                ddo_core::note_drop_failure(ddo_arena::drop_failure(&e, self.arena.kept_bytes()))
            }
            Err(e) => ddo_core::note_drop_failure(ddo_core::DropFailure {
                what: "host registrations",
                message: e.to_string(),
                retained_bytes: Some(self.registrar.unsafe_retained()),
            }),
        }
    }
}

/// One attach: the source, the memory, and the live leases.
struct Attached {
    memory: Arc<Memory>,
    source: Arc<dyn WeightSource>,
    units: Vec<UnitInfo>,
    /// Every parameter name (aliases included) -> the source's slice index.
    slices: HashMap<String, usize>,
    leases: HashMap<u64, Lease>,
    next_lease: u64,
    /// Leases of pinned and plan-resident units held from `begin_pass` to `end_pass`.
    pass: Vec<Lease>,
    host: HostReport,
    setup_seconds: f64,
    total_bytes: u64,
    tensor_count: u64,
    /// Counters of the arenas this attach closed when its budget changed.
    earlier: ddo_arena::ArenaStats,
}

/// One component streamed through the GPU weight arena: plan, sources, registration, arena,
/// per-unit leases, reclaim/unload/reload and metrics, for every host (Python, the demo, Rust
/// programs).
///
/// Thread-safe: calls are serialized by one lock. Work on the device is ordered by the streams
/// the caller passes: `acquire(unit, s)` makes `s` wait for the unit's upload; `release(l, s)`
/// records the fence after the work enqueued on `s` that gates reuse of the unit's memory.
pub struct ComponentSession {
    route: SessionRoute,
    plan: Plan,
    weights: Weights,
    tree: Option<ModuleTree>,
    assignment: Assignment,
    /// The device, its ports and its measured link, as the composition root built them.
    target: ExecutionTarget,
    state: Mutex<Option<Attached>>,
    /// A GPU budget set after opening ([`set_budget`](ComponentSession::set_budget)): the
    /// arena's whole budget, no headroom inside it. Later attaches keep it.
    budget_override: Mutex<Option<u64>>,
    /// `vmm_weight_encoding = auto` on a device with a measured link: passes are timed raw
    /// first, then the choice is made.
    auto_encoding: Mutex<Option<AutoEncoding>>,
    /// How fast the device decodes, timed once (by `auto`'s first encoded attach).
    decode_speed: Mutex<Option<crate::link::DecodeSpeed>>,
    warnings: Vec<String>,
}

impl std::fmt::Debug for ComponentSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ComponentSession")
            .field("route", &self.route)
            .field("component", &self.plan.component)
            .field("device", &self.target.device)
            .finish_non_exhaustive()
    }
}

fn gib(setting: &'static str, value: f64) -> Result<u64, SessionError> {
    let bytes = value * GIB;
    if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
        return Err(SessionError::Config {
            setting,
            message: format!("{value} GiB is not a usable size"),
        });
    }
    Ok(bytes as u64)
}

impl ComponentSession {
    /// Opens a session on `target` (built by a composition root, such as `ddo-compose`): opens
    /// the weights, finds the units, plans the arena under the budget, registers host bytes and
    /// starts the first uploads (`prime`). On failure nothing stays allocated.
    pub fn open(
        spec: SessionSpec,
        target: ExecutionTarget,
    ) -> Result<ComponentSession, SessionError> {
        let SessionSpec { plan, weights, tree } = spec;
        let route = SessionRoute::of(&plan.route)?;
        match (&weights, route) {
            (Weights::Checkpoint { .. }, SessionRoute::Native | SessionRoute::Disk)
            | (Weights::Host { .. }, SessionRoute::Linear) => {}
            (Weights::Host { .. }, SessionRoute::Native | SessionRoute::Disk) => {
                return Err(SessionError::Route {
                    route: route.name(),
                    reason: "streams from a checkpoint: load the component from its safetensors files",
                });
            }
            (Weights::Checkpoint { .. }, SessionRoute::Linear) => {
                return Err(SessionError::Route {
                    route: "linear_runtime",
                    reason: "serves a module's host tensors; for a checkpoint use backend vmm",
                });
            }
        }
        let s = &plan.settings;
        let mut rule =
            UnitRule::from_patterns(&s.vmm_module_pattern, &s.always_resident_modules_pattern)?;
        if plan.route == Route::LinearConvolution {
            // One unit per layer; parameters up to the small-tensor threshold stay resident.
            rule = rule.by_layers(u64::from(s.small_tensor_threshold_kb) * 1024);
        }
        let names: Vec<String> = match &weights {
            Weights::Checkpoint { path, .. } => {
                Checkpoint::open(path)?.slices().iter().map(|t| t.name.clone()).collect()
            }
            Weights::Host { tensors, .. } => tensors.iter().map(|t| t.name.clone()).collect(),
        };
        let derived;
        let assignment = match &tree {
            Some(t) => t.assign(&rule),
            None => {
                derived = ModuleTree::from_tensor_names(names.iter().map(String::as_str));
                derived.assign(&rule)
            }
        };
        if assignment.parameters.is_empty() {
            return Err(SessionError::Weights(format!(
                "component {:?} has no parameters: nothing to offload (use route none)",
                plan.component
            )));
        }
        let mut warnings = plan.warnings.clone();
        if target.device == ExecutionDevice::Host && s.execution_device.starts_with("cuda") {
            warnings.push(format!(
                "execution_device {} (default): no CUDA driver here, running on the host backend",
                s.execution_device
            ));
        }
        if plan.route == Route::LinearConvolution && assignment.units.is_empty() {
            warnings.push(format!(
                "route linear_convolution found no convolution or linear layer with a parameter over \
                 small_tensor_threshold_kb ({} KiB): every parameter stays resident",
                s.small_tensor_threshold_kb
            ));
        }
        let auto_encoding = (s.vmm_weight_encoding == WeightEncoding::Auto
            && route == SessionRoute::Native
            && target.link_bytes_per_second.is_some()
            && target.platform.residency.decodes())
        .then(AutoEncoding::timing);
        let session = ComponentSession {
            route,
            plan,
            weights,
            tree,
            assignment,
            target,
            state: Mutex::new(None),
            budget_override: Mutex::new(None),
            auto_encoding: Mutex::new(auto_encoding),
            decode_speed: Mutex::new(None),
            warnings,
        };
        let attached = session.attach()?;
        *session.lock() = Some(attached);
        Ok(session)
    }

    fn lock(&self) -> MutexGuard<'_, Option<Attached>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The route.
    pub fn route(&self) -> SessionRoute {
        self.route
    }

    /// The device it runs on.
    pub fn device(&self) -> ExecutionDevice {
        self.target.device
    }

    /// The resolved plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Which unit holds each parameter (the one rule, applied).
    pub fn assignment(&self) -> &Assignment {
        &self.assignment
    }

    /// Warnings for the host to show (misspelt variables, device fallbacks).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Attaches. Under `dtype_conversion=auto`, a budget without room for the staging buffers of
    /// conversion on the device converts at load on the host instead.
    fn attach(&self) -> Result<Attached, SessionError> {
        let mut on_device = false;
        match self.attach_with(false, &mut on_device) {
            Err(SessionError::Capacity { .. })
                if on_device && self.plan.settings.dtype_conversion == ConversionSite::Auto =>
            {
                let mut attached = self.attach_with(true, &mut on_device)?;
                attached.host.staging_short = true;
                Ok(attached)
            }
            result => result,
        }
    }

    /// Attaches, converting at load on the host only when `host_only`; sets `on_device` when
    /// tensors were planned for conversion on the device.
    fn attach_with(&self, host_only: bool, on_device: &mut bool) -> Result<Attached, SessionError> {
        let t = Instant::now();
        let p = &self.target.platform;
        let (source, ranges, mut host): (
            Arc<dyn WeightSource>,
            Vec<(HostSlice, bool)>,
            HostReport,
        ) = match &self.weights {
            Weights::Checkpoint { path, mmap } => self.checkpoint_source(path, *mmap, host_only)?,
            Weights::Host { storages, tensors, mmap } => {
                self.host_source(storages, tensors, *mmap)?
            }
        };
        host.stages.source_seconds = t.elapsed().as_secs_f64();
        *on_device = !host.device_conversions.is_empty();
        let slices = self.bind(source.slices(), &host.device_conversions)?;
        let specs = self.unit_specs(&*source);
        let budget = self.budget(source.slices(), &specs)?;
        // Register host bytes before the arena exists, so the first uploads run at link speed.
        let registrar = self.registrar(&ranges)?;
        let registering = Instant::now();
        let mut registered = Vec::new();
        if let Err(e) = self.register_all(ranges, &registrar, &mut registered, &mut host) {
            let cleanup = Self::unregister_all(&registrar, &mut registered);
            return Err(SessionError::Source(e).with_cleanup(cleanup));
        }
        host.stages.registration_seconds = registering.elapsed().as_secs_f64();
        let priming = Instant::now();
        let arena = match Arena::with_conversions(
            p,
            source.clone(),
            &specs,
            budget,
            &host.device_conversions,
        ) {
            Ok(a) => a,
            Err(e) => {
                let cleanup = Self::unregister_all(&registrar, &mut registered);
                return Err(self.arena_error(e).with_cleanup(cleanup));
            }
        };
        // The first pass starts warm; resident weights are on the device before the host uses
        // the component (a method called outside forward reads them without acquiring).
        if let Err(e) = arena.prime().and_then(|_| arena.settle_resident()) {
            // Registrations go only after the arena's copies are proven complete (closed).
            let cleanup = arena
                .close()
                .map_err(SessionError::Arena)
                .and_then(|()| Self::unregister_all(&registrar, &mut registered));
            return Err(SessionError::Arena(e).with_cleanup(cleanup));
        }
        host.stages.resident_seconds = priming.elapsed().as_secs_f64();
        self.fill_peer_store(&arena, &mut host);
        let plan = arena.plan();
        let units = specs
            .iter()
            .enumerate()
            .map(|(i, u)| UnitInfo {
                id: UnitId(i as u32),
                name: u.name.clone(),
                pinned: u.pinned,
                resident: plan.resident[i],
            })
            .collect();
        let total_bytes = arena.layout().payload();
        Ok(Attached {
            memory: Arc::new(Memory { arena, registrar, registered: Mutex::new(registered) }),
            source,
            units,
            slices,
            leases: HashMap::new(),
            next_lease: 1,
            pass: Vec::new(),
            host,
            setup_seconds: t.elapsed().as_secs_f64(),
            total_bytes,
            tensor_count: self.assignment.parameters.len() as u64,
            earlier: ddo_arena::ArenaStats::default(),
        })
    }

    /// The arena's budget: a budget set after opening, else the route's setting (the linear
    /// route's from its slots, pinned units and `resident_module_budget_gb`).
    fn budget(&self, slices: &[TensorSlice], specs: &[UnitSpec]) -> Result<Budget, SessionError> {
        let s = &self.plan.settings;
        let budget_override = *self.budget_override.lock().unwrap_or_else(|p| p.into_inner());
        // With the automatic budget the headroom is kept outside the arena, not inside it.
        let mut headroom = match s.auto_budget_policy {
            ddo_policy::AutoBudgetPolicy::Balanced => 0,
            _ => gib("auto_vram_headroom_gb", s.auto_vram_headroom_gb)?,
        };
        let total = match (budget_override, self.route) {
            (Some(total), _) => {
                headroom = 0;
                total
            }
            (None, SessionRoute::Native | SessionRoute::Disk) => {
                gib("vmm_resident_weight_budget_gb", s.vmm_resident_weight_budget_gb)?
            }
            (None, SessionRoute::Linear) => {
                let granularity = self.target.platform.residency.granularity()?;
                let layout = Layout::build(slices, specs, granularity)?;
                let largest =
                    layout.units.iter().filter(|u| !u.pinned).map(|u| u.len).max().unwrap_or(0);
                let pinned: u64 = layout.units.iter().filter(|u| u.pinned).map(|u| u.len).sum();
                let slots = u64::from(s.prefetch_depth.saturating_add(1).max(2));
                // Headroom is kept free inside this budget: it shrinks the resident blocks.
                let resident = gib("resident_module_budget_gb", s.resident_module_budget_gb)?;
                largest
                    .checked_mul(slots)
                    .and_then(|v| v.checked_add(pinned))
                    .and_then(|v| v.checked_add(resident))
                    .ok_or_else(|| SessionError::Capacity {
                        setting: "resident_module_budget_gb",
                        message: "the budget overflows".into(),
                    })?
            }
        };
        Ok(Budget { total, headroom, prefetch_depth: s.prefetch_depth })
    }

    /// The tensors to stream entropy-coded (`vmm_weight_encoding`), unit by unit in upload
    /// order, and what the profile says of the choice.
    fn encoding_choice(
        &self,
        slices: &[TensorSlice],
        converted: &HashSet<usize>,
    ) -> Result<(Vec<usize>, String), SessionError> {
        let mode = self.plan.settings.vmm_weight_encoding;
        if mode == WeightEncoding::Off {
            return Ok((Vec::new(), "off".into()));
        }
        if self.route != SessionRoute::Native {
            let route = self.route.name();
            return Ok((Vec::new(), format!("{mode}: the {route} route streams bytes as read")));
        }
        let residency = &self.target.platform.residency;
        if !residency.decodes() {
            return Ok((Vec::new(), format!("{mode}: this device cannot load the decoder")));
        }
        let timed = match &mut *self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()) {
            None => None,
            Some(AutoEncoding::Timing { .. }) => {
                return Ok((Vec::new(), "auto: streaming raw while passes are timed".into()));
            }
            Some(AutoEncoding::Raw { why }) => {
                return Ok((Vec::new(), format!("auto: raw: {why}")));
            }
            // Any attach from now on encodes (a reload included): no switch is due any more.
            Some(AutoEncoding::Encode { applied, why }) => {
                *applied = true;
                Some(why.clone())
            }
        };
        let specs = self.assignment.unit_specs(slices);
        let streamed: Vec<bool> = match mode {
            WeightEncoding::On => vec![true; specs.len()],
            _ => {
                // The plan of the raw bytes says which units stream: their tensors cross the
                // link every pass, a resident unit's once.
                let budget = self.budget(slices, &specs)?;
                let layout = Layout::build(slices, &specs, residency.granularity()?)?;
                match ddo_arena::ResidencyPlan::new(&layout, budget) {
                    Ok(plan) => plan.resident.iter().map(|r| !r).collect(),
                    // The arena names the budget that cannot work.
                    Err(_) => vec![true; specs.len()],
                }
            }
        };
        // `auto` weighs each tensor on this device: it streams encoded where decoding it takes
        // less time than copying its bf16 bytes over the link (decoding then hides under the
        // copies). Without a measured link (the host backend) it keeps tensors of 1 MiB or more.
        let weigh = match (mode, self.target.link_bytes_per_second) {
            (WeightEncoding::Auto, Some(link)) => {
                let mut known = self.decode_speed.lock().unwrap_or_else(|p| p.into_inner());
                let speed = match &*known {
                    Some(speed) => speed.clone(),
                    None => crate::link::decode_speed(&self.target.platform).map_err(|e| {
                        SessionError::Capacity {
                            setting: "vmm_weight_encoding",
                            message: format!(
                                "the device could not time its decoding: {e}; set vmm_weight_encoding to off or on"
                            ),
                        }
                    })?,
                };
                *known = Some(speed.clone());
                Some((link, speed))
            }
            _ => None,
        };
        let pays = |len: u64| match (&weigh, mode) {
            (_, WeightEncoding::On) => len >= MIN_ON_BYTES,
            (Some((link, speed)), _) => speed.seconds(len) < len as f64 / link,
            (None, _) => len >= MIN_ENCODED_BYTES,
        };
        let mut chosen = Vec::new();
        let mut declined = 0usize;
        for (spec, _) in specs
            .iter()
            .zip(&streamed)
            .filter(|(u, s)| **s && !u.pinned || mode == WeightEncoding::On)
        {
            let mut tensors: Vec<usize> = Vec::new();
            for &t in &spec.tensors {
                let slice = &slices[t];
                if !matches!(slice.dtype, Dtype::BF16 | Dtype::F16) || converted.contains(&t) {
                    continue;
                }
                if pays(slice.len) {
                    tensors.push(t);
                } else {
                    declined += 1;
                }
            }
            tensors.sort_by_key(|&t| (slices[t].file, slices[t].offset));
            chosen.extend(tensors);
        }
        let why = match (mode, &weigh, chosen.is_empty()) {
            (WeightEncoding::On, _, false) => {
                "on: every unit's bf16 and fp16 tensors of 64 KiB or more".to_owned()
            }
            (WeightEncoding::On, _, true) => {
                "on: no unit holds a bf16 or fp16 tensor of 64 KiB or more".to_owned()
            }
            (_, Some((link, speed)), _) => format!(
                "auto: the streamed units' bf16 and fp16 tensors this device decodes faster than \
                 the link copies them ({:.0} GB/s of decoding at 16 MiB, {:.1} GB/s link; {declined} \
                 smaller tensors stay raw)",
                speed.rate() / 1e9,
                link / 1e9
            ),
            (_, None, false) => {
                "auto: the streamed units' bf16 and fp16 tensors of 1 MiB or more".to_owned()
            }
            (_, None, true) => {
                "auto: no streamed unit holds a bf16 or fp16 tensor of 1 MiB or more".to_owned()
            }
        };
        let why = match timed {
            Some(timed) => format!("{why}; {timed}"),
            None => why,
        };
        Ok((chosen, why))
    }

    fn arena_error(&self, e: ArenaError) -> SessionError {
        match e.original() {
            ArenaError::BudgetTooSmall { .. } => SessionError::Capacity {
                setting: match self.route {
                    SessionRoute::Native | SessionRoute::Disk => {
                        "vmm_resident_weight_budget_gb / --ddo-vmm-resident-weight-budget-gb"
                    }
                    SessionRoute::Linear => {
                        "auto_vram_headroom_gb lower, or resident_module_budget_gb higher"
                    }
                },
                message: e.original().to_string(),
            },
            _ => SessionError::Arena(e),
        }
    }

    /// Unregisters every range; the first failure is returned after all were tried. A failed
    /// unregistration keeps its pages locked and allocated (counted unsafe), never freed.
    fn unregister_all(
        registrar: &Registrar,
        registered: &mut Vec<RegisteredRange>,
    ) -> Result<(), SessionError> {
        let mut first = None;
        while let Some(r) = registered.pop() {
            if let Err(e) = registrar.unregister(r) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), |e| Err(SessionError::Source(e)))
    }

    /// The checkpoint's source: retained windows under `vmm_source_cache_gb`, else the mapping
    /// (`load_safetensors_backend` auto/mmap) or reads on demand (pread/direct); the tensors
    /// `vmm_weight_encoding` chooses served from their encodings.
    #[allow(clippy::type_complexity)]
    fn checkpoint_source(
        &self,
        path: &PathBuf,
        mmap: MmapChoice,
        host_only: bool,
    ) -> Result<(Arc<dyn WeightSource>, Vec<(HostSlice, bool)>, HostReport), SessionError> {
        let checkpoint = Arc::new(Checkpoint::open(path)?);
        let all = self.conversions(checkpoint.slices())?;
        let converted: HashSet<usize> = all.iter().map(|&(i, _)| i).collect();
        let (encode, note) = self.encoding_choice(checkpoint.slices(), &converted)?;
        let (source, mapped, mut ranges, mut host) =
            self.stored_source(checkpoint.clone(), all.clone(), mmap, host_only, &encode)?;
        host.encoding_note = Some(note);
        if encode.is_empty() {
            return Ok((source, ranges, host));
        }
        let (mut encoded, file_note) =
            self.encoded_source(source, &checkpoint, &encode, mapped.as_deref())?;
        if let (Some(note), Some(file_note)) = (&mut host.encoding_note, file_note) {
            *note = format!("{note}; {file_note}");
        }
        // A tensor whose encoding was not smaller is served as stored, so its stored bytes must
        // be registered (and held) like every other stored tensor's: the source is opened again
        // with only the encoded tensors left out.
        let held: Vec<usize> =
            encode.iter().copied().filter(|&i| encoded.encoding(i).is_some()).collect();
        if held.len() < encode.len() {
            drop((ranges, mapped));
            let (source, _mapped, again, mut rehost) =
                self.stored_source(checkpoint.clone(), all, mmap, host_only, &held)?;
            rehost.encoding_note = host.encoding_note.take();
            encoded = encoded.serving(source).ok_or_else(|| {
                SessionError::Weights(
                    "the checkpoint's tensors changed while it was encoded".into(),
                )
            })?;
            (ranges, host) = (again, rehost);
        }
        ranges.extend(encoded.windows());
        host.encoding = Some(encoded.report());
        Ok((Arc::new(encoded), ranges, host))
    }

    /// `source` with the tensors of `encode` also held entropy-coded, encoded on every core; a
    /// tensor's pages of `mapped` are dropped once read (its encoding serves it). Under
    /// `vmm_encoded_cache_dir` the encodings come from the encoded file of the same checkpoint
    /// files and tensors when it checks, else they are encoded and the file written; with what
    /// the profile says of the file.
    fn encoded_source(
        &self,
        source: Arc<dyn WeightSource>,
        checkpoint: &Checkpoint,
        encode: &[usize],
        mapped: Option<&CheckpointSource>,
    ) -> Result<(EncodedSource, Option<String>), SessionError> {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let workers = cores.max(self.plan.settings.pin_cpu_workers as usize);
        let folder = Path::new(&self.plan.settings.vmm_encoded_cache_dir);
        let file = (!folder.as_os_str().is_empty()).then(|| {
            EncodedFileIdentity::of(checkpoint, source.slices(), encode).map(|identity| {
                let path = folder.join(identity.file_name());
                (identity, path)
            })
        });
        let mut refused = None;
        if let Some(Ok((identity, path))) = &file {
            match EncodedSource::open_file(source.clone(), identity, path, workers) {
                Ok(read) => return Ok((read, Some(format!("read from {}", path.display())))),
                Err(EncodedFileRefusal::Missing) => {}
                Err(why) => refused = Some(why),
            }
        }
        let mut encoded = self.encode(source, encode, mapped, workers)?;
        let note = match file {
            None => None,
            Some(Err(e)) => Some(format!("encoded (no encoded file: {e})")),
            Some(Ok((identity, path))) => {
                // A folder that cannot be written only leaves the encodings unsaved.
                let saved =
                    std::fs::create_dir_all(folder).and_then(|()| encoded.save(&identity, &path));
                let shown = path.display();
                Some(match (saved, refused) {
                    (Ok(_), None) => format!("encoded (encoded file {shown} written)"),
                    (Ok(_), Some(why)) => format!("re-encoded: {why} (written again)"),
                    (Err(e), None) => {
                        format!("encoded (the encoded file {shown} could not be written: {e})")
                    }
                    (Err(e), Some(why)) => {
                        format!("re-encoded: {why} (it could not be written again: {e})")
                    }
                })
            }
        };
        Ok((encoded, note))
    }

    /// `source` with the tensors of `encode` encoded on `workers` threads into retained memory.
    fn encode(
        &self,
        source: Arc<dyn WeightSource>,
        encode: &[usize],
        mapped: Option<&CheckpointSource>,
        workers: usize,
    ) -> Result<EncodedSource, SessionError> {
        let p = &self.target.platform;
        let store = RetainedStore::new(u64::MAX, p.admission.clone());
        let drop_pages = |i: usize| {
            if let Some(m) = mapped {
                let t = &m.slices()[i];
                if let Some(file) = m.mapping(t.file.0 as usize) {
                    file.drop_pages(t.offset as usize, t.len as usize);
                }
            }
        };
        EncodedSource::encode(source, encode, &store, workers, &drop_pages).map_err(|e| match e {
            e @ (SourceError::Refused(_) | SourceError::CeilingExceeded { .. }) => {
                SessionError::Capacity {
                    setting: "vmm_weight_encoding",
                    message: format!(
                        "the host cannot hold the encodings of {} tensors: {e}; set vmm_weight_encoding to off",
                        encode.len()
                    ),
                }
            }
            e => SessionError::Source(e),
        })
    }

    /// The checkpoint's source as stored (or converted at load), the tensors of `encode` left
    /// unregistered and unretained (their encodings serve them), with the mapping it reads.
    #[allow(clippy::type_complexity)]
    fn stored_source(
        &self,
        checkpoint: Arc<Checkpoint>,
        all: Vec<(usize, Dtype)>,
        mmap: MmapChoice,
        host_only: bool,
        encode: &[usize],
    ) -> Result<
        (Arc<dyn WeightSource>, Option<Arc<CheckpointSource>>, Vec<(HostSlice, bool)>, HostReport),
        SessionError,
    > {
        let s = &self.plan.settings;
        let p = &self.target.platform;
        let workers = s.pin_cpu_workers.max(1) as usize;
        let slices = checkpoint.slices();
        let device_can = |&(i, to): &(usize, Dtype)| p.residency.converts(slices[i].dtype, to);
        let (on_device, targets): (Vec<_>, Vec<_>) = match s.dtype_conversion {
            ConversionSite::Host => (Vec::new(), all.clone()),
            ConversionSite::Auto if host_only => (Vec::new(), all.clone()),
            ConversionSite::Device => {
                if let Some(&(i, to)) = all.iter().find(|c| !device_can(c)) {
                    return Err(SessionError::Capacity {
                        setting: "dtype_conversion",
                        message: format!(
                            "the device cannot convert tensor {} from {} to {}; set dtype_conversion to host or auto",
                            slices[i].name,
                            slices[i].dtype.as_str(),
                            to.as_str()
                        ),
                    });
                }
                (all.clone(), Vec::new())
            }
            // The disk route bounds host memory by its staging: every conversion the device can
            // make runs there, narrowing included (a converted copy would hold the model).
            ConversionSite::Auto if self.route == SessionRoute::Disk => {
                all.iter().partition(|c| device_can(c))
            }
            // Widening streams fewer bytes in the stored dtype.
            ConversionSite::Auto => all.iter().partition(|&&(i, to)| {
                to.size_bytes() > slices[i].dtype.size_bytes() && device_can(&(i, to))
            }),
        };
        let skip: HashSet<usize> =
            targets.iter().map(|&(i, _)| i).chain(encode.iter().copied()).collect();
        let (source, mapped, ranges, mut host) =
            self.checkpoint_bytes(checkpoint.clone(), mmap, &skip)?;
        host.device_conversions = on_device.iter().copied().collect();
        if targets.is_empty() {
            return Ok((source, mapped, ranges, host));
        }
        let store = RetainedStore::new(u64::MAX, p.admission.clone());
        // A converted tensor's pages of the mapping are not needed again: drop them, so the
        // process holds the module's bytes once.
        let drop_pages = |i: usize| {
            if let Some(m) = &mapped {
                let t = &m.slices()[i];
                if let Some(file) = m.mapping(t.file.0 as usize) {
                    file.drop_pages(t.offset as usize, t.len as usize);
                }
            }
        };
        let converted = match ConvertedSource::convert(
            source.clone(),
            &targets,
            &store,
            workers,
            &drop_pages,
        ) {
            Ok(c) => c,
            // The host cannot hold the converted copy: stream the stored bytes and convert them
            // on the device instead, when it can.
            Err(SourceError::Refused(_) | SourceError::CeilingExceeded { .. })
                if s.dtype_conversion == ConversionSite::Auto
                    && !host_only
                    && targets.iter().all(device_can) =>
            {
                // What the first attempt holds (retained windows count against admission).
                drop((source, ranges, mapped));
                let skip = encode.iter().copied().collect();
                let (source, mapped, ranges, mut host) =
                    self.checkpoint_bytes(checkpoint, mmap, &skip)?;
                host.device_conversions = all.into_iter().collect();
                host.host_short = true;
                return Ok((source, mapped, ranges, host));
            }
            Err(e @ (SourceError::Refused(_) | SourceError::CeilingExceeded { .. })) => {
                return Err(SessionError::Capacity {
                    setting: "torch_dtype",
                    message: format!(
                        "converting {} tensors to the module's dtypes needs host memory: {e}; load the model with torch_dtype matching the checkpoint",
                        targets.len()
                    ),
                });
            }
            Err(e) => return Err(SessionError::Source(e)),
        };
        host.conversion = Some(converted.report());
        let ranges = ranges
            .into_iter()
            .chain(converted.buffers().iter().map(|b| (b.clone(), false)))
            .collect();
        Ok((Arc::new(converted), mapped, ranges, host))
    }

    /// The checkpoint's tensors whose parameters have another floating dtype: `(slice, dtype)`.
    fn conversions(&self, slices: &[TensorSlice]) -> Result<Vec<(usize, Dtype)>, SessionError> {
        let index: HashMap<&str, usize> =
            slices.iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
        let mut targets: HashMap<usize, (Dtype, &str)> = HashMap::new();
        for p in &self.assignment.parameters {
            let Some(&i) = p.names.iter().find_map(|n| index.get(n.as_str())) else { continue };
            let t = &slices[i];
            let Some(to) = p.dtype.filter(|&d| ddo_source::convertible(t.dtype, d)) else {
                continue;
            };
            if p.shape.as_ref().is_some_and(|shape| *shape != t.shape) {
                continue; // bind() names the shape mismatch
            }
            if let Some((other, name)) = targets.insert(i, (to, &p.names[0]))
                && other != to
            {
                return Err(SessionError::Weights(format!(
                    "tensor {} is bound to parameters {name} ({}) and {} ({}); tied parameters need one dtype",
                    t.name,
                    other.as_str(),
                    p.names[0],
                    to.as_str()
                )));
            }
        }
        let mut out: Vec<(usize, Dtype)> = targets.into_iter().map(|(i, (d, _))| (i, d)).collect();
        out.sort_unstable_by_key(|&(i, _)| i);
        Ok(out)
    }

    /// The checkpoint's own bytes: retained windows, the mapping, or reads on demand. With
    /// `targets` to convert, a mapping registers only the ranges of the tensors served as stored.
    #[allow(clippy::type_complexity)]
    fn checkpoint_bytes(
        &self,
        checkpoint: Arc<Checkpoint>,
        mmap: MmapChoice,
        skip: &HashSet<usize>,
    ) -> Result<CheckpointBytes, SessionError> {
        let s = &self.plan.settings;
        let p = &self.target.platform;
        let workers = s.pin_cpu_workers.max(1) as usize;
        let reads = |backend: ReadBackend| match backend {
            ReadBackend::Direct => ReadOptions { workers, ..ReadOptions::direct() },
            _ => ReadOptions { workers, ..ReadOptions::pread() },
        };
        if self.route == SessionRoute::Disk {
            let buffer = self.staging_buffer(&checkpoint)?;
            let mut bytes = self.disk_bytes(checkpoint, buffer)?;
            bytes.3.tier_reason = Some(
                "disk: the disk route (vmm_runtime, preset nvme_baseline) reads the checkpoint into staging every pass".into(),
            );
            return Ok(bytes);
        }
        let mut cache = gib("vmm_source_cache_gb", s.vmm_source_cache_gb)?;
        let mut backend = s.load_safetensors_backend;
        let mut reason = (cache > 0).then(|| {
            format!(
                "retained: vmm_source_cache_gb = {} holds the checkpoint's bytes in host memory",
                s.vmm_source_cache_gb
            )
        });
        // A preset's mapping is the default tier; a caller's setting is kept.
        let by_caller = !matches!(
            self.plan.origins.get("load_safetensors_backend"),
            None | Some(Origin::Default | Origin::Preset(_))
        );
        let chooses = cache == 0
            && (backend == ReadBackend::Auto || backend == ReadBackend::Mmap && !by_caller)
            && s.vmm_source_registered_gb == 0.0
            && self.route == SessionRoute::Native;
        let mut staging_ceiling = None;
        if chooses {
            let (tier, why) = self.host_tier(&checkpoint, skip)?;
            reason = Some(why);
            match tier {
                HostTier::Mapping => {}
                HostTier::Retained { windows, staging } => {
                    // Read past the page cache, which the host has no room for either.
                    (cache, backend) = (windows, ReadBackend::Direct);
                    staging_ceiling = Some(staging);
                }
                HostTier::Disk { buffer } => {
                    let mut bytes = self.disk_bytes(checkpoint, buffer).map_err(|e| match e {
                        SessionError::Source(e @ SourceError::Refused(_)) => {
                            SessionError::Capacity {
                                setting: "vmm_staging_buffer_gb",
                                message: format!(
                                    "the host cannot hold the checkpoint, nor staging to read it from disk: {e}"
                                ),
                            }
                        }
                        e => e,
                    })?;
                    bytes.3.tier_reason = reason;
                    return Ok(bytes);
                }
            }
        }
        if cache > 0 {
            let reader = CheckpointSource::new(checkpoint.clone(), reads(backend))?;
            let store = RetainedStore::new(cache, p.admission.clone());
            // Tensors converted at load are served converted, encoded ones from their encodings:
            // their stored bytes are not retained.
            let (source, report) = RetainedSource::retain_only(
                Arc::new(reader),
                &store,
                RETAINED_WINDOW.min(cache),
                |i| !skip.contains(&i),
            )?;
            let mut windows: Vec<(HostSlice, bool)> =
                source.windows().into_iter().map(|w| (w, false)).collect();
            let mut host = HostReport {
                kind: "retained",
                read_workers: Some(workers as u64),
                tier_reason: reason,
                ..HostReport::default()
            };
            let mut source: Arc<dyn WeightSource> = Arc::new(source);
            if report.unretained_bytes > 0 {
                // The rest is read ahead into staging, off the uploads' critical path.
                // A caller's vmm_staging_buffer_gb is the whole ring; else two buffers, each
                // holding the largest unit, as the chosen tier stages.
                let staging = match staging_ceiling {
                    Some(c) => c,
                    None if self.staging_by_caller() => {
                        gib("vmm_staging_buffer_gb", s.vmm_staging_buffer_gb)?
                    }
                    None => self.staging_buffer(&checkpoint)?.saturating_mul(2),
                };
                match self.staging_pool(&checkpoint, staging, backend) {
                    Ok(pool) => {
                        windows.extend(pool.buffers().into_iter().map(|b| (b, false)));
                        source = Arc::new(StagedSource::new(source, pool.clone()));
                        host.staging = Some(pool);
                    }
                    Err(SessionError::Source(SourceError::CeilingExceeded { .. })) => {
                        host.staging_note = Some(format!(
                            "vmm_staging_buffer_gb = {} holds no unit: the bytes past vmm_source_cache_gb are read when each upload needs them (raise vmm_staging_buffer_gb to read them ahead)",
                            s.vmm_staging_buffer_gb
                        ));
                    }
                    Err(SessionError::Source(e @ SourceError::Refused(_))) => {
                        host.staging_note = Some(format!(
                            "the bytes past vmm_source_cache_gb are read when each upload needs them: the host refused their staging buffers ({e})"
                        ));
                    }
                    Err(e) => return Err(e),
                }
            }
            host.retained = Some(report);
            return Ok((source, None, windows, host));
        }
        let mapped = match backend {
            ReadBackend::Auto | ReadBackend::Mmap => {
                CheckpointSource::mapped(checkpoint.clone(), workers, mmap)?
            }
            ReadBackend::Pread | ReadBackend::Direct => None,
        };
        match mapped {
            Some(source) => {
                let source = Arc::new(source);
                let maps = (0..checkpoint.files().len())
                    .filter_map(|i| {
                        let map =
                            HostSlice::whole(source.mapping(i)?.clone() as Arc<dyn HostRegion>);
                        Some(map)
                    })
                    .collect::<Vec<_>>();
                let ranges: Vec<(HostSlice, bool)> = if skip.is_empty() {
                    maps.into_iter().map(|m| (m, true)).collect()
                } else {
                    stored_runs(checkpoint.slices(), skip, &maps)
                };
                // A cold file is read in at the disk's speed before registration pins it: each
                // range just before it is registered, the next one read meanwhile.
                let read_in = ranges
                    .iter()
                    .enumerate()
                    .filter_map(|(range, (slice, _))| {
                        let file =
                            (0..checkpoint.files().len()).filter_map(|i| source.mapping(i)).find(
                                |m| std::ptr::addr_eq(Arc::as_ptr(slice.region()), Arc::as_ptr(*m)),
                            )?;
                        Some(ReadIn { range, file: file.clone() })
                    })
                    .collect();
                let tier_reason = reason.or_else(|| {
                    Some(if s.vmm_source_registered_gb > 0.0 {
                        format!(
                            "mapping: vmm_source_registered_gb = {} bounds its page-locked part",
                            s.vmm_source_registered_gb
                        )
                    } else {
                        format!("mapping: load_safetensors_backend = {}", backend.as_str())
                    })
                });
                Ok((
                    source.clone() as Arc<dyn WeightSource>,
                    Some(source),
                    ranges,
                    HostReport { kind: "mapping", tier_reason, read_in, ..HostReport::default() },
                ))
            }
            None => {
                let source = CheckpointSource::new(checkpoint, reads(backend))?;
                Ok((
                    Arc::new(source),
                    None,
                    Vec::new(),
                    HostReport {
                        kind: "reads",
                        read_workers: Some(workers as u64),
                        tier_reason: Some(format!(
                            "reads: load_safetensors_backend = {} reads each upload's bytes from the files",
                            backend.as_str()
                        )),
                        ..HostReport::default()
                    },
                ))
            }
        }
    }

    /// The host tier of a checkpoint no setting places, from what host memory admits now:
    /// - the **mapping**, page-locked whole, when the host can hold the bytes streamed as stored
    ///   (pinned file pages leave the page cache's reclaimable memory, so they are asked for
    ///   like retained bytes);
    /// - else **retained windows** of what the host can hold beside staging (two buffers of the
    ///   larger of `vmm_staging_buffer_gb` and the largest unit), the rest read from disk into
    ///   staging every pass, when that holds at least [`MIN_RETAINED`] (or a quarter of the
    ///   bytes);
    /// - else the **disk**: every pass read into those two staging buffers.
    ///
    /// With the reason the profile shows. A host whose memory cannot be observed keeps the
    /// mapping, and says so.
    fn host_tier(
        &self,
        checkpoint: &Checkpoint,
        skip: &HashSet<usize>,
    ) -> Result<(HostTier, String), SessionError> {
        let p = &self.target.platform;
        let s = &self.plan.settings;
        let bytes: u64 = checkpoint
            .slices()
            .iter()
            .enumerate()
            .filter(|(i, _)| !skip.contains(i))
            .map(|(_, t)| t.len)
            .sum();
        let ask = |bytes| {
            p.admission.admit(&GrowthRequest {
                kind: GrowthKind::Retained,
                bytes,
                registered_bytes: 0,
            })
        };
        let shown = ByteSize(bytes);
        let refusal = match ask(bytes) {
            Admission::Granted { headroom } => {
                return Ok((
                    HostTier::Mapping,
                    format!(
                        "mapping: the host can hold the checkpoint's {shown} page-locked ({} left beside it)",
                        ByteSize(headroom)
                    ),
                ));
            }
            Admission::Refused(r) => r,
        };
        let bound = host_bound(&refusal.reason);
        if matches!(refusal.reason, RefusalReason::ObservationUnavailable { .. }) {
            return Ok((
                HostTier::Mapping,
                format!(
                    "mapping: host memory cannot be observed ({bound}); set vmm_source_cache_gb, or preset nvme_baseline, to bound host memory"
                ),
            ));
        }
        let room = match ask(0) {
            Admission::Granted { headroom } => headroom,
            Admission::Refused(_) => 0,
        };
        // Staging of two buffers, each holding the largest unit, so reads run ahead of uploads.
        let setting = gib("vmm_staging_buffer_gb", s.vmm_staging_buffer_gb)?;
        let buffer = setting.max(self.largest_unit(checkpoint)?.next_multiple_of(1 << 20));
        let staging = buffer.saturating_mul(2);
        let windows = room.saturating_sub(staging).saturating_sub(TIER_SLACK.min(bytes / 8));
        if windows >= MIN_RETAINED.min(bytes / 4) && windows > 0 {
            return Ok((
                HostTier::Retained { windows, staging },
                format!(
                    "retained windows of {} + disk: page-locking the checkpoint's {shown} mapping needs more host memory than {bound}; {} is retained and the rest read from disk into {} of staging every pass",
                    ByteSize(windows),
                    ByteSize(windows),
                    ByteSize(staging)
                ),
            ));
        }
        Ok((
            HostTier::Disk { buffer },
            format!(
                "disk: page-locking the checkpoint's {shown} mapping needs more host memory than {bound}, and the {} it leaves holds no retained window beside staging; every pass reads the checkpoint from disk into {} of staging",
                ByteSize(room),
                ByteSize(staging)
            ),
        ))
    }

    /// The disk route's bytes: the checkpoint read (never mapped) into a staging pool of two
    /// buffers of `vmm_staging_buffer_gb` each (fewer, larger units; more, smaller ones, within
    /// the same ceiling), registered for DMA.
    fn disk_bytes(
        &self,
        checkpoint: Arc<Checkpoint>,
        buffer: u64,
    ) -> Result<CheckpointBytes, SessionError> {
        let s = &self.plan.settings;
        let largest = self.largest_unit(&checkpoint)?;
        if largest > buffer {
            return Err(SessionError::Config {
                setting: "vmm_staging_buffer_gb",
                message: format!(
                    "{} GiB is smaller than the largest unit ({:.4} GiB): the disk route stages a whole unit in one buffer; set vmm_staging_buffer_gb to at least {:.4}",
                    s.vmm_staging_buffer_gb,
                    largest as f64 / GIB,
                    largest.div_ceil(1 << 20) as f64 / 1024.0
                ),
            });
        }
        let backend = match s.load_safetensors_backend {
            ReadBackend::Pread => ReadBackend::Pread,
            _ => ReadBackend::Direct,
        };
        let pool = self.staging_pool(&checkpoint, buffer.saturating_mul(2), backend)?;
        // Reads outside staging (a range larger than a buffer) use the same path.
        let options = match (backend, pool.is_direct()) {
            (ReadBackend::Direct, true) => ReadOptions::direct(),
            _ => ReadOptions::pread(),
        };
        let reader = CheckpointSource::new(checkpoint, options)?;
        let ranges = pool.buffers().into_iter().map(|b| (b, false)).collect();
        let host = HostReport {
            kind: "disk",
            read_workers: Some(options.workers as u64),
            staging: Some(pool.clone()),
            ..HostReport::default()
        };
        let source = StagedSource::new(Arc::new(reader), pool);
        Ok((Arc::new(source), None, ranges, host))
    }

    /// Bytes of the largest unit's upload (its stored tensors), as the arena lays units out.
    /// Whether the caller set `vmm_staging_buffer_gb` (not its default or a preset's).
    fn staging_by_caller(&self) -> bool {
        !matches!(
            self.plan.origins.get("vmm_staging_buffer_gb"),
            None | Some(Origin::Default | Origin::Preset(_))
        )
    }

    /// Bytes of one staging buffer: `vmm_staging_buffer_gb`, grown to hold the largest unit
    /// unless the caller set it (a caller's setting is kept, and refused where a unit must fit).
    fn staging_buffer(&self, checkpoint: &Checkpoint) -> Result<u64, SessionError> {
        let setting = gib("vmm_staging_buffer_gb", self.plan.settings.vmm_staging_buffer_gb)?;
        if self.staging_by_caller() {
            return Ok(setting);
        }
        Ok(setting.max(self.largest_unit(checkpoint)?.next_multiple_of(1 << 20)))
    }

    fn largest_unit(&self, checkpoint: &Checkpoint) -> Result<u64, SessionError> {
        let (largest, _) = self.largest(checkpoint)?;
        Ok(largest)
    }

    /// The largest unit's and the largest extent's (one contiguous file range) bytes.
    fn largest(&self, checkpoint: &Checkpoint) -> Result<(u64, u64), SessionError> {
        let granularity = self.target.platform.residency.granularity()?;
        let specs = self.assignment.unit_specs(checkpoint.slices());
        let layout = Layout::build(checkpoint.slices(), &specs, granularity)?;
        let unit = layout.units.iter().map(|u| u.link_bytes()).max().unwrap_or(0);
        let extent =
            layout.units.iter().flat_map(|u| u.extents.iter().map(|e| e.len)).max().unwrap_or(0);
        Ok((unit, extent))
    }

    /// A staging pool under `ceiling` for the checkpoint's ranges, read with `backend` (O_DIRECT
    /// where the file system allows, else pread), its copies' completion asked of the device.
    fn staging_pool(
        &self,
        checkpoint: &Checkpoint,
        ceiling: u64,
        backend: ReadBackend,
    ) -> Result<Arc<StagingPool>, SessionError> {
        let p = &self.target.platform;
        let (_, extent) = self.largest(checkpoint)?;
        let read = match backend {
            ReadBackend::Direct => ReadOptions::direct(),
            _ => ReadOptions::pread(),
        };
        let options = StagingOptions {
            ceiling,
            largest_range: extent,
            readers: read.workers,
            method: read.method,
            chunk_bytes: read.chunk_bytes,
        };
        let store = RetainedStore::new(ceiling, p.admission.clone());
        let pool = StagingPool::new(checkpoint, options, &store, Some(p.residency.clone()))?;
        Ok(Arc::new(pool))
    }

    /// The module's host tensors in place; tensors up to `small_tensor_threshold_kb` packed per
    /// unit. The storages still serving tensors are registered in place.
    #[allow(clippy::type_complexity)]
    fn host_source(
        &self,
        storages: &[HostSlice],
        tensors: &[HostTensor],
        mmap: MmapChoice,
    ) -> Result<(Arc<dyn WeightSource>, Vec<(HostSlice, bool)>, HostReport), SessionError> {
        let s = &self.plan.settings;
        let files = crate::host_files::redirect(storages, tensors, mmap)?;
        let mut source = HostTensorSource::new(files.storages, files.tensors)?;
        for path in &files.paths {
            source.watch_file(path)?;
        }
        let mut not_packed = None;
        let threshold = u64::from(s.small_tensor_threshold_kb) * 1024;
        if threshold > 0 {
            let index: HashMap<&str, usize> =
                source.slices().iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
            let mut units: Vec<Vec<usize>> = vec![Vec::new(); self.assignment.units.len() + 1];
            for p in &self.assignment.parameters {
                let Some(&i) = p.names.iter().find_map(|n| index.get(n.as_str())) else { continue };
                units[p.unit.map_or(0, |u| u + 1)].push(i);
            }
            let groups: Vec<Vec<usize>> =
                units.iter().map(|u| isolated_small(source.slices(), u, threshold)).collect();
            let store = RetainedStore::new(u64::MAX, self.target.platform.admission.clone());
            match source.pack(&groups, &store) {
                Ok(()) => {}
                // Packing only saves copies: when the host refuses the bytes, serve in place.
                Err(e @ (SourceError::Refused(_) | SourceError::CeilingExceeded { .. })) => {
                    not_packed = Some(format!("small tensors served in place: {e}"));
                }
                Err(e) => return Err(e.into()),
            }
        }
        // Private file pages are never page-locked (the kernel would copy each one).
        let mut unregistered = 0u64;
        // A file mapped for its tensors is registered where they lie, not whole: the rest of
        // the file (tensors the framework converted, other components' bytes) stays unlocked.
        let mapped_files = storages.len()..storages.len() + files.paths.len();
        let ranges = source
            .storages_in_use()
            .into_iter()
            .filter(|(i, r)| {
                let keep = !files.private_in_place.contains(i);
                if !keep {
                    unregistered += r.len() as u64;
                }
                keep
            })
            .flat_map(|(i, r)| {
                if mapped_files.contains(&i) {
                    used_runs(source.slices(), |t| t.file.0 as usize == i, &r)
                } else {
                    vec![r]
                }
            })
            .map(|r| (r, true))
            .chain(source.packs().into_iter().map(|p| (p, true)))
            .collect();
        let packed = source.packed();
        let host = HostReport {
            kind: if files.paths.is_empty() { "host_tensors" } else { "host_tensors+file" },
            packed,
            not_packed,
            unregistered,
            unregistered_reason: (unregistered > 0).then(|| {
                "tensors in a written private file mapping are copied unregistered".to_owned()
            }),
            ..HostReport::default()
        };
        Ok((Arc::new(source), ranges, host))
    }

    /// Places the streamed units in `vmm_peer_store_device`'s memory when it is set, up to
    /// `vmm_peer_store_gb`; a refusal (no peer access, no memory there) leaves them streaming
    /// from host memory and says why in `host`.
    fn fill_peer_store(&self, arena: &Arena, host: &mut HostReport) {
        let s = &self.plan.settings;
        host.peer = None;
        if s.vmm_peer_store_device.is_empty() {
            return;
        }
        let peer = match ExecutionDevice::parse(&s.vmm_peer_store_device) {
            Ok(ExecutionDevice::Cuda(n)) => n,
            _ => {
                host.peer_note = Some(format!(
                    "vmm_peer_store_device = {:?} names no GPU: the units stream from host memory",
                    s.vmm_peer_store_device
                ));
                return;
            }
        };
        let limit = gib("vmm_peer_store_gb", s.vmm_peer_store_gb).unwrap_or(0);
        if self.target.device == ExecutionDevice::Host {
            // The host backend holds a peer's memory in host memory: the host must admit it.
            let plan = arena.plan();
            let mut bytes = 0u64;
            for (u, _) in
                arena.layout().units.iter().zip(&plan.slot_of).filter(|(_, s)| s.is_some())
            {
                if limit > 0 && bytes + u.len > limit {
                    break;
                }
                bytes += u.len;
            }
            let request = GrowthRequest { kind: GrowthKind::Retained, bytes, registered_bytes: 0 };
            if let Err(refusal) = self.target.platform.admission.admit(&request).into_result() {
                host.peer_note = Some(format!(
                    "no peer weight store on cuda:{peer}: the host backend holds it in host memory, and {refusal}; the units stream from host memory"
                ));
                return;
            }
        }
        match arena.fill_peer_store(ddo_core::DeviceOrdinal(peer), limit) {
            Ok(report) => {
                host.peer_note = None;
                host.peer = Some(report);
                // The fill leaves its last units in the slots: start the first pass warm again.
                let _ = arena.prime();
                let own = match self.target.device {
                    ExecutionDevice::Cuda(_) => Some(self.target.platform.residency.device().0),
                    ExecutionDevice::Host => None,
                };
                if own == Some(peer) && report.bytes > 0 {
                    host.peer_note = Some(format!(
                        "the peer weight store is in the computing GPU's own memory ({}), outside the arena's budget: set vmm_peer_store_gb to bound it",
                        ByteSize(report.bytes)
                    ));
                }
                if let (Some(own), Some(measure), None) =
                    (own, self.target.peer_link, host.peer_link)
                    && own != peer
                {
                    host.peer_link =
                        measure(ddo_core::DeviceOrdinal(own), ddo_core::DeviceOrdinal(peer));
                }
            }
            Err(e) => {
                host.peer_note = Some(format!(
                    "no peer weight store on cuda:{peer}: {e}; the units stream from host memory"
                ));
            }
        }
    }

    /// Registers `ranges` in order into `registered`, counting what stays unregistered (and
    /// why) in `host`. The ranges of file mappings are read in first, on their own threads,
    /// one range ahead: registering one overlaps reading the next, and registration never
    /// pins a page it would have to fault in itself. An error leaves `registered` for the
    /// caller to unregister.
    fn register_all(
        &self,
        ranges: Vec<(HostSlice, bool)>,
        registrar: &Registrar,
        registered: &mut Vec<RegisteredRange>,
        host: &mut HostReport,
    ) -> Result<(), SourceError> {
        use std::sync::atomic::{AtomicBool, Ordering};
        let s = &self.plan.settings;
        let register = self.route != SessionRoute::Linear || self.plan.effective_pin_cpu_memory;
        let read_in = std::mem::take(&mut host.read_in);
        let readers = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .clamp(1, 16)
            .max(s.pin_cpu_workers as usize);
        let pending: HashSet<usize> = read_in.iter().map(|r| r.range).collect();
        let spans: Vec<(usize, usize)> =
            ranges.iter().map(|(r, _)| (r.offset(), r.len())).collect();
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            // A rendezvous: the reader reads the next range while this one is registered.
            let (done, arrived) = std::sync::mpsc::sync_channel::<usize>(0);
            let (stop, spans) = (&stop, &spans);
            let reader = scope.spawn(move || {
                let started = Instant::now();
                let mut bytes = 0u64;
                for r in &read_in {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let (offset, len) = spans[r.range];
                    bytes += r.file.populate(offset, len, readers) as u64;
                    if done.send(r.range).is_err() {
                        break;
                    }
                }
                (bytes, started.elapsed().as_secs_f64())
            });
            let mut read = HashSet::new();
            let mut result = Ok(());
            for (i, (range, read_only)) in ranges.into_iter().enumerate() {
                // A range not read in yet waits for its read (a reader that stopped leaves the
                // rest to the first touch).
                while pending.contains(&i) && !read.contains(&i) {
                    match arrived.recv() {
                        Ok(r) => read.insert(r),
                        Err(_) => break,
                    };
                }
                let len = range.len() as u64;
                if !register {
                    host.unregistered += len;
                    host.unregistered_reason.get_or_insert_with(|| "pin_cpu_memory is off".into());
                    continue;
                }
                match registrar.register(range, read_only) {
                    Ok(r) => {
                        host.registered += len;
                        registered.push(r);
                    }
                    Err(
                        e @ (SourceError::CeilingExceeded { .. }
                        | SourceError::Refused(_)
                        | SourceError::Device(_)),
                    ) if self.route != SessionRoute::Linear || s.allow_pin_memory_fallback => {
                        host.unregistered += len;
                        host.unregistered_reason.get_or_insert(e.to_string());
                    }
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            stop.store(true, Ordering::Relaxed);
            drop(arrived);
            if let Ok((bytes, seconds)) = reader.join() {
                host.stages.read_in_bytes = bytes;
                host.stages.read_in_seconds = seconds;
            }
            result
        })
    }

    /// The registrar of `ranges`: its ceiling from the route's settings.
    fn registrar(&self, ranges: &[(HostSlice, bool)]) -> Result<Registrar, SessionError> {
        let s = &self.plan.settings;
        let needed: u64 = ranges
            .iter()
            .map(|(r, _)| (r.len() as u64).div_ceil(REGISTRATION_SEGMENT) * REGISTRATION_SEGMENT)
            .sum();
        let ceiling = match self.route {
            SessionRoute::Native => {
                let registered = if s.vmm_source_registered_gb > 0.0 {
                    s.vmm_source_registered_gb
                } else {
                    s.vmm_source_cache_gb
                };
                if registered > 0.0 { gib("vmm_source_registered_gb", registered)? } else { needed }
            }
            SessionRoute::Linear if s.pin_weight_budget_gb > 0.0 => {
                gib("pin_weight_budget_gb", s.pin_weight_budget_gb)?.div_ceil(REGISTRATION_SEGMENT)
                    * REGISTRATION_SEGMENT
            }
            SessionRoute::Linear | SessionRoute::Disk => needed,
        };
        let p = &self.target.platform;
        Ok(Registrar::new(ceiling, p.residency.clone(), p.admission.clone()))
    }

    /// Every parameter name -> the source's slice; checks declared dtypes and shapes.
    fn bind(
        &self,
        slices: &[TensorSlice],
        on_device: &HashMap<usize, Dtype>,
    ) -> Result<HashMap<String, usize>, SessionError> {
        let index: HashMap<&str, usize> =
            slices.iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
        let what = match self.weights {
            Weights::Checkpoint { .. } => "the checkpoint",
            Weights::Host { .. } => "the host tensors",
        };
        let mut out = HashMap::new();
        for p in &self.assignment.parameters {
            let Some(&i) = p.names.iter().find_map(|n| index.get(n.as_str())) else {
                return Err(SessionError::Weights(format!(
                    "parameter {} has no tensor in {what}; route {} streams every weight from it",
                    p.names[0],
                    self.route.name()
                )));
            };
            let t = &slices[i];
            let served = on_device.get(&i).copied().unwrap_or(t.dtype);
            let dtype_differs = p.dtype.is_some_and(|d| d != served);
            let shape_differs = p.shape.as_ref().is_some_and(|s| *s != t.shape);
            if (dtype_differs || shape_differs) && !views_bytes(p.dtype, p.shape.as_deref(), t) {
                let hint = if shape_differs {
                    "the checkpoint is not this model's"
                } else {
                    "ddo converts between F32, F16 and BF16 and widens fp8 to them; load the model with torch_dtype matching the checkpoint"
                };
                return Err(SessionError::Weights(format!(
                    "parameter {} is {} {:?} but {what} stores {} {:?}; {hint}",
                    p.names[0],
                    p.dtype.map_or("?", Dtype::as_str),
                    p.shape.clone().unwrap_or_default(),
                    t.dtype.as_str(),
                    t.shape
                )));
            }
            for n in &p.names {
                out.insert(n.clone(), i);
            }
        }
        refuse_unbound_scales(slices, &out)?;
        Ok(out)
    }

    /// The arena's units: the resident rest (pinned, first) and one per streamed block.
    fn unit_specs(&self, source: &dyn WeightSource) -> Vec<UnitSpec> {
        self.assignment.unit_specs(source.slices())
    }

    fn attached<'a>(
        guard: &'a mut MutexGuard<'_, Option<Attached>>,
    ) -> Result<&'a mut Attached, SessionError> {
        guard.as_mut().ok_or_else(|| {
            SessionError::Lifecycle("the component is unloaded: call reload() first".into())
        })
    }

    /// The units of the current attach, in arena id order.
    pub fn units(&self) -> Result<Vec<UnitInfo>, SessionError> {
        let mut g = self.lock();
        Ok(Self::attached(&mut g)?.units.clone())
    }

    /// Where parameter `name` (any alias) lives for this attach.
    pub fn tensor(&self, name: &str) -> Result<TensorView, SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        let &i = a.slices.get(name).ok_or_else(|| {
            SessionError::Weights(format!("no parameter {name:?} in this session"))
        })?;
        let (_, range) =
            a.memory.arena.tensor_range(i).ok_or_else(|| {
                SessionError::Weights(format!("parameter {name:?} is in no unit"))
            })?;
        let slice = &a.source.slices()[i];
        Ok(TensorView {
            address: range.start.0,
            len: range.len,
            dtype: a.host.device_conversions.get(&i).copied().unwrap_or(slice.dtype),
            shape: slice.shape.clone(),
            owner: a.memory.clone(),
        })
    }

    /// The device bytes of parameter `name` now (waits for all device work; verification only).
    /// A streamed unit's bytes are meaningful only while a lease on it is live.
    pub fn read_tensor(&self, name: &str) -> Result<Vec<u8>, SessionError> {
        let view = self.tensor(name)?;
        let mut out = vec![0u8; view.len as usize];
        let range =
            ddo_core::DeviceRange { start: ddo_core::DeviceAddress(view.address), len: view.len };
        self.target.platform.residency.read_back(range, &mut out)?;
        Ok(out)
    }

    /// The bytes of parameter `name` as its source holds them (the checkpoint, or the module's
    /// host tensors): what the parameter is, whatever unit its slot holds now.
    pub fn source_tensor(&self, name: &str) -> Result<Vec<u8>, SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        let &i = a.slices.get(name).ok_or_else(|| {
            SessionError::Weights(format!("no parameter {name:?} in this session"))
        })?;
        let mut out = vec![0u8; a.source.slices()[i].len as usize];
        a.source.read(i, &mut out)?;
        if let Some(&to) = a.host.device_conversions.get(&i) {
            let from = a.source.slices()[i].dtype;
            let mut served =
                vec![0u8; out.len() / from.size_bytes() as usize * to.size_bytes() as usize];
            ddo_core::convert(from, to, &out, &mut served);
            return Ok(served);
        }
        Ok(out)
    }

    /// Starts a forward pass on `stream`: the pass leases of a pass that never ended are given
    /// back (after the work already enqueued on `stream`), the order of the first pass is
    /// learned, and the pinned units and the units the plan keeps resident are leased for the
    /// pass. Returns the latter: the pass calls [`reached`](Session::reached) for them instead of
    /// acquiring them (work on `stream` only; other streams acquire as usual). Leases taken with
    /// [`acquire`](Session::acquire) belong to whoever took them, on whatever stream or thread:
    /// no pass gives them back, so another stream's work never loses its memory at a pass
    /// boundary.
    pub fn begin_pass(&self, stream: StreamId) -> Result<Vec<UnitId>, SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        Self::release_pass(a, stream)?;
        // Uploads check the files' status on their open descriptors; a path renamed over is
        // noticed here, once per pass.
        a.memory.arena.check_source()?;
        if let Some(link) = self.target.link_bytes_per_second {
            let streamed = a.memory.arena.plan().streamed_bytes;
            if let Some(auto) =
                self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()).as_mut()
            {
                auto.pass_begins(Instant::now(), streamed as f64 / link);
            }
        }
        a.memory.arena.begin_pass();
        let resident: Vec<UnitId> =
            a.units.iter().filter(|u| u.resident && !u.pinned).map(|u| u.id).collect();
        let leased = (|| -> Result<(), SessionError> {
            for u in a.units.iter().filter(|u| u.pinned) {
                let lease = a.memory.arena.acquire(u.id, stream)?;
                a.pass.push(lease);
            }
            a.pass.extend(a.memory.arena.lease_for_pass(&resident, stream)?);
            Ok(())
        })();
        if let Err(e) = leased {
            // Nothing stays leased by a pass that did not begin.
            a.memory.arena.abandon_pass();
            return Err(e.with_cleanup(Self::release_pass(a, stream)));
        }
        Ok(resident)
    }

    /// The pass reached `unit`, which [`begin_pass`](Session::begin_pass) leased for it: the
    /// order is tracked and what comes next prefetched.
    pub fn reached(&self, unit: UnitId) -> Result<(), SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        a.memory.arena.reached(unit)?;
        Ok(())
    }

    /// Refused while a pass holds leases: `what` (a change made between passes) says what.
    fn between_passes(a: &Attached, what: &str) -> Result<(), SessionError> {
        let live = a.leases.len() + a.pass.len();
        if live == 0 {
            return Ok(());
        }
        Err(SessionError::Lifecycle(format!(
            "{what} ({live} lease(s) live): end the pass and release every acquired lease first"
        )))
    }

    /// Gives the pass leases back after one fence on `stream`; a failed record keeps their
    /// memory unsafe (the arena's contract).
    fn release_pass(a: &mut Attached, stream: StreamId) -> Result<(), SessionError> {
        let pass: Vec<Lease> = a.pass.drain(..).collect();
        a.memory.arena.release_all(pass, stream).map_err(SessionError::Arena)
    }

    /// Ends a forward pass: gives back the pinned and plan-resident units after the work
    /// enqueued on `stream`. Leases taken with [`acquire`](Session::acquire) stay live until
    /// released.
    pub fn end_pass(&self, stream: StreamId) -> Result<(), SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        Self::release_pass(a, stream)
    }

    /// Gives back every live lease, the pass's and every [`acquire`](Session::acquire)'s, after
    /// one fence on `stream`: for a teardown once the device's work is complete and nothing
    /// enqueues more with them (before [`unload`](Session::unload), which refuses live leases).
    pub fn release_leases(&self, stream: StreamId) -> Result<(), SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        let all: Vec<Lease> = a.pass.drain(..).chain(a.leases.drain().map(|(_, l)| l)).collect();
        a.memory.arena.release_all(all, stream).map_err(SessionError::Arena)
    }

    /// Ends a pass that was interrupted (an exception inside the forward): gives back the pass
    /// leases after the work enqueued on `stream`, and the order seen is not learned. The caller
    /// releases the leases its own blocks acquired, on their streams.
    pub fn abort_pass(&self, stream: StreamId) -> Result<(), SessionError> {
        if let Some(auto) = self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            auto.interrupted();
        }
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        a.memory.arena.abandon_pass();
        Self::release_pass(a, stream)
    }

    /// Ensures `unit` is on the device for work enqueued on `stream` after this call.
    pub fn acquire(&self, unit: UnitId, stream: StreamId) -> Result<LeaseId, SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        let lease = a.memory.arena.acquire(unit, stream)?;
        let id = a.next_lease;
        a.next_lease += 1;
        a.leases.insert(id, lease);
        Ok(LeaseId(id))
    }

    /// Gives `lease` back after the work enqueued on `stream` that used it.
    pub fn release(&self, lease: LeaseId, stream: StreamId) -> Result<(), SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        let l = a
            .leases
            .remove(&lease.0)
            .ok_or_else(|| SessionError::Lifecycle(format!("lease {} is not live", lease.0)))?;
        a.memory.arena.release(l, stream)?;
        Ok(())
    }

    /// Plans the arena again under a GPU budget of `total` bytes (the whole arena: resident
    /// units, slots and staging; no headroom inside it), keeping the source and the host
    /// registrations: the old arena is closed first, so the two never hold device memory
    /// together. Later reloads keep this budget. Refused during a pass. Returns `false`, changing
    /// nothing, while views handed out ([`TensorView::owner`]) still hold the arena's memory.
    /// When the new budget cannot be planned the arena is planned again under its old budget and
    /// the error returned; if even that fails the component is left unloaded.
    pub fn set_budget(&self, total: u64) -> Result<bool, SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        Self::between_passes(a, "the budget changes between passes")?;
        let mut attached = g.take().expect("attached");
        let mut memory = match Arc::try_unwrap(attached.memory) {
            Ok(m) => m,
            Err(held) => {
                attached.memory = held;
                *g = Some(attached);
                return Ok(false);
            }
        };
        let old = memory.arena.plan().budget;
        if let Err(e) = memory.arena.close() {
            attached.memory = Arc::new(memory);
            *g = Some(attached);
            return Err(e.into());
        }
        // The attach's counters go on across the new arena.
        attached.earlier = attached.earlier.then(&memory.arena.stats());
        let p = &self.target.platform;
        let specs = self.unit_specs(&*attached.source);
        let conversions = &attached.host.device_conversions;
        let build = |budget: Budget| -> Result<Arena, SessionError> {
            let arena =
                Arena::with_conversions(p, attached.source.clone(), &specs, budget, conversions)
                    .map_err(|e| self.arena_error(e))?;
            arena.prime().and_then(|_| arena.settle_resident())?;
            Ok(arena)
        };
        let wanted = Budget { total, headroom: 0, prefetch_depth: old.prefetch_depth };
        let (arena, result) = match build(wanted) {
            Ok(arena) => (arena, Ok(true)),
            Err(e) => match build(old) {
                Ok(arena) => (arena, Err(e)),
                // Nothing fits any more: the component ends unloaded (dropping the memory
                // unregisters the host ranges).
                Err(_) => return Err(e),
            },
        };
        memory.arena = arena;
        self.fill_peer_store(&memory.arena, &mut attached.host);
        if result.is_ok() {
            *self.budget_override.lock().unwrap_or_else(|p| p.into_inner()) = Some(total);
        }
        let plan = memory.arena.plan();
        for (unit, resident) in attached.units.iter_mut().zip(&plan.resident) {
            unit.resident = *resident;
        }
        attached.memory = Arc::new(memory);
        *g = Some(attached);
        result
    }

    /// Whether `vmm_weight_encoding = auto` timed the passes as transfer-bound and the streamed
    /// units should switch to encoded streaming ([`switch_encoding`](Self::switch_encoding),
    /// between passes).
    pub fn encoding_switch_due(&self) -> bool {
        matches!(
            &*self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()),
            Some(AutoEncoding::Encode { applied: false, .. })
        )
    }

    /// Attaches again with the streamed units' tensors encoded, as `auto` decided: the arena is
    /// rebuilt (new addresses) and its counters go on. `false` (nothing changed, and the
    /// component stays raw) while tensors view its memory. Refused during a pass. When encoding
    /// fails (the host cannot hold the encodings) the component attaches raw again, the reason
    /// goes to the profile and the error is returned.
    pub fn switch_encoding(&self) -> Result<bool, SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        Self::between_passes(a, "the weights switch to encoded streaming between passes")?;
        let decide = |state: AutoEncoding| {
            *self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()) = Some(state);
        };
        let why = match &*self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(AutoEncoding::Encode { applied: false, why }) => why.clone(),
            _ => return Ok(false),
        };
        let earlier = {
            let mut attached = g.take().expect("attached");
            let memory = match Arc::try_unwrap(attached.memory) {
                Ok(m) => m,
                Err(held) => {
                    attached.memory = held;
                    *g = Some(attached);
                    decide(AutoEncoding::Raw {
                        why: format!("{why}, but tensors kept from the module view the arena"),
                    });
                    return Ok(false);
                }
            };
            let earlier = attached.earlier.then(&memory.arena.stats());
            memory.close()?;
            earlier
            // The raw attach's source and its mapping go here, before the checkpoint is
            // mapped and encoded again: host memory never holds both.
        };
        decide(AutoEncoding::Encode { applied: true, why: why.clone() });
        let (mut new, result) = match self.attach() {
            Ok(new) => (new, Ok(true)),
            Err(e) => {
                decide(AutoEncoding::Raw { why: format!("{why}, but encoding failed: {e}") });
                (self.attach()?, Err(e))
            }
        };
        new.earlier = earlier;
        *g = Some(new);
        result
    }

    /// Releases the memory of idle execution slots (addresses kept; the next use uploads again).
    pub fn reclaim(&self) -> Result<ReclaimReport, SessionError> {
        let mut g = self.lock();
        Ok(Self::attached(&mut g)?.memory.arena.reclaim_idle()?)
    }

    /// Frees the weights' device memory and host registrations once every fence completed.
    /// Refused while a lease is live. Views handed out ([`TensorView::owner`]) keep the memory
    /// until they are dropped; it is freed then. Returns whether the memory was freed now
    /// (`false`: views still hold it).
    pub fn unload(&self) -> Result<bool, SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        Self::between_passes(a, "unload during a forward pass")?;
        let attached = g.take().expect("attached");
        match Arc::try_unwrap(attached.memory) {
            Ok(memory) => {
                // Nothing else holds the memory: close now and report a failure.
                memory.close()?;
                Ok(true)
            }
            Err(_held) => Ok(false),
        }
    }

    /// Whether the weights are unloaded.
    pub fn is_unloaded(&self) -> bool {
        self.lock().is_none()
    }

    /// Attaches again after [`unload`](Self::unload): the checkpoint is opened again (and its
    /// identity recorded anew); addresses differ from the previous attach.
    pub fn reload(&self) -> Result<(), SessionError> {
        let mut g = self.lock();
        if g.is_some() {
            return Err(SessionError::Lifecycle(
                "reload needs an unloaded component (call unload() first)".into(),
            ));
        }
        if let Some(auto) = self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            auto.interrupted();
        }
        *g = Some(self.attach()?);
        Ok(())
    }

    /// A metrics snapshot; `phase` labels the host-memory observation (`None` skips it).
    pub fn metrics(&self, phase: Option<&str>) -> ddo_metrics::DynamicOffloadMetrics {
        crate::report::snapshot(self, phase)
    }

    pub(crate) fn with_attached<R>(&self, f: impl FnOnce(Option<&AttachedView<'_>>) -> R) -> R {
        let g = self.lock();
        match g.as_ref() {
            Some(a) => {
                let plan = a.memory.arena.plan();
                let view = AttachedView {
                    stats: a.earlier.then(&a.memory.arena.stats()),
                    plan,
                    units: &a.units,
                    registered: a.host.registered,
                    registered_charged: a.memory.registrar.charged(),
                    unregistered: a.host.unregistered,
                    unregistered_reason: a.host.unregistered_reason.as_deref(),
                    retained: a.host.retained.as_ref(),
                    packed: a.host.packed,
                    conversion: a.host.conversion,
                    device_conversions: a.host.device_conversions.len() as u64,
                    host_short: a.host.host_short,
                    staging_short: a.host.staging_short,
                    not_packed: a.host.not_packed.as_deref(),
                    host_kind: a.host.kind,
                    read_workers: a.host.read_workers,
                    staging: a.host.staging.as_ref().map(|p| (p.stats(), p.is_direct())),
                    staging_note: a.host.staging_note.as_deref(),
                    tier_reason: a.host.tier_reason.as_deref(),
                    encoding_note: a.host.encoding_note.as_deref(),
                    encoding: a.host.encoding.as_ref(),
                    setup_seconds: a.setup_seconds,
                    stages: a.host.stages,
                    peer: a.host.peer,
                    peer_stored: a.memory.arena.peer_stored(),
                    peer_note: a.host.peer_note.as_deref(),
                    peer_link: a.host.peer_link,
                    total_bytes: a.total_bytes,
                    tensor_count: a.tensor_count,
                };
                f(Some(&view))
            }
            None => f(None),
        }
    }

    pub(crate) fn module_count(&self) -> Option<u64> {
        self.tree.as_ref().map(|t| t.modules.len() as u64)
    }

    pub(crate) fn link(&self) -> Option<f64> {
        self.target.link_bytes_per_second
    }

    /// Closes the session: unloads (refused while leases are live).
    pub fn close(self) -> Result<(), SessionError> {
        if self.is_unloaded() { Ok(()) } else { self.unload().map(|_| ()) }
    }
}

/// What metrics read of one attach.
pub(crate) struct AttachedView<'a> {
    pub(crate) stats: ddo_arena::ArenaStats,
    pub(crate) plan: &'a ddo_arena::ResidencyPlan,
    pub(crate) units: &'a [UnitInfo],
    pub(crate) registered: u64,
    #[allow(dead_code)]
    pub(crate) registered_charged: u64,
    pub(crate) unregistered: u64,
    pub(crate) unregistered_reason: Option<&'a str>,
    pub(crate) retained: Option<&'a RetainedReport>,
    pub(crate) packed: PackReport,
    pub(crate) conversion: Option<ConversionReport>,
    pub(crate) device_conversions: u64,
    pub(crate) host_short: bool,
    pub(crate) staging_short: bool,
    pub(crate) not_packed: Option<&'a str>,
    pub(crate) host_kind: &'static str,
    pub(crate) read_workers: Option<u64>,
    /// The staging pool's counters and whether it reads with O_DIRECT.
    pub(crate) staging: Option<(ddo_source::StagingStats, bool)>,
    pub(crate) staging_note: Option<&'a str>,
    pub(crate) tier_reason: Option<&'a str>,
    pub(crate) encoding_note: Option<&'a str>,
    pub(crate) encoding: Option<&'a EncodingReport>,
    pub(crate) setup_seconds: f64,
    pub(crate) stages: SetupStages,
    pub(crate) peer: Option<ddo_arena::PeerStoreReport>,
    /// Per unit: held by the peer weight store.
    pub(crate) peer_stored: Vec<bool>,
    pub(crate) peer_note: Option<&'a str>,
    pub(crate) peer_link: Option<f64>,
    pub(crate) total_bytes: u64,
    pub(crate) tensor_count: u64,
}

/// A checkpoint's source, its mapped form when mapped, the host ranges to register and what the
/// host side is.
type CheckpointBytes =
    (Arc<dyn WeightSource>, Option<Arc<CheckpointSource>>, Vec<(HostSlice, bool)>, HostReport);

/// The smallest tensor `on` encodes: below it the encoding's 8 KiB decoding table leaves
/// little or nothing saved, and the decode is a kernel launch for little.
const MIN_ON_BYTES: u64 = 64 << 10;

/// Passes `auto` times before choosing (after the first, which loads kernels).
const AUTO_TIMED_PASSES: u32 = 3;
/// A pass within this factor of its copy floor is transfer-bound: encoding shortens it.
const TRANSFER_BOUND: f64 = 1.15;

/// `vmm_weight_encoding = auto` where the link is measured: the first passes stream raw and the
/// time between their starts is compared with the copy floor of the bytes they stream. Passes at
/// the floor are transfer-bound and switch to encoded streaming (fewer bytes cross the link);
/// passes well above it are compute-bound and stay raw (decoding would only add device work).
#[derive(Debug, Clone, PartialEq)]
enum AutoEncoding {
    /// Passes being timed: when the last began (`None` after an interrupted pass or a
    /// reload), the seconds between timed starts so far, and the passes seen.
    Timing { last: Option<Instant>, intervals: Vec<f64>, passes: u32 },
    /// Encode the streamed units (`applied` once attached so).
    Encode { applied: bool, why: String },
    /// Stay raw.
    Raw { why: String },
}

impl AutoEncoding {
    fn timing() -> AutoEncoding {
        AutoEncoding::Timing { last: None, intervals: Vec::new(), passes: 0 }
    }

    /// A pass was interrupted or the weights attached again: the time to the next start is not
    /// a pass's.
    fn interrupted(&mut self) {
        if let AutoEncoding::Timing { last, .. } = self {
            *last = None;
        }
    }

    /// A pass begins at `now`; the passes before it streamed at a copy floor of `floor` seconds.
    fn pass_begins(&mut self, now: Instant, floor: f64) {
        let AutoEncoding::Timing { last, intervals, passes } = self else { return };
        *passes += 1;
        // The first interval holds the first pass (kernel loading, first uploads): not timed.
        if let Some(t) = last.replace(now)
            && *passes > 2
        {
            intervals.push(now.duration_since(t).as_secs_f64());
        }
        if intervals.len() < AUTO_TIMED_PASSES as usize {
            return;
        }
        // The median: a gap between passes (the rest of a pipeline, the host's own work) makes
        // one interval longer, not the pass.
        intervals.sort_by(f64::total_cmp);
        let pass = intervals[intervals.len() / 2];
        *self = if floor <= 0.0 {
            AutoEncoding::Raw { why: "no unit streams".into() }
        } else if pass <= TRANSFER_BOUND * floor {
            AutoEncoding::Encode {
                applied: false,
                why: format!(
                    "a raw pass took {pass:.4} s at its copy floor of {floor:.4} s (transfer-bound)"
                ),
            }
        } else {
            AutoEncoding::Raw {
                why: format!(
                    "a pass took {pass:.4} s, {:.2}x its copy floor of {floor:.4} s (compute-bound: decoding would add device work and save no time)",
                    pass / floor
                ),
            }
        };
    }
}

/// The smallest tensor `auto` streams entropy-coded where no link was measured to weigh it
/// against: its encoding carries an 8 KiB decoding table, and decoding a small tensor is a
/// kernel launch for little.
const MIN_ENCODED_BYTES: u64 = 1 << 20;

/// The ranges of file mappings `maps` holding tensors served as stored (not in `skip`): what a
/// host registers when the rest is converted or encoded.
fn stored_runs(
    slices: &[TensorSlice],
    skip: &HashSet<usize>,
    maps: &[HostSlice],
) -> Vec<(HostSlice, bool)> {
    let skip: HashSet<&str> = skip.iter().map(|&i| slices[i].name.as_str()).collect();
    maps.iter()
        .enumerate()
        .flat_map(|(file, map)| {
            used_runs(slices, |t| t.file.0 as usize == file && !skip.contains(t.name.as_str()), map)
        })
        .map(|r| (r, true))
        .collect()
}

/// The parts of `region` (one file or storage, offsets as the slices give them) that the
/// tensors `uses` selects lie in: whole pages, merged across gaps of up to
/// [`ddo_arena::MAX_BRIDGED_GAP`] (a copy spanning such a gap must start and end in one
/// registration).
fn used_runs(
    slices: &[TensorSlice],
    uses: impl Fn(&TensorSlice) -> bool,
    region: &HostSlice,
) -> Vec<HostSlice> {
    // Whole host pages: two runs never share a page, so neither registration overlaps the other.
    let page = ddo_platform::linux::page_size();
    let mut runs: Vec<(u64, u64)> = slices
        .iter()
        .filter(|t| t.len > 0 && uses(t))
        .map(|t| (t.offset / page * page, (t.offset + t.len).div_ceil(page) * page))
        .collect();
    runs.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (start, end) in runs {
        match merged.last_mut() {
            Some(last) if start <= last.1 + ddo_arena::MAX_BRIDGED_GAP => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    merged
        .into_iter()
        .filter_map(|(start, end)| {
            let end = end.min(region.len() as u64);
            region
                .slice(usize::try_from(start).ok()?, usize::try_from(end.checked_sub(start)?).ok()?)
        })
        .collect()
}

/// The tensors of one unit (`unit`: indices into `slices`) worth packing: those of at most
/// `threshold` bytes not adjacent to another tensor of the unit in the same storage. Adjacent
/// tensors already upload in one copy (a checkpoint file a framework mapped holds a block's
/// tensors back to back); moving one of them out would split that copy in two.
fn isolated_small(slices: &[TensorSlice], unit: &[usize], threshold: u64) -> Vec<usize> {
    let mut order = unit.to_vec();
    order.sort_by_key(|&i| (slices[i].file, slices[i].offset));
    let touches = |a: usize, b: usize| {
        let (a, b) = (&slices[a], &slices[b]);
        a.file == b.file && a.offset + a.len == b.offset
    };
    (0..order.len())
        .filter(|&k| {
            let i = order[k];
            let after = k > 0 && touches(order[k - 1], i);
            let before = k + 1 < order.len() && touches(i, order[k + 1]);
            slices[i].len <= threshold && !after && !before
        })
        .map(|k| order[k])
        .collect()
}

/// Whether a `U8` parameter of `shape` holds `t`'s bytes as rows of bytes (a quantized
/// framework parameter, such as a GGUF block tensor, over a tensor its file types otherwise):
/// same leading dimensions, last dimension in bytes.
fn views_bytes(dtype: Option<Dtype>, shape: Option<&[u64]>, t: &TensorSlice) -> bool {
    let (Some(Dtype::U8), Some(shape)) = (dtype, shape) else { return false };
    let (Some((&last, lead)), Some((&t_last, t_lead))) = (shape.split_last(), t.shape.split_last())
    else {
        return false;
    };
    lead == t_lead && t_last.checked_mul(t.dtype.size_bytes()) == Some(last)
}

/// Refuses an fp8 checkpoint with scale tensors no parameter takes ("scaled fp8"): its fp8
/// weights mean `weight * scale`, and serving them without their scales would be silently wrong.
fn refuse_unbound_scales(
    slices: &[TensorSlice],
    bound: &HashMap<String, usize>,
) -> Result<(), SessionError> {
    let fp8 = |t: &TensorSlice| matches!(t.dtype, Dtype::F8E4M3 | Dtype::F8E5M2);
    if !slices.iter().any(fp8) {
        return Ok(());
    }
    let used: std::collections::HashSet<usize> = bound.values().copied().collect();
    // `scale_weight` / `scaled_fp8` (ComfyUI), `weight_scale` / `input_scale` (compressed
    // tensors, ModelOpt), `weight_scale_inv` (block-scaled fp8): any scale no parameter takes.
    let scale = slices.iter().enumerate().find(|(i, t)| {
        let leaf = t.name.rsplit('.').next().unwrap_or(&t.name).to_ascii_lowercase();
        !used.contains(i) && leaf.contains("scale")
    });
    match scale {
        Some((_, t)) => Err(SessionError::Weights(format!(
            "the checkpoint holds fp8 weights with scale tensors ({}) that no parameter of the module takes: \
             its weights are meant to be multiplied by them, so ddo refuses to serve them unscaled; \
             use a checkpoint without scales (or dequantize it to bf16), or a module that declares the scales",
            t.name
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod auto_encoding_tests {
    use std::time::Duration;

    use super::*;

    /// The state after pass starts `first` seconds, then `each` seconds apart, at a 0.1 s floor.
    fn timed(first: f64, each: f64, starts: u32) -> AutoEncoding {
        let mut auto = AutoEncoding::timing();
        let mut t = Instant::now();
        for k in 0..starts {
            auto.pass_begins(t, 0.1);
            t += Duration::from_secs_f64(if k == 0 { first } else { each });
        }
        auto
    }

    #[test]
    fn passes_at_their_copy_floor_encode_and_slower_ones_stay_raw() {
        // Decided at the start of the fifth pass: three passes timed after the first.
        assert!(matches!(timed(5.0, 0.105, 4), AutoEncoding::Timing { .. }));
        match timed(5.0, 0.105, 5) {
            AutoEncoding::Encode { applied: false, why } => assert!(why.contains("transfer-bound")),
            other => panic!("{other:?}"),
        }
        match timed(0.1, 0.3, 5) {
            AutoEncoding::Raw { why } => assert!(why.contains("compute-bound"), "{why}"),
            other => panic!("{other:?}"),
        }
        // One long gap between passes (the rest of a pipeline) does not make them compute-bound.
        let mut gap = AutoEncoding::timing();
        let mut t = Instant::now();
        for each in [1.0, 0.105, 5.0, 0.105, 0.0] {
            gap.pass_begins(t, 0.1);
            t += Duration::from_secs_f64(each);
        }
        assert!(matches!(gap, AutoEncoding::Encode { .. }), "{gap:?}");
        // An interrupted pass is not timed.
        let mut cut = AutoEncoding::timing();
        let mut t = Instant::now();
        for k in 0..6 {
            if k == 3 {
                cut.interrupted();
            }
            cut.pass_begins(t, 0.1);
            t += Duration::from_secs_f64(if k == 0 { 1.0 } else { 0.105 });
        }
        assert!(matches!(cut, AutoEncoding::Encode { .. }), "{cut:?}");
        // A decision stays.
        let mut decided = timed(0.1, 0.3, 5);
        decided.pass_begins(Instant::now(), 1.0);
        assert!(matches!(decided, AutoEncoding::Raw { .. }));
        let mut nothing = AutoEncoding::timing();
        for _ in 0..5 {
            nothing.pass_begins(Instant::now(), 0.0);
        }
        assert_eq!(nothing, AutoEncoding::Raw { why: "no unit streams".into() });
    }

    #[test]
    fn a_switch_to_encoded_streaming_serves_the_same_bytes_and_keeps_the_counters() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let mut names = vec![("embed.weight".to_owned(), vec![1024, 8])];
        for b in 0..8 {
            names.push((format!("blocks.{b}.attn.weight"), vec![2048, 1024]));
        }
        // Weight-like: a few exponents, random signs and mantissas.
        let byte = |t: usize, i: u64| {
            let h = (t as u64 * 0x9e37_79b9 + i / 2).wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
            if i.is_multiple_of(2) { h as u8 } else { (0x3b + (h >> 8) % 3) as u8 }
        };
        crate::testing::write_dtype(&path, Dtype::BF16, &names, byte).unwrap();
        let plan = crate::testing::resolve_plan(&[
            ("execution_device", "cpu"),
            ("backend", "vmm"),
            ("vmm_resident_weight_budget_gb", "0.02"),
            ("vmm_weight_encoding", "auto"),
        ])
        .unwrap();
        let weights = Weights::Checkpoint { path: path.clone(), mmap: MmapChoice::never() };
        let platform = ddo_platform::host_platform(Arc::new(ddo_platform::host::HostDevice::new()));
        let target = ExecutionTarget::unmeasured(ExecutionDevice::Host, platform);
        let session =
            ComponentSession::open(SessionSpec { plan, weights, tree: None }, target).unwrap();
        // The host backend measures no link: make it time passes as a GPU's session does,
        // attached raw.
        *session.auto_encoding.lock().unwrap() = Some(AutoEncoding::timing());
        assert!(session.unload().unwrap());
        session.reload().unwrap();
        let setup = |s: &ComponentSession| s.metrics(None).setup;
        assert_eq!(setup(&session).encoded_tensors, None);
        let stream = StreamId(0);
        let pass = |s: &ComponentSession| {
            s.begin_pass(stream).unwrap();
            let mut seen = Vec::new();
            for unit in s.units().unwrap().iter().filter(|u| !u.pinned) {
                let lease = s.acquire(unit.id, stream).unwrap();
                seen.push(s.read_tensor(&format!("{}.attn.weight", unit.name)).unwrap());
                s.release(lease, stream).unwrap();
            }
            s.end_pass(stream).unwrap();
            seen
        };
        let raw = pass(&session);
        assert!(session.metrics(None).setup.streamed_units.unwrap() >= 2, "blocks stream");
        assert!(!session.encoding_switch_due());
        *session.auto_encoding.lock().unwrap() =
            Some(AutoEncoding::Encode { applied: false, why: "passes at the floor".into() });
        assert!(session.encoding_switch_due());
        assert!(session.switch_encoding().unwrap());
        assert!(!session.encoding_switch_due());
        let s = setup(&session);
        assert!(s.encoded_tensors.is_some_and(|n| n >= 2), "{s:?}");
        assert!(s.weight_encoding.as_deref().unwrap().contains("passes at the floor"), "{s:?}");
        for _ in 0..2 {
            assert_eq!(pass(&session), raw);
        }
        let rt = session.metrics(None).runtime;
        assert!(rt.device_decodes.unwrap() > 0, "{rt:?}");
        assert!(rt.passes.unwrap() >= 3, "the counters go on: {rt:?}");
        // Applied: a second call changes nothing.
        assert!(!session.switch_encoding().unwrap());
    }
}
