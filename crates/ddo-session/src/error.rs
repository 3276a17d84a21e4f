//! What can go wrong in a session, grouped by what the caller does about it.

use ddo_arena::ArenaError;
use ddo_core::{DeviceError, SourceError};

/// A session failure. Each variant says which kind of thing the caller must change.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// A setting's value cannot be used; the message says what to change.
    #[error("{setting}: {message}")]
    Config {
        /// The setting (`vmm_resident_weight_budget_gb`).
        setting: &'static str,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// The resolved settings are invalid (from resolution).
    #[error(transparent)]
    Policy(#[from] ddo_policy::ConfigError),
    /// The route is not one a session runs.
    #[error("route {route} {reason}")]
    Route {
        /// The route's name.
        route: &'static str,
        /// Why, and what to use instead.
        reason: &'static str,
    },
    /// The weights do not fit the module (missing tensor, other dtype or shape).
    #[error("{0}")]
    Weights(String),
    /// The budget cannot hold the working set.
    #[error("{message} (set {setting})")]
    Capacity {
        /// The setting to raise.
        setting: &'static str,
        /// What was needed.
        message: String,
    },
    /// The call does not fit the session's state (unloaded, lease not live).
    #[error("{0}")]
    Lifecycle(String),
    /// Reading or validating the weights failed.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// The arena failed.
    #[error(transparent)]
    Arena(#[from] ArenaError),
    /// The device failed (or no driver exists).
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// An error whose cleanup also failed: the original error comes first and is the source;
    /// what the cleanup could not release is kept (never freed by force).
    #[error("{error} (cleanup also failed: {cleanup})")]
    WithCleanup {
        /// The original error.
        #[source]
        error: Box<SessionError>,
        /// The cleanup's error, attached.
        cleanup: Box<SessionError>,
    },
}

impl SessionError {
    /// Whether the failure came from the device or the arena holding memory it could not
    /// release (as opposed to input the caller can fix).
    pub fn is_runtime(&self) -> bool {
        matches!(self.original(), SessionError::Arena(_) | SessionError::Device(_))
    }

    /// The original error (for [`SessionError::WithCleanup`], the one before cleanup).
    pub fn original(&self) -> &SessionError {
        match self {
            SessionError::WithCleanup { error, .. } => error.original(),
            e => e,
        }
    }

    /// `self`, with `cleanup`'s failure attached when there is one.
    pub(crate) fn with_cleanup(self, cleanup: Result<(), SessionError>) -> SessionError {
        match cleanup {
            Ok(()) => self,
            Err(c) => SessionError::WithCleanup { error: Box::new(self), cleanup: Box::new(c) },
        }
    }
}
