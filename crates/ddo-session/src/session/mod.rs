//! The component session: one component's weights streamed through one arena. One concern
//! per module: [`attach`] (and its rollback), [`sources`] (checkpoint, stored, encoded and host
//! bytes), [`host_tier`], [`encoding`] (the choice and the automatic state machine),
//! [`registration`], [`budget`], [`replan`] (set_budget, the encoding switch), [`passes`]
//! (passes and leases), [`lifecycle`] (reclaim, unload, reload), [`peer`] and [`report`] (the
//! metrics view). Decisions are pure functions over plain inputs, tested next to them.

mod attach;
mod budget;
mod encoding;
mod host_tier;
mod lifecycle;
mod passes;
mod peer;
mod registration;
mod replan;
mod report;
mod sources;
mod state;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use ddo_arena::{Assignment, ModuleTree, UnitRule};
use ddo_core::{Dtype, HostSlice, UnitId};
use ddo_policy::{Plan, Route, WeightEncoding};
use ddo_source::{Checkpoint, HostTensor, MmapChoice};

use crate::SessionError;
use crate::device::{ExecutionDevice, ExecutionTarget};
use encoding::AutoEncoding;
use state::Attached;

const GIB: f64 = (1u64 << 30) as f64;

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
    decode_speed: Mutex<Option<crate::decode_speed::DecodeSpeed>>,
    /// The encodings being written in the background, or written ([`encoding::JobSlot`]).
    encoding_job: Mutex<encoding::JobSlot>,
    /// Tests hold background encodings back while they hold this lock.
    #[cfg(test)]
    encoding_hold: Mutex<Option<Arc<std::sync::RwLock<()>>>>,
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
        let timed = s.vmm_weight_encoding == WeightEncoding::Auto
            && route == SessionRoute::Native
            && target.link_bytes_per_second.is_some()
            && target.platform.residency.decodes();
        // An earlier load of the same checkpoint files that found its passes transfer-bound
        // recorded so in the encoded-file folder: this one streams encoded from the start.
        let recorded = match (&weights, encoding::folder(s, &target)) {
            (Weights::Checkpoint { path, .. }, Some(folder)) if timed => Checkpoint::open(path)
                .ok()
                .and_then(|c| ddo_source::EncodedFileIdentity::of(&c, c.slices(), &[]).ok())
                .and_then(|id| ddo_source::recorded_decision(&folder.path, &id)),
            _ => None,
        };
        let auto_encoding = timed.then(|| match recorded {
            Some(why) => AutoEncoding::Encode {
                applied: false,
                why: format!("{why} (recorded by an earlier load)"),
            },
            None => AutoEncoding::timing(),
        });
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
            encoding_job: Mutex::new(encoding::JobSlot::Idle),
            #[cfg(test)]
            encoding_hold: Mutex::new(None),
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

    fn attached<'a>(
        guard: &'a mut MutexGuard<'_, Option<Attached>>,
    ) -> Result<&'a mut Attached, SessionError> {
        guard.as_mut().ok_or_else(|| {
            SessionError::Lifecycle("the component is unloaded: call reload() first".into())
        })
    }
}
