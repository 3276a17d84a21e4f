//! The package's exceptions, raised from Rust: every failure reaches Python as one of these.

use ddo_session::SessionError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};
use pyo3::{PyErr, create_exception};

create_exception!(
    ddo._native,
    DynamicOffloadError,
    PyRuntimeError,
    "A runtime failure: a module that cannot be offloaded, a missing driver, a failed release. The module is left as it was unless the message says otherwise."
);
create_exception!(
    ddo._native,
    DynamicOffloadCheckpointError,
    DynamicOffloadError,
    "The weights are missing, corrupt, changed on disk, or do not fit the module."
);
create_exception!(
    ddo._native,
    DynamicOffloadSourceChangedError,
    DynamicOffloadCheckpointError,
    "A checkpoint file changed while in use (its identity, checked before and after reads and uploads, differs from the one recorded at attach: unload() and reload(), or load the model again), or a host tensor ddo streams from was written (its version counter changed: remove the offload, change the weights, offload again). Raised before the next forward uses the component."
);
create_exception!(
    ddo._native,
    DynamicOffloadLifecycleError,
    DynamicOffloadError,
    "The call does not fit the component's state (unloaded, during a forward pass)."
);

/// The configuration errors are both a `DynamicOffloadError` and a `ValueError` (hosts catch
/// either), so they are classes with two bases, created when the module loads (`create_exception!`
/// takes one base).
const CONFIG_CLASSES: &std::ffi::CStr = c"
class DynamicOffloadConfigError(DynamicOffloadError, ValueError):
    'An invalid setting: the message names the setting, the value, where it came from and what is allowed.'

class DynamicOffloadCapacityError(DynamicOffloadConfigError):
    'The GPU budget cannot hold the working set; the message says how much is needed and which setting to raise.'
";

static CONFIG: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static CAPACITY: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Creates the configuration error classes and adds every exception to module `m`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let ns = PyDict::new(py);
    ns.set_item("__name__", "ddo._native")?;
    ns.set_item("DynamicOffloadError", py.get_type::<DynamicOffloadError>())?;
    py.run(CONFIG_CLASSES, Some(&ns), None)?;
    let class = |name: &str| -> PyResult<Bound<'_, PyType>> {
        let item = ns.get_item(name)?.expect("defined above");
        Ok(item.cast_into::<PyType>()?)
    };
    let config = class("DynamicOffloadConfigError")?;
    let capacity = class("DynamicOffloadCapacityError")?;
    let _ = CONFIG.set(py, config.clone().unbind());
    let _ = CAPACITY.set(py, capacity.clone().unbind());
    m.add("DynamicOffloadError", py.get_type::<DynamicOffloadError>())?;
    m.add("DynamicOffloadConfigError", config)?;
    m.add("DynamicOffloadCapacityError", capacity)?;
    m.add("DynamicOffloadCheckpointError", py.get_type::<DynamicOffloadCheckpointError>())?;
    m.add("DynamicOffloadSourceChangedError", py.get_type::<DynamicOffloadSourceChangedError>())?;
    m.add("DynamicOffloadLifecycleError", py.get_type::<DynamicOffloadLifecycleError>())?;
    Ok(())
}

fn raise(class: &'static PyOnceLock<Py<PyType>>, text: String) -> PyErr {
    Python::attach(|py| match class.get(py) {
        Some(t) => PyErr::from_type(t.bind(py).clone(), text),
        None => DynamicOffloadError::new_err(text),
    })
}

/// A `DynamicOffloadConfigError`.
pub(crate) fn config_err(text: impl Into<String>) -> PyErr {
    raise(&CONFIG, text.into())
}

/// A `DynamicOffloadCapacityError`.
pub(crate) fn capacity_err(text: impl Into<String>) -> PyErr {
    raise(&CAPACITY, text.into())
}

/// The exception for a session failure, by what the caller must change: a source error,
/// also one that reaches Python through the arena (a file changed during a run), is about the
/// checkpoint, unless it is the host refusing memory (capacity).
pub(crate) fn session_error(e: SessionError) -> PyErr {
    use ddo_session::arena::ArenaError;
    use ddo_session::core::SourceError;
    let text = e.to_string();
    // A failure whose cleanup also failed is classed by the original error.
    let e = e.original();
    let source = match e {
        SessionError::Source(s) => Some(s),
        SessionError::Arena(a) => match a.original() {
            ArenaError::Source(s) => Some(s),
            _ => None,
        },
        _ => None,
    };
    match (e, source) {
        (_, Some(SourceError::Refused(_) | SourceError::CeilingExceeded { .. })) => {
            capacity_err(text)
        }
        (_, Some(SourceError::CheckpointChanged { .. })) => {
            DynamicOffloadSourceChangedError::new_err(text)
        }
        (_, Some(SourceError::Device(_))) => DynamicOffloadError::new_err(text),
        (_, Some(_)) => DynamicOffloadCheckpointError::new_err(text),
        (SessionError::Config { .. } | SessionError::Policy(_), _) => config_err(text),
        (SessionError::Capacity { .. }, _) => capacity_err(text),
        (SessionError::Weights(_), _) => DynamicOffloadCheckpointError::new_err(text),
        (SessionError::Lifecycle(_) | SessionError::Arena(ArenaError::Closed), _) => {
            DynamicOffloadLifecycleError::new_err(text)
        }
        _ => DynamicOffloadError::new_err(text),
    }
}

/// A configuration error.
pub(crate) fn config_error(e: impl std::fmt::Display) -> PyErr {
    config_err(e.to_string())
}
