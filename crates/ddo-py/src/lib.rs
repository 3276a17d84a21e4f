//! The Python extension module `ddo._native`: the Rust core of the `ddo` package for Diffusers
//! hosts. Configuration resolution and validation live in `ddo-policy`, metrics rendering in
//! `ddo-metrics`, checkpoint validation in `ddo-source`; this module exposes them to Python (as
//! JSON text across the boundary) so the package holds no second copy of the rules. Every error
//! becomes a Python `ValueError` with the Rust message; nothing panics across the boundary.

mod arena;
mod dlpack;

use std::collections::BTreeMap;

use ddo_core::AdmissionProbe;
use ddo_policy::{ComponentPolicy, DynamicOffloadConfig, Environment, Request};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

fn parse<T: serde::de::DeserializeOwned>(what: &str, json: &str) -> PyResult<T> {
    serde_json::from_str(json).map_err(|e| PyValueError::new_err(format!("invalid {what}: {e}")))
}

/// The version of the native extension.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// Resolves one component's plan. `arguments`, `group` and `config` are JSON objects (config may
/// be `None`); `environ` maps variable names to values. Returns the plan as JSON.
#[pyfunction]
#[pyo3(signature = (component, arguments, group, config, environ, running_on_wsl))]
fn resolve(
    component: &str,
    arguments: &str,
    group: &str,
    config: Option<&str>,
    environ: BTreeMap<String, String>,
    running_on_wsl: bool,
) -> PyResult<String> {
    let arguments: DynamicOffloadConfig = parse("arguments", arguments)?;
    let group: ComponentPolicy = parse("component arguments", group)?;
    let config: Option<DynamicOffloadConfig> = config.map(|c| parse("config", c)).transpose()?;
    let request = Request {
        component,
        arguments,
        group,
        config,
        environment: Environment::from_pairs(environ),
        running_on_wsl,
    };
    let plan = ddo_policy::resolve(&request).map_err(value_error)?;
    let mut json = serde_json::to_value(&plan).map_err(value_error)?;
    json["configuration"] = serde_json::to_value(plan.configuration()).map_err(value_error)?;
    json["origins"] = serde_json::to_value(
        plan.origins.iter().map(|(k, v)| (k.clone(), v.to_string())).collect::<BTreeMap<_, _>>(),
    )
    .map_err(value_error)?;
    Ok(json.to_string())
}

/// Validates a configuration object (JSON) without resolving it; raises on unknown fields.
#[pyfunction]
fn check_config(config: &str) -> PyResult<()> {
    parse::<DynamicOffloadConfig>("config", config).map(|_| ())
}

/// The text listing of presets.
#[pyfunction]
fn format_presets() -> String {
    ddo_policy::format_presets()
}

/// Every preset's values as JSON `{preset: {KEY: value}}`.
#[pyfunction]
fn preset_values() -> String {
    let map: BTreeMap<&str, BTreeMap<&str, &str>> = ddo_policy::Preset::ALL
        .iter()
        .map(|p| (p.as_str(), p.values().iter().copied().collect()))
        .collect();
    serde_json::to_string(&map).expect("serializes")
}

/// `(effective preset, execution mode)` for a backend and preset.
#[pyfunction]
fn resolve_backend(backend: &str, preset: &str) -> PyResult<(String, String)> {
    use ddo_policy::{Backend, Origin, Preset, SettingValue};
    let b = Backend::parse_text(backend).ok_or_else(|| {
        PyValueError::new_err(format!(
            "backend = {backend:?} is not valid; allowed: {}",
            Backend::allowed()
        ))
    })?;
    let p = Preset::parse(preset, Origin::Argument).map_err(value_error)?;
    let effective = ddo_policy::resolve_backend(b, p).map_err(value_error)?;
    Ok((effective.as_str().to_owned(), effective.execution_mode().as_str().to_owned()))
}

/// `(field, DDO_ variable key)` of every setting.
#[pyfunction]
fn setting_keys() -> Vec<(&'static str, &'static str)> {
    ddo_policy::SETTING_KEYS.to_vec()
}

/// The JSON Schema of the configuration.
#[pyfunction]
fn config_schema() -> String {
    ddo_policy::config_schema().to_string()
}

/// Validates a metrics snapshot (JSON) and renders its text profile.
#[pyfunction]
fn format_profile(metrics: &str) -> PyResult<String> {
    let m: ddo_metrics::DynamicOffloadMetrics = parse("metrics", metrics)?;
    Ok(m.format_profile())
}

/// Raises if a metrics snapshot reports a counter its route does not have.
#[pyfunction]
fn validate_metrics(metrics: &str) -> PyResult<()> {
    let m: ddo_metrics::DynamicOffloadMetrics = parse("metrics", metrics)?;
    m.validate().map_err(value_error)
}

/// The host-memory observation of this process (JSON; unreadable fields are absent).
#[pyfunction]
fn observe_host_memory() -> String {
    let o = ddo_platform::LinuxAdmissionProbe::system().observe();
    serde_json::to_string(&o).expect("serializes")
}

/// Validates a checkpoint (file, index or folder) and lists its tensors as JSON:
/// `{"files": [...], "tensors": [{name, dtype, shape, file, offset, len}]}`.
#[pyfunction]
fn inspect_checkpoint(path: &str) -> PyResult<String> {
    let c = if path.ends_with(".index.json") {
        ddo_source::Checkpoint::open_index(path)
    } else {
        ddo_source::Checkpoint::open(path)
    }
    .map_err(value_error)?;
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

/// Plans a component for the native arena: `units` are `(name, bytes, pinned)` in execution
/// order. Returns the plan as JSON, or raises `ValueError` when the budget cannot hold the pinned
/// units and two execution slots (the message says how many bytes are needed).
#[pyfunction]
fn plan_units(
    units: Vec<(String, u64, bool)>,
    budget: u64,
    headroom: u64,
    prefetch_depth: u32,
    granularity: u64,
) -> PyResult<String> {
    use ddo_arena::{Budget, Layout, ResidencyPlan, UnitLayout};
    if granularity == 0 {
        return Err(PyValueError::new_err("granularity must be positive"));
    }
    let mut offset = 0;
    let layout_units: Vec<UnitLayout> = units
        .iter()
        .enumerate()
        .map(|(i, (name, bytes, pinned))| {
            let len = bytes.max(&1).div_ceil(granularity) * granularity;
            let u = UnitLayout {
                id: ddo_core::UnitId(i as u32),
                name: name.clone(),
                offset,
                len,
                payload: *bytes,
                tensors: Vec::new(),
                extents: Vec::new(),
                pinned: *pinned,
            };
            offset += len;
            u
        })
        .collect();
    if layout_units.is_empty() {
        return Err(PyValueError::new_err("no units to plan"));
    }
    let layout = Layout { units: layout_units, reserved: offset, granularity };
    let plan = ResidencyPlan::new(&layout, Budget { total: budget, headroom, prefetch_depth })
        .map_err(value_error)?;
    Ok(serde_json::json!({
        "resident": plan.resident,
        "slots": plan.slots,
        "slot_bytes": plan.slot_len,
        "resident_bytes": plan.resident_bytes,
        "streamed_bytes": plan.streamed_bytes,
        "device_bytes": plan.device_bytes(),
    })
    .to_string())
}

/// Whether a CUDA driver library can be loaded here.
#[pyfunction]
fn cuda_driver_present() -> bool {
    ddo_platform::cuda::driver_present()
}

/// Opens CUDA device `ordinal` through the native adapter (raises when no driver exists).
#[pyfunction]
fn check_cuda_device(ordinal: u32) -> PyResult<()> {
    ddo_platform::cuda::CudaDevice::new(ordinal)
        .map(|_| ())
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// The `ddo._native` module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(resolve, m)?)?;
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
    m.add_function(wrap_pyfunction!(cuda_driver_present, m)?)?;
    m.add_function(wrap_pyfunction!(plan_units, m)?)?;
    m.add_class::<arena::NativeArena>()?;
    m.add_function(wrap_pyfunction!(check_cuda_device, m)?)?;
    Ok(())
}
