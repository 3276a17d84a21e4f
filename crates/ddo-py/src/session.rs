//! `Session`: a component session ([`ddo_session::ComponentSession`]) for Python. Glue only:
//! host tensors become [`HostRegion`]s that keep their PyTorch owner alive, streams are adopted,
//! tensor views become DLPack capsules, errors become the package's exceptions, and long calls
//! release the GIL.

use std::sync::Arc;

use ddo_session::core::{Dtype, HostRegion, HostSlice, StreamId, UnitId};
use ddo_session::source::{HostTensor, MmapChoice};
use ddo_session::{
    ComponentSession, ExecutionDevice, LeaseId, ModuleNode, ModuleTree, ParameterRef, SessionSpec,
    Weights,
};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::session_error;
use crate::plan::ResolvedPlan;

/// Host memory owned by a Python object (a PyTorch storage): the object is kept alive for as
/// long as the region lives, so the memory cannot be freed under a copy or registration.
struct PyHostRegion {
    address: usize,
    len: usize,
    _owner: Py<PyAny>,
}

impl std::fmt::Debug for PyHostRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PyHostRegion")
            .field("address", &self.address)
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: the address and length are fixed at construction, and `_owner` (the tensor holding
// the storage) keeps the memory allocated for as long as the region lives; the package hands the
// session tensors it no longer exposes to the user, so nothing writes them meanwhile.
unsafe impl HostRegion for PyHostRegion {
    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `address..address + len` is the owner's memory (checked non-null at
        // construction), kept alive by `_owner`; the package hands the session tensors it no
        // longer exposes to the user, so nothing writes them while the region lives.
        unsafe { std::slice::from_raw_parts(self.address as *const u8, self.len) }
    }
}

/// One tensor as the package describes it: `(name, torch dtype, shape, storage, byte offset)`.
type TensorRow = (String, String, Vec<u64>, usize, u64);
/// One parameter: `(name, key, torch dtype, shape)`; aliases share the key.
type ParameterRow = (String, u64, String, Vec<u64>);

/// A PyTorch dtype the session can stream and PyTorch can view through DLPack.
fn dtype(name: &str) -> PyResult<Dtype> {
    Dtype::from_torch(name).filter(|d| crate::dlpack::dtype_code(*d).is_some()).ok_or_else(|| {
        crate::errors::DynamicOffloadError::new_err(format!(
            "dtype {name} cannot be offloaded (supported: float16, bfloat16, float32, float64, \
             float8_e4m3fn, float8_e5m2, integer and bool dtypes)"
        ))
    })
}

/// The session of one component.
#[pyclass(module = "ddo._native", frozen)]
pub(crate) struct Session {
    /// Dropped in [`Drop`] with the GIL released (closing waits for the device and unregisters).
    inner: std::mem::ManuallyDrop<ComponentSession>,
    /// The device the session runs on; its CUDA handle adopts the package's streams.
    machine: ddo_compose::Machine,
}

impl Drop for Session {
    fn drop(&mut self) {
        // SAFETY: `inner` is taken exactly once, here, and never used after.
        let inner = unsafe { std::mem::ManuallyDrop::take(&mut self.inner) };
        // The object is being deallocated under the GIL; the close (fence waits, device memory,
        // unregistration: a device-wide sync on CUDA) runs without it.
        Python::attach(|py| py.detach(move || drop(inner)));
    }
}

#[pymethods]
impl Session {
    /// Opens a session for `plan` over a checkpoint at `path` (native route) or over host
    /// tensors (`storages` as `(address, bytes, owner)`, `tensors` as rows; linear route), with
    /// the module tree as `modules` `(path, is_list)` and `parameters` rows; `layers` names the
    /// layer modules (convolution, linear) route `linear_convolution` streams one by one.
    /// Releases the GIL while it plans, registers and uploads.
    #[new]
    #[pyo3(signature = (plan, modules, parameters, path=None, storages=None, tensors=None, layers=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        plan: &ResolvedPlan,
        modules: Vec<(String, bool)>,
        parameters: Vec<ParameterRow>,
        path: Option<std::path::PathBuf>,
        storages: Option<Vec<(usize, usize, Py<PyAny>)>>,
        tensors: Option<Vec<TensorRow>>,
        layers: Option<Vec<String>>,
    ) -> PyResult<Self> {
        let layers: std::collections::HashSet<String> = layers.into_iter().flatten().collect();
        let tree = ModuleTree {
            modules: modules
                .into_iter()
                .map(|(path, is_list)| ModuleNode { layer: layers.contains(&path), path, is_list })
                .collect(),
            parameters: parameters
                .into_iter()
                .map(|(name, key, d, shape)| {
                    Ok(ParameterRef { name, key, dtype: Some(dtype(&d)?), shape: Some(shape) })
                })
                .collect::<PyResult<_>>()?,
        };
        let weights = match (path, storages, tensors) {
            (Some(path), None, None) => {
                // SAFETY: the package's contract with its user (README, `from_pretrained_with_
                // dynamic_offload`): checkpoint files are not modified while a component streams
                // from them; a changed identity is detected before every upload.
                let mmap = unsafe { MmapChoice::auto() };
                Weights::Checkpoint { path, mmap }
            }
            (None, Some(storages), Some(tensors)) => {
                let storages = storages
                    .into_iter()
                    .map(|(address, len, owner)| {
                        if address == 0 && len > 0 {
                            return Err(crate::errors::DynamicOffloadError::new_err(
                                "a host tensor has no data (a meta tensor?)",
                            ));
                        }
                        let region: Arc<dyn HostRegion> =
                            Arc::new(PyHostRegion { address, len, _owner: owner });
                        Ok(HostSlice::whole(region))
                    })
                    .collect::<PyResult<Vec<_>>>()?;
                let tensors = tensors
                    .into_iter()
                    .map(|(name, d, shape, storage, offset)| {
                        Ok(HostTensor { name, dtype: dtype(&d)?, shape, storage, offset })
                    })
                    .collect::<PyResult<Vec<_>>>()?;
                // SAFETY: the same contract as the checkpoint route: files backing host tensors (a
                // checkpoint loaded lazily through its mapping) are not modified while offloaded.
                let mmap = unsafe { MmapChoice::auto() };
                Weights::Host { storages, tensors, mmap }
            }
            _ => {
                return Err(crate::errors::DynamicOffloadError::new_err(
                    "a session needs either a checkpoint path or host storages and tensors",
                ));
            }
        };
        let spec = SessionSpec { plan: plan.plan.clone(), weights, tree: Some(tree) };
        let (inner, machine) = py
            .detach(|| {
                ddo_session::SessionRoute::of(&spec.plan.route)?;
                let machine = ddo_compose::Machine::for_plan(&spec.plan)?;
                Ok((ComponentSession::open(spec, machine.target())?, machine))
            })
            .map_err(session_error)?;
        Ok(Session { inner: std::mem::ManuallyDrop::new(inner), machine })
    }

    /// `(device type, index)`: `("cuda", n)` or `("cpu", 0)`.
    fn device(&self) -> (&'static str, u32) {
        match self.inner.device() {
            ExecutionDevice::Cuda(n) => ("cuda", n),
            ExecutionDevice::Host => ("cpu", 0),
        }
    }

    /// The route's name.
    fn route(&self) -> &'static str {
        self.inner.route().name()
    }

    /// Warnings for the host to show.
    fn warnings(&self) -> Vec<String> {
        self.inner.warnings().to_vec()
    }

    /// The units: `(id, module path, pinned)`, in arena id order.
    fn units(&self) -> PyResult<Vec<(u32, String, bool)>> {
        let units = self.inner.units().map_err(session_error)?;
        Ok(units.into_iter().map(|u| (u.id.0, u.name, u.pinned)).collect())
    }

    /// The units streamed through slots (not resident), each as `(id, every name of every
    /// parameter it holds)`: their views are valid only while a lease is live.
    fn streamed_units(&self) -> PyResult<Vec<(u32, Vec<String>)>> {
        let units = self.inner.units().map_err(session_error)?;
        let assignment = self.inner.assignment();
        Ok(units
            .into_iter()
            .filter(|u| !u.pinned && !u.resident)
            .map(|u| {
                let names = assignment
                    .units
                    .iter()
                    .filter(|f| f.path == u.name)
                    .flat_map(|f| &f.parameters)
                    .flat_map(|&p| assignment.parameters[p].names.iter().cloned())
                    .collect();
                (u.id.0, names)
            })
            .collect())
    }

    /// The canonical name of every distinct parameter with its aliases.
    fn parameter_names(&self) -> Vec<Vec<String>> {
        self.inner.assignment().parameters.iter().map(|p| p.names.clone()).collect()
    }

    /// A DLPack capsule viewing parameter `name` in arena memory; it keeps that memory alive.
    fn dlpack(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        let view = self.inner.tensor(name).map_err(session_error)?;
        let (code, bits) = crate::dlpack::dtype_code(view.dtype).ok_or_else(|| {
            crate::errors::DynamicOffloadError::new_err(format!(
                "dtype {} has no DLPack code",
                view.dtype
            ))
        })?;
        let shape: Vec<i64> = view.shape.iter().map(|&d| d as i64).collect();
        let (device_type, device_id) = match self.inner.device() {
            ExecutionDevice::Cuda(n) => (crate::dlpack::K_DL_CUDA, n as i32),
            ExecutionDevice::Host => (crate::dlpack::K_DL_CPU, 0),
        };
        crate::dlpack::capsule(
            py,
            view.address,
            device_type,
            device_id,
            code,
            bits,
            shape,
            view.owner,
        )
    }

    /// The bytes of parameter `name` as its source holds them (for `state_dict`).
    fn source_tensor<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = py.detach(|| self.inner.source_tensor(name)).map_err(session_error)?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Starts a pass on `stream` (a raw `cudaStream_t`; any value on the host backend). These
    /// per-pass and per-unit calls release the GIL: an acquisition may read from disk or wait
    /// for room on the device. Returns the units leased for the whole pass (the plan's
    /// resident blocks): for work on `stream`, call `reached` for them instead of acquiring.
    fn begin_pass(&self, py: Python<'_>, stream: u64) -> PyResult<Vec<u32>> {
        let stream = self.stream(stream);
        let units = py.detach(|| self.inner.begin_pass(stream)).map_err(session_error)?;
        Ok(units.into_iter().map(|u| u.0).collect())
    }

    /// The pass reached unit `unit`, leased for it by `begin_pass`: tracks the order and
    /// prefetches what comes next (it may upload, so it releases the GIL too).
    fn reached(&self, py: Python<'_>, unit: u32) -> PyResult<()> {
        py.detach(|| self.inner.reached(UnitId(unit))).map_err(session_error)
    }

    /// Ends a pass on `stream`.
    fn end_pass(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        let stream = self.stream(stream);
        py.detach(|| self.inner.end_pass(stream)).map_err(session_error)
    }

    /// Ends an interrupted pass on `stream` (its order is not learned). Leases taken with
    /// `acquire` stay live: their holders release them.
    fn abort_pass(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        let stream = self.stream(stream);
        py.detach(|| self.inner.abort_pass(stream)).map_err(session_error)
    }

    /// Gives back every live lease after one fence on `stream`: a teardown, once the device's
    /// work is complete (before `unload`, which refuses live leases).
    fn release_leases(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        let stream = self.stream(stream);
        py.detach(|| self.inner.release_leases(stream)).map_err(session_error)
    }

    /// Acquires unit `unit` for work on `stream`; returns the lease id.
    fn acquire(&self, py: Python<'_>, unit: u32, stream: u64) -> PyResult<u64> {
        let stream = self.stream(stream);
        let lease =
            py.detach(|| self.inner.acquire(UnitId(unit), stream)).map_err(session_error)?;
        Ok(lease.0)
    }

    /// Releases lease `lease` after the work enqueued on `stream`.
    fn release(&self, py: Python<'_>, lease: u64, stream: u64) -> PyResult<()> {
        let stream = self.stream(stream);
        py.detach(|| self.inner.release(LeaseId(lease), stream)).map_err(session_error)
    }

    /// Releases idle slot memory; `(slots, bytes)`.
    fn reclaim(&self, py: Python<'_>) -> PyResult<(u32, u64)> {
        let r = py.detach(|| self.inner.reclaim()).map_err(session_error)?;
        Ok((r.slots, r.bytes))
    }

    /// Frees the device memory and registrations; `False` when tensors viewing it are still
    /// alive (it is freed when the last one is dropped).
    fn unload(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| self.inner.unload()).map_err(session_error)
    }

    /// Attaches again after unload (new addresses).
    fn reload(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.reload()).map_err(session_error)
    }

    /// Plans the arena again under a GPU budget of `total` bytes between passes, keeping the
    /// source and registrations; `False` (nothing changed) while tensors view its memory.
    fn set_budget(&self, py: Python<'_>, total: u64) -> PyResult<bool> {
        py.detach(|| self.inner.set_budget(total)).map_err(session_error)
    }

    /// `(floor, held)`: the smallest budget the arena plans under, and the bytes it holds at
    /// that budget once its idle slots are reclaimed.
    fn budget_floor(&self) -> PyResult<(u64, u64)> {
        self.inner.budget_floor().map_err(session_error)
    }

    /// Whether `vmm_weight_encoding = auto` timed the passes as transfer-bound: the streamed
    /// units should switch to encoded streaming between passes.
    fn encoding_switch_due(&self) -> bool {
        self.inner.encoding_switch_due()
    }

    /// Attaches again with the streamed units encoded (new addresses); `False` while tensors
    /// view the arena's memory.
    fn switch_encoding(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| self.inner.switch_encoding()).map_err(session_error)
    }

    /// Whether the weights are unloaded.
    fn is_unloaded(&self) -> bool {
        self.inner.is_unloaded()
    }

    /// The metrics snapshot as JSON; `phase` labels the host-memory observation.
    #[pyo3(signature = (phase=None))]
    fn metrics(&self, phase: Option<&str>) -> String {
        self.inner.metrics(phase).as_dict().to_string()
    }
}

impl Session {
    fn stream(&self, raw: u64) -> StreamId {
        match self.machine.cuda() {
            // SAFETY: the package passes PyTorch's live current stream of this device, whose
            // primary context the session's device uses.
            Some(cuda) => unsafe { cuda.adopt_stream(raw) },
            None => StreamId(raw),
        }
    }
}
