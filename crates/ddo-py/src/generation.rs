//! The plan of a whole generation, from `ddo-policy`, and the machine profile it is made from,
//! from `ddo-compose`. Python gathers the components' facts and the card's free memory, applies
//! the plan and the card's sharing; the choices are made here.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use ddo_session::policy::generation::{
    self, GenerationPlan, GenerationRequest, Phase, decode,
    share::{CardShare as Rule, Resize},
};
use pyo3::prelude::*;

use crate::errors::config_error;
use crate::errors::session_error;

fn phase(name: &str) -> PyResult<Phase> {
    Phase::ALL
        .into_iter()
        .find(|p| p.as_str() == name)
        .ok_or_else(|| config_error(format!("{name:?} is no phase: encode, denoise or decode")))
}

fn parse_plan(plan: &str) -> PyResult<GenerationPlan> {
    serde_json::from_str(plan).map_err(|e| config_error(format!("not a generation plan: {e}")))
}

/// The plan of a generation from its request (JSON: `machine`, `components`), as JSON; each
/// component carries `config`, the settings that attach it.
#[pyfunction]
fn plan_generation(request: &str) -> PyResult<String> {
    let request: GenerationRequest = serde_json::from_str(request)
        .map_err(|e| config_error(format!("not a generation request: {e}")))?;
    let plan = generation::plan_generation(&request);
    let mut value = serde_json::to_value(&plan).map_err(config_error)?;
    for (c, choice) in
        value["components"].as_array_mut().into_iter().flatten().zip(&plan.components)
    {
        c["config"] = serde_json::Value::Object(choice.config());
        c["attach_bytes"] = choice.attach_bytes().into();
    }
    value["table"] = plan.table().into();
    serde_json::to_string(&value).map_err(config_error)
}

/// The repeated blocks of tensors `[(name, bytes, is bf16)]`, as JSON (`blocks`,
/// `largest_block_bytes`, `block_bytes`, `bf16_block_bytes`).
#[pyfunction]
fn blocks_of_tensors(tensors: Vec<(String, u64, bool)>) -> PyResult<String> {
    let blocks =
        generation::Blocks::of_tensors(tensors.iter().map(|(n, b, f)| (n.as_str(), *b, *f)));
    serde_json::to_string(&blocks).map_err(config_error)
}

/// The phase the component named `name` runs in, from its name, or `None`.
#[pyfunction]
fn phase_of_component(name: &str) -> Option<&'static str> {
    Phase::of_component(name).map(Phase::as_str)
}

/// The card's time-sharing among the phases of a plan's generations.
#[pyclass(module = "ddo._native", frozen)]
struct CardShare {
    inner: Mutex<Rule>,
}

impl CardShare {
    fn rule(&self) -> std::sync::MutexGuard<'_, Rule> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl CardShare {
    /// The sharing of `plan` (its JSON); `idle` maps components to the bytes each holds evicted.
    #[new]
    fn new(plan: &str, idle: BTreeMap<String, u64>) -> PyResult<CardShare> {
        Ok(CardShare { inner: Mutex::new(Rule::new(&parse_plan(plan)?, &idle)) })
    }

    /// The component's floor as its session measures it.
    fn set_floor(&self, name: &str, floor_bytes: u64) {
        self.rule().set_floor(name, floor_bytes);
    }

    /// The working set of `phase` beside its arenas, measured.
    fn set_activation(&self, phase_name: &str, bytes: u64) -> PyResult<()> {
        self.rule().set_activation(phase(phase_name)?, bytes);
        Ok(())
    }

    /// The activation bytes `phase` is planned with now.
    fn activation(&self, phase_name: &str) -> PyResult<u64> {
        Ok(self.rule().activation(phase(phase_name)?))
    }

    /// Whether `phase` starting may change an arena.
    fn entering(&self, phase_name: &str) -> PyResult<bool> {
        Ok(self.rule().entering(phase(phase_name)?))
    }

    /// `phase` starts with `free_bytes` free: `[(component, budget bytes, reclaim)]`, shrinks first.
    fn enter(&self, phase_name: &str, free_bytes: u64) -> PyResult<Vec<(String, u64, bool)>> {
        let resizes = self.rule().enter(phase(phase_name)?, free_bytes);
        Ok(resizes.into_iter().map(|r| (r.name, r.budget_bytes, r.reclaim)).collect())
    }

    /// A resize `enter` returned could not be applied.
    fn refused(&self, name: String, budget_bytes: u64, reclaim: bool) {
        self.rule().refused(&Resize { name, budget_bytes, reclaim });
    }

    /// Bytes `phase` could have beyond what is free.
    fn evictable_bytes(&self, phase_name: &str) -> PyResult<u64> {
        Ok(self.rule().evictable_bytes(phase(phase_name)?))
    }

    /// Arenas evicted so far.
    #[getter]
    fn evictions(&self) -> u64 {
        self.rule().evictions()
    }
}

/// The VAE decode's working set at `pixels` per frame, from two measured one-frame
/// `(pixels, peak bytes)` decodes, with `frames` frames of output at `bytes_per_pixel`.
#[pyfunction]
#[pyo3(signature = (small, large, pixels, frames=1, bytes_per_pixel=0))]
fn decode_need_bytes(
    small: (u64, u64),
    large: (u64, u64),
    pixels: u64,
    frames: u64,
    bytes_per_pixel: u64,
) -> u64 {
    decode::decode_need_bytes(small, large, pixels, frames, bytes_per_pixel)
}

/// Whether a decode of `need_bytes` fits `available_bytes` under `vae_decode` (`exact`, `tiled`
/// or `sliced`), as JSON (`decision`: `fits`, `reduced` or `refused`, with `message`).
#[pyfunction]
fn decode_fit(
    need_bytes: u64,
    available_bytes: u64,
    vae_decode: &str,
    size: &str,
) -> PyResult<String> {
    let setting = decode::VaeDecode::parse(vae_decode).ok_or_else(|| {
        config_error(format!(
            "vae_decode is {vae_decode:?}: use \"exact\", \"tiled\" or \"sliced\""
        ))
    })?;
    serde_json::to_string(&decode::decode_fit(need_bytes, available_bytes, setting, size))
        .map_err(config_error)
}

/// The machine profile of `device` (`cuda:N` or `cpu`) cached at `file` for `key`, measured
/// when absent, stale or `refresh`; JSON.
#[pyfunction]
#[pyo3(signature = (device, key, file, refresh=false))]
fn machine_profile(
    py: Python<'_>,
    device: &str,
    key: &str,
    file: &str,
    refresh: bool,
) -> PyResult<String> {
    let device = ddo_compose::choose_device(device, false).map_err(session_error)?;
    let profile = py
        .detach(|| {
            ddo_compose::MachineProfile::cached_or_measured(device, key, Path::new(file), refresh)
        })
        .map_err(session_error)?;
    serde_json::to_string(&profile).map_err(config_error)
}

/// Host bytes this process may still take keeping `margin_bytes` free, or `None` when host
/// memory cannot be observed.
#[pyfunction]
fn host_room_bytes(margin_bytes: u64) -> Option<u64> {
    ddo_compose::host_room(margin_bytes)
}

/// ddo's cache folder as the environment names it (`None` when no variable locates one).
#[pyfunction]
fn cache_dir() -> Option<String> {
    ddo_compose::cache_dir().map(|p| p.to_string_lossy().into_owned())
}

/// Registers the generation plan in `ddo._native`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan_generation, m)?)?;
    m.add_function(wrap_pyfunction!(phase_of_component, m)?)?;
    m.add_function(wrap_pyfunction!(blocks_of_tensors, m)?)?;
    m.add_class::<CardShare>()?;
    m.add_function(wrap_pyfunction!(decode_need_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(decode_fit, m)?)?;
    m.add_function(wrap_pyfunction!(machine_profile, m)?)?;
    m.add_function(wrap_pyfunction!(host_room_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(cache_dir, m)?)?;
    Ok(())
}
