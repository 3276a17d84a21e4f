//! The Python extension module `ddo._native`: the Rust core of the `ddo` package for Diffusers
//! hosts. Configuration resolution and validation live in `ddo-policy`, metrics rendering in
//! `ddo-metrics`, checkpoint validation in `ddo-source`; this module exposes them to Python (as
//! JSON text across the boundary) so the package holds no second copy of the rules. Every error
//! becomes a `ddo.DynamicOffloadError` (a `RuntimeError`) subclass chosen by its cause, with the
//! Rust message; configuration and capacity errors are also `ValueError`s. Nothing panics across
//! the boundary.

mod dlpack;
mod errors;
mod generation;
mod plan;
mod rules;
mod session;

use std::collections::BTreeMap;

use pyo3::prelude::*;

use crate::errors::{DynamicOffloadError, config_error};

fn value_error(e: impl std::fmt::Display) -> PyErr {
    config_error(e)
}

fn parse<T: serde::de::DeserializeOwned>(what: &str, json: &str) -> PyResult<T> {
    serde_json::from_str(json).map_err(|e| config_error(format!("invalid {what}: {e}")))
}

/// The version of the native extension.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// Validates a configuration object (JSON) given as `origin` (`config` or `argument`) without
/// resolving it; raises on unknown fields and invalid values, naming the field.
#[pyfunction]
#[pyo3(signature = (config, origin="config"))]
fn check_config(config: &str, origin: &str) -> PyResult<()> {
    let origin = match origin {
        "argument" => ddo_session::policy::Origin::Argument,
        _ => ddo_session::policy::Origin::Config,
    };
    plan::typed_config("config", config, origin).map(|_| ())
}

/// The text listing of presets.
#[pyfunction]
fn format_presets() -> String {
    ddo_session::policy::format_presets()
}

/// Every preset's values as JSON `{preset: {KEY: value}}`.
#[pyfunction]
fn preset_values() -> String {
    let map: BTreeMap<&str, BTreeMap<&str, &str>> = ddo_session::policy::Preset::ALL
        .iter()
        .map(|p| (p.as_str(), p.values().iter().copied().collect()))
        .collect();
    serde_json::to_string(&map).expect("serializes")
}

/// `(effective preset, execution mode)` for a backend and preset; without a backend, the one
/// the preset selects by itself (`vmm` for the native presets).
#[pyfunction]
#[pyo3(signature = (backend, preset))]
fn resolve_backend(backend: Option<&str>, preset: &str) -> PyResult<(String, String)> {
    use ddo_session::policy::{Backend, Origin, Preset, SettingValue};
    let p = Preset::parse(preset, Origin::Argument).map_err(value_error)?;
    let b = match backend {
        None if p.is_native() => Backend::Vmm,
        None => Backend::Linear,
        Some(backend) => Backend::parse_text(backend).ok_or_else(|| {
            config_error(format!(
                "backend = {backend:?} is not valid; allowed: {}",
                Backend::allowed()
            ))
        })?,
    };
    let effective = ddo_session::policy::resolve_backend(b, p).map_err(value_error)?;
    Ok((effective.as_str().to_owned(), effective.execution_mode().as_str().to_owned()))
}

/// `(field, DDO_ variable key)` of every setting.
#[pyfunction]
fn setting_keys() -> Vec<(&'static str, &'static str)> {
    ddo_session::policy::SETTING_KEYS.to_vec()
}

/// The JSON Schema of the configuration.
#[pyfunction]
fn config_schema() -> String {
    ddo_session::policy::config_schema().to_string()
}

/// The JSON Schema of metrics snapshots (both layouts: ddo's version 2 and the published
/// version 1), as JSON.
#[pyfunction]
fn metrics_schema() -> String {
    ddo_session::metrics::metrics_schema().to_string()
}

/// Validates a metrics snapshot (JSON) and renders its text profile.
#[pyfunction]
fn format_profile(metrics: &str) -> PyResult<String> {
    let m: ddo_session::metrics::DynamicOffloadMetrics = parse("metrics", metrics)?;
    Ok(m.format_profile())
}

/// Raises if a metrics snapshot reports a counter its route does not have.
#[pyfunction]
fn validate_metrics(metrics: &str) -> PyResult<()> {
    let m: ddo_session::metrics::DynamicOffloadMetrics = parse("metrics", metrics)?;
    m.validate().map_err(value_error)
}

/// The host-memory observation of this process (JSON; unreadable fields are absent).
#[pyfunction]
fn observe_host_memory() -> String {
    let o = ddo_compose::observe_host_memory();
    serde_json::to_string(&o).expect("serializes")
}

/// Validates a checkpoint (file, index or folder) and lists its tensors as JSON:
/// `{"files": [...], "tensors": [{name, dtype, shape, file, offset, len}]}`.
#[pyfunction]
fn inspect_checkpoint(path: std::path::PathBuf) -> PyResult<String> {
    // A path, not text: names that are not UTF-8 (os.fsdecode's surrogates) open as they are.
    let c = if path.to_string_lossy().ends_with(".index.json") {
        ddo_session::source::Checkpoint::open_index(&path)
    } else {
        ddo_session::source::Checkpoint::open(&path)
    }
    .map_err(|e| errors::DynamicOffloadCheckpointError::new_err(e.to_string()))?;
    let tensors: Vec<serde_json::Value> = c
        .slices()
        .iter()
        .map(|s| {
            serde_json::json!({
                "name": s.name, "dtype": s.dtype.as_str(), "shape": s.shape,
                "file": s.path.to_string_lossy(), "offset": s.offset, "len": s.len,
            })
        })
        .collect();
    let files: Vec<String> =
        c.files().iter().map(|f| f.path.to_string_lossy().into_owned()).collect();
    Ok(serde_json::json!({"files": files, "tensors": tensors}).to_string())
}

/// Reading a checkpoint's files into the page cache in the background (see
/// [`read_ahead`]); dropping or stopping it ends the reads after their current chunk.
#[pyclass(module = "ddo._native", frozen)]
struct ReadAhead {
    inner: std::sync::Mutex<Option<ddo_session::source::ReadAhead>>,
    total: u64,
}

#[pymethods]
impl ReadAhead {
    /// Bytes read in so far (chunks already cached are not counted).
    fn asked(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map_or(0, |r| r.asked())
    }

    /// The files' total bytes.
    #[getter]
    fn total(&self) -> u64 {
        self.total
    }

    /// Stops the reads (after their current chunk); returns the bytes asked.
    fn stop(&self, py: Python<'_>) -> u64 {
        let taken = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        py.detach(|| {
            taken.map_or(0, |r| {
                let asked = r.asked();
                drop(r);
                asked
            })
        })
    }
}

/// Starts reading `files` into the page cache while the caller builds the module that will map
/// them, when `plan`'s route maps them whole and the host can hold them (`ddo_compose::read_ahead`);
/// `None` otherwise.
#[pyfunction]
fn read_ahead(
    py: Python<'_>,
    plan: &plan::ResolvedPlan,
    files: Vec<std::path::PathBuf>,
) -> PyResult<Option<ReadAhead>> {
    let started = py.detach(|| ddo_compose::read_ahead(&plan.plan, &files));
    let Some(inner) = started.map_err(errors::session_error)? else {
        return Ok(None);
    };
    let total = inner.total();
    Ok(Some(ReadAhead { inner: std::sync::Mutex::new(Some(inner)), total }))
}

/// The configuration's field names, in declaration order (`preset`, `backend`, `route`,
/// `execution_mode`, `components`, then every setting, then `small_tensor_threshold_bytes`,
/// the peer library's form of `small_tensor_threshold_kb`).
#[pyfunction]
fn config_fields() -> Vec<&'static str> {
    let mut out = vec!["preset", "backend", "route", "execution_mode", "components"];
    out.extend(ddo_session::policy::SETTING_KEYS.iter().map(|(field, _)| *field));
    out.push("small_tensor_threshold_bytes");
    out
}

/// The fields of a component policy (`route`, `group_offload`, ...).
#[pyfunction]
fn component_policy_fields() -> Vec<String> {
    let schema = serde_json::to_value(schemars::schema_for!(ddo_session::policy::ComponentPolicy))
        .expect("schema serializes");
    schema["properties"].as_object().map(|p| p.keys().cloned().collect()).unwrap_or_default()
}

/// One parameter for [`unit_paths`]: `(name, key)`, or `(name, key, torch dtype, shape)` when
/// its size matters (the layer rule keeps parameters up to its resident size resident).
#[derive(FromPyObject)]
enum UnitParameter {
    Sized(String, u64, String, Vec<u64>),
    Named(String, u64),
}

/// The module paths of the execution units the unit rule finds in a module tree (`modules` as
/// `(path, is_list)`, `parameters` as [`UnitParameter`] rows), with the default patterns: the
/// blocks of the outermost repeated lists, or with `layers` (the layer modules' paths) one unit
/// per layer holding a parameter over `resident_bytes` (route `linear_convolution`).
#[pyfunction]
#[pyo3(signature = (modules, parameters, layers=None, resident_bytes=0))]
fn unit_paths(
    modules: Vec<(String, bool)>,
    parameters: Vec<UnitParameter>,
    layers: Option<Vec<String>>,
    resident_bytes: u64,
) -> Vec<String> {
    let by_layers = layers.is_some();
    let layers: std::collections::HashSet<String> = layers.into_iter().flatten().collect();
    let tree = ddo_session::ModuleTree {
        modules: modules
            .into_iter()
            .map(|(path, is_list)| ddo_session::ModuleNode {
                layer: layers.contains(&path),
                path,
                is_list,
            })
            .collect(),
        parameters: parameters
            .into_iter()
            .map(|row| match row {
                UnitParameter::Sized(name, key, dtype, shape) => ddo_session::ParameterRef {
                    name,
                    key,
                    dtype: ddo_session::core::Dtype::from_torch(&dtype),
                    shape: Some(shape),
                },
                UnitParameter::Named(name, key) => {
                    ddo_session::ParameterRef { name, key, dtype: None, shape: None }
                }
            })
            .collect(),
    };
    let mut rule = ddo_session::UnitRule::default();
    if by_layers {
        rule = rule.by_layers(resident_bytes);
    }
    tree.assign(&rule).units.into_iter().map(|u| u.path).collect()
}

/// The metrics layout version.
#[pyfunction]
fn metrics_schema_version() -> u32 {
    ddo_session::metrics::SCHEMA_VERSION
}

/// Whether this Linux kernel is WSL's.
#[pyfunction]
fn running_on_wsl() -> bool {
    ddo_compose::running_on_wsl()
}

/// The backends a host may select.
#[pyfunction]
fn backends() -> Vec<&'static str> {
    ddo_session::policy::Backend::ALL.iter().map(|b| b.as_str()).collect()
}

/// Whether a CUDA driver library can be loaded here.
#[pyfunction]
fn cuda_driver_present() -> bool {
    ddo_compose::cuda_driver_present()
}

/// Opens CUDA device `ordinal` through the native adapter (raises when no driver exists).
#[pyfunction]
fn check_cuda_device(ordinal: u32) -> PyResult<()> {
    ddo_compose::CudaDevice::new(ordinal)
        .map(|_| ())
        .map_err(|e| DynamicOffloadError::new_err(e.to_string()))
}

/// Releases that failed when ddo's memory was dropped since the last call (each message says
/// what was kept), and how many more failed than are listed.
#[pyfunction]
fn take_drop_failures() -> (Vec<String>, u64) {
    let (failures, more) = ddo_session::core::take_drop_failures();
    (failures.iter().map(ToString::to_string).collect(), more)
}

/// The `ddo._native` module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(plan::resolve, m)?)?;
    m.add_function(wrap_pyfunction!(check_config, m)?)?;
    m.add_function(wrap_pyfunction!(format_presets, m)?)?;
    m.add_function(wrap_pyfunction!(preset_values, m)?)?;
    m.add_function(wrap_pyfunction!(resolve_backend, m)?)?;
    m.add_function(wrap_pyfunction!(setting_keys, m)?)?;
    m.add_function(wrap_pyfunction!(config_schema, m)?)?;
    m.add_function(wrap_pyfunction!(format_profile, m)?)?;
    m.add_function(wrap_pyfunction!(validate_metrics, m)?)?;
    m.add_function(wrap_pyfunction!(observe_host_memory, m)?)?;
    m.add_function(wrap_pyfunction!(inspect_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(read_ahead, m)?)?;
    m.add_class::<ReadAhead>()?;
    m.add_function(wrap_pyfunction!(cuda_driver_present, m)?)?;
    m.add_function(wrap_pyfunction!(config_fields, m)?)?;
    m.add_function(wrap_pyfunction!(component_policy_fields, m)?)?;
    m.add_function(wrap_pyfunction!(metrics_schema_version, m)?)?;
    m.add_function(wrap_pyfunction!(unit_paths, m)?)?;
    m.add_function(wrap_pyfunction!(running_on_wsl, m)?)?;
    m.add_function(wrap_pyfunction!(backends, m)?)?;
    m.add_class::<plan::ResolvedPlan>()?;
    m.add_class::<session::Session>()?;
    m.add_function(wrap_pyfunction!(check_cuda_device, m)?)?;
    m.add_function(wrap_pyfunction!(take_drop_failures, m)?)?;
    m.add_function(wrap_pyfunction!(metrics_schema, m)?)?;
    rules::register(m)?;
    generation::register(m)?;
    errors::register(m)?;
    Ok(())
}
