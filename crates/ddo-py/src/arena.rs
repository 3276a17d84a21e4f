//! `NativeArena`: the GPU weight arena of one component, fed from its checkpoint's registered
//! mapping or from retained host windows, with tensor views handed to PyTorch as DLPack capsules
//! over arena memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ddo_arena::{Arena, Budget, Lease, UnitSpec};
use ddo_core::{HostRegion, HostSlice, SourceError, StreamId, UnitId, WeightSource};
use ddo_platform::cuda::CudaDevice;
use ddo_platform::host::HostDevice;
use ddo_source::{
    Checkpoint, CheckpointSource, REGISTRATION_SEGMENT, ReadOptions, RegisteredRange, Registrar,
    RetainedReport, RetainedSource, RetainedStore,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// Retained windows of about one registration segment: whole tensors, so a unit's range
/// uploads in copies of link-speed size.
const RETAINED_WINDOW: u64 = REGISTRATION_SEGMENT;

fn runtime_error(e: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

/// The device an arena lives on: a CUDA GPU, or the host backend (CPU memory).
enum Device {
    Cuda(Arc<CudaDevice>),
    Host(#[allow(dead_code)] Arc<HostDevice>),
}

/// The arena of one component on one device.
#[pyclass(module = "ddo._native")]
pub(crate) struct NativeArena {
    arena: Arena,
    device: Device,
    registrar: Registrar,
    registered: Mutex<Vec<RegisteredRange>>,
    /// Why host ranges were left unregistered (ceiling or host refusal: the first reason).
    unregistered: Option<String>,
    /// Host bytes copied unregistered (slower copies, same bytes).
    unregistered_bytes: u64,
    checkpoint: Arc<Checkpoint>,
    /// What the retained store kept, when host bytes come from it.
    retained: Option<RetainedReport>,
    leases: Mutex<HashMap<u64, Lease>>,
    next_lease: Mutex<u64>,
}

#[pymethods]
impl NativeArena {
    /// Opens the checkpoint at `path`, maps it (or, with `retained_ceiling` bytes > 0, reads it
    /// into retained windows under that ceiling), registers the host bytes read-only within
    /// `registration_ceiling` (default: all of them), lays out `units`
    /// (`(name, tensor names, pinned)`) and plans them under `budget` bytes (`headroom` kept
    /// free) with `prefetch_depth` units of look-ahead, on `device_type` `"cuda"` (device
    /// `ordinal`) or `"cpu"` (the host backend).
    #[new]
    #[pyo3(signature = (path, units, budget, headroom, prefetch_depth, device_type="cuda", ordinal=0, registration_ceiling=None, retained_ceiling=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        path: &str,
        units: Vec<(String, Vec<String>, bool)>,
        budget: u64,
        headroom: u64,
        prefetch_depth: u32,
        device_type: &str,
        ordinal: u32,
        registration_ceiling: Option<u64>,
        retained_ceiling: Option<u64>,
    ) -> PyResult<Self> {
        let (platform, device) = match device_type {
            "cuda" => {
                let (p, d) = ddo_platform::cuda_platform(ordinal).map_err(runtime_error)?;
                (p, Device::Cuda(d))
            }
            "cpu" => {
                let d = Arc::new(HostDevice::new());
                (ddo_platform::host_platform(d.clone()), Device::Host(d))
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "device type {other:?}: use \"cuda\" or \"cpu\""
                )));
            }
        };
        let checkpoint =
            Arc::new(Checkpoint::open(path).map_err(|e| PyValueError::new_err(e.to_string()))?);
        let mut specs = Vec::with_capacity(units.len());
        for (name, tensors, pinned) in units {
            let mut indices = Vec::with_capacity(tensors.len());
            for t in &tensors {
                indices.push(checkpoint.find(t).ok_or_else(|| {
                    PyValueError::new_err(format!(
                        "unit {name}: the checkpoint has no tensor {t:?}"
                    ))
                })?);
            }
            specs.push(UnitSpec { name, tensors: indices, pinned });
        }
        // Host bytes: retained windows (read once, under their storage ceiling; the rest is read
        // on demand), or the checkpoint's mapping. Either is registered, whole ranges in order,
        // until the registration ceiling or a host refusal; the rest copies unregistered.
        let (source, ranges, retained): (Arc<dyn WeightSource>, Vec<HostSlice>, _) =
            match retained_ceiling.filter(|c| *c > 0) {
                Some(ceiling) => {
                    let reader = CheckpointSource::new(checkpoint.clone(), ReadOptions::pread())
                        .map_err(runtime_error)?;
                    let store = RetainedStore::new(ceiling, platform.admission.clone());
                    let (source, report) =
                        RetainedSource::retain(Arc::new(reader), &store, RETAINED_WINDOW)
                            .map_err(runtime_error)?;
                    let windows = source.windows();
                    (Arc::new(source), windows, Some(report))
                }
                None => {
                    // SAFETY: ddo's contract with the caller: checkpoint files are not modified
                    // while a component streams from them (a changed file is detected before
                    // every upload).
                    let source = unsafe { CheckpointSource::with_mmap(checkpoint.clone(), 8) }
                        .map_err(runtime_error)?;
                    let maps = (0..checkpoint.files().len())
                        .map(|i| {
                            let map: Arc<dyn HostRegion> = source
                                .mapping(i)
                                .ok_or_else(|| runtime_error("no mapping"))?
                                .clone();
                            Ok(HostSlice::whole(map))
                        })
                        .collect::<PyResult<Vec<_>>>()?;
                    (Arc::new(source), maps, None)
                }
            };
        let needed: u64 = ranges
            .iter()
            .map(|r| (r.len() as u64).div_ceil(REGISTRATION_SEGMENT) * REGISTRATION_SEGMENT)
            .sum();
        let ceiling = registration_ceiling.unwrap_or(needed);
        let registrar =
            Registrar::new(ceiling, platform.residency.clone(), platform.admission.clone());
        let mut registered = Vec::new();
        let (mut unregistered, mut unregistered_bytes) = (None, 0u64);
        for range in ranges {
            let len = range.len() as u64;
            match registrar.register(range, true) {
                Ok(r) => registered.push(r),
                Err(e @ (SourceError::CeilingExceeded { .. } | SourceError::Refused(_))) => {
                    unregistered.get_or_insert(e.to_string());
                    unregistered_bytes += len;
                }
                Err(e) => return Err(runtime_error(e)),
            }
        }
        let arena = Arena::new(
            &platform,
            source,
            &specs,
            Budget { total: budget, headroom, prefetch_depth },
        )
        .map_err(|e| match e.original() {
            ddo_arena::ArenaError::BudgetTooSmall { .. } => PyValueError::new_err(e.to_string()),
            _ => runtime_error(e),
        })?;
        Ok(NativeArena {
            arena,
            device,
            registrar,
            registered: Mutex::new(registered),
            unregistered,
            unregistered_bytes,
            checkpoint,
            retained,
            leases: Mutex::new(HashMap::new()),
            next_lease: Mutex::new(1),
        })
    }

    /// `(device address, bytes)` of tensor `name`.
    fn tensor(&self, name: &str) -> PyResult<(u64, u64)> {
        let i = self
            .checkpoint
            .find(name)
            .ok_or_else(|| PyValueError::new_err(format!("no tensor {name:?}")))?;
        let (_, r) = self
            .arena
            .tensor_range(i)
            .ok_or_else(|| PyValueError::new_err(format!("tensor {name:?} is in no unit")))?;
        Ok((r.start.0, r.len))
    }

    /// A DLPack capsule viewing tensor `name` (its checkpoint dtype and shape) in arena memory.
    /// The capsule does not own the memory: the arena must outlive every tensor made from it.
    fn dlpack(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        let i = self
            .checkpoint
            .find(name)
            .ok_or_else(|| PyValueError::new_err(format!("no tensor {name:?}")))?;
        let slice = &self.checkpoint.slices()[i];
        let (_, r) = self
            .arena
            .tensor_range(i)
            .ok_or_else(|| PyValueError::new_err(format!("tensor {name:?} is in no unit")))?;
        let (code, bits) = crate::dlpack::dtype_code(slice.dtype).ok_or_else(|| {
            PyValueError::new_err(format!("dtype {} has no DLPack code", slice.dtype))
        })?;
        let shape: Vec<i64> = slice.shape.iter().map(|&d| d as i64).collect();
        let (device_type, device_id) = match &self.device {
            Device::Cuda(d) => {
                (crate::dlpack::K_DL_CUDA, ddo_core::Residency::device(&**d).0 as i32)
            }
            Device::Host(_) => (crate::dlpack::K_DL_CPU, 0),
        };
        crate::dlpack::capsule(py, r.start.0, device_type, device_id, code, bits, shape)
    }

    /// Ensures unit `unit` is on the device for work on `stream` (a raw `cudaStream_t`, e.g.
    /// `torch.cuda.current_stream().cuda_stream`); returns a lease id for [`release`].
    fn acquire(&self, unit: u32, stream: u64) -> PyResult<u64> {
        let s = self.stream(stream);
        let lease = self.arena.acquire(UnitId(unit), s).map_err(runtime_error)?;
        let mut next = self.next_lease.lock().expect("lease ids");
        let id = *next;
        *next += 1;
        self.leases.lock().expect("leases").insert(id, lease);
        Ok(id)
    }

    /// Gives lease `lease` back after the work enqueued on `stream` that used it.
    fn release(&self, lease: u64, stream: u64) -> PyResult<()> {
        let l = self
            .leases
            .lock()
            .expect("leases")
            .remove(&lease)
            .ok_or_else(|| PyValueError::new_err(format!("lease {lease} is not live")))?;
        self.arena.release(l, self.stream(stream)).map_err(runtime_error)
    }

    /// Marks the start of a forward pass.
    fn begin_pass(&self) {
        self.arena.begin_pass();
    }

    /// Enqueues the uploads of the resident units and the first streamed units (not waiting for
    /// them), so the first pass starts warm; returns the bytes enqueued.
    fn prime(&self) -> PyResult<u64> {
        self.arena.prime().map_err(runtime_error)
    }

    /// Releases idle slot backing (addresses kept); `(slots, bytes)`.
    fn reclaim(&self) -> PyResult<(u32, u64)> {
        let r = self.arena.reclaim_idle().map_err(runtime_error)?;
        Ok((r.slots, r.bytes))
    }

    /// The plan and counters as JSON.
    fn stats(&self) -> String {
        let plan = self.arena.plan();
        let stats = self.arena.stats();
        serde_json::json!({
            "runtime": stats.runtime_section(),
            "host_us_per_pair": stats.host_us_per_pair(),
            "unit_count": self.arena.layout().units.len(),
            "resident_units": plan.resident.iter().filter(|r| **r).count(),
            "streamed_units": plan.streamed_units(),
            "execution_slots": plan.slots,
            "slot_bytes": plan.slot_len,
            "gpu_budget_bytes": plan.budget.total,
            "headroom_bytes": plan.budget.headroom,
            "streamed_bytes_per_pass": plan.streamed_bytes,
            "total_bytes": self.arena.layout().payload(),
            "registered_bytes": self.registrar.charged(),
            "unregistered": self.unregistered,
            "unregistered_bytes": self.unregistered_bytes,
            "retained_bytes": self.retained.as_ref().map(|r| r.retained_bytes),
            "retained_windows": self.retained.as_ref().map(|r| r.windows),
            "unretained_bytes": self.retained.as_ref().map(|r| r.unretained_bytes),
            "retention_stopped": self.retained.as_ref().and_then(|r| r.stopped.clone()),
        })
        .to_string()
    }

    /// Closes the arena (refused while leases are live or memory is retained unsafe) and
    /// unregisters the checkpoint mapping (a phase boundary: unregistering waits for the device).
    fn close(&self) -> PyResult<()> {
        self.arena.close().map_err(runtime_error)?;
        let mut regs = self.registered.lock().expect("registrations");
        while let Some(r) = regs.pop() {
            self.registrar.unregister(r).map_err(runtime_error)?;
        }
        Ok(())
    }
}

impl NativeArena {
    /// The port's stream for a raw stream handle (CUDA) or any value (host backend, where work
    /// runs synchronously).
    fn stream(&self, raw: u64) -> StreamId {
        match &self.device {
            // SAFETY: the caller passes PyTorch's live stream of this device's primary context.
            Device::Cuda(d) => unsafe { d.adopt_stream(raw) },
            Device::Host(_) => StreamId(raw),
        }
    }
}
