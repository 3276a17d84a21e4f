//! The package's exceptions, raised from Rust: every failure reaches Python as one of these.

use ddo_session::SessionError;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::{PyErr, create_exception};

create_exception!(
    _native,
    DynamicOffloadError,
    PyRuntimeError,
    "A runtime failure: a module that cannot be offloaded, a missing driver, a failed release. The module is left as it was unless the message says otherwise."
);
create_exception!(
    _native,
    DynamicOffloadConfigError,
    PyValueError,
    "An invalid setting: the message names the setting, the value, where it came from and what is allowed."
);
create_exception!(
    _native,
    DynamicOffloadCapacityError,
    DynamicOffloadConfigError,
    "The GPU budget cannot hold the working set; the message says how much is needed and which setting to raise."
);
create_exception!(
    _native,
    DynamicOffloadCheckpointError,
    DynamicOffloadError,
    "The weights are missing, corrupt, changed on disk, or do not fit the module."
);
create_exception!(
    _native,
    DynamicOffloadLifecycleError,
    DynamicOffloadError,
    "The call does not fit the component's state (unloaded, during a forward pass)."
);

/// The exception for a session failure, by what the caller must change: a source error,
/// also one that reaches Python through the arena (a file changed during a run), is about the
/// checkpoint, unless it is the host refusing memory (capacity).
pub(crate) fn session_error(e: SessionError) -> PyErr {
    use ddo_arena::ArenaError;
    use ddo_core::SourceError;
    let text = e.to_string();
    let source = match &e {
        SessionError::Source(s) => Some(s),
        SessionError::Arena(a) => match a.original() {
            ArenaError::Source(s) => Some(s),
            _ => None,
        },
        _ => None,
    };
    match (&e, source) {
        (_, Some(SourceError::Refused(_) | SourceError::CeilingExceeded { .. })) => {
            DynamicOffloadCapacityError::new_err(text)
        }
        (_, Some(SourceError::Device(_))) => DynamicOffloadError::new_err(text),
        (_, Some(_)) => DynamicOffloadCheckpointError::new_err(text),
        (SessionError::Config { .. } | SessionError::Policy(_), _) => {
            DynamicOffloadConfigError::new_err(text)
        }
        (SessionError::Capacity { .. }, _) => DynamicOffloadCapacityError::new_err(text),
        (SessionError::Weights(_), _) => DynamicOffloadCheckpointError::new_err(text),
        (SessionError::Lifecycle(_) | SessionError::Arena(ArenaError::Closed), _) => {
            DynamicOffloadLifecycleError::new_err(text)
        }
        _ => DynamicOffloadError::new_err(text),
    }
}

/// A configuration error.
pub(crate) fn config_error(e: impl std::fmt::Display) -> PyErr {
    DynamicOffloadConfigError::new_err(e.to_string())
}
