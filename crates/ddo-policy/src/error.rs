//! Configuration errors. Each names the setting, the value, where it came from, and what is
//! allowed, so a user can fix it without reading code.

use crate::Origin;

/// A configuration that cannot be resolved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// A preset name that does not exist.
    #[error("unknown preset {value:?} (from {origin}); valid presets: {valid}")]
    UnknownPreset {
        /// The name given.
        value: String,
        /// Where it came from.
        origin: Origin,
        /// The valid names, comma-separated.
        valid: String,
    },
    /// A field the configuration does not have.
    #[error(
        "{field} (from {origin}) is not a ddo setting; `python -m ddo presets` and the README list them"
    )]
    UnknownField {
        /// The field given.
        field: String,
        /// Where it came from.
        origin: Origin,
    },
    /// A value outside a closed set of choices.
    #[error("{field} = {value:?} (from {origin}) is not valid; allowed: {allowed}")]
    InvalidChoice {
        /// The setting.
        field: String,
        /// The value given.
        value: String,
        /// Where it came from.
        origin: Origin,
        /// The allowed values, comma-separated.
        allowed: String,
    },
    /// A backend and preset that do not go together.
    #[error(
        "backend {backend} does not accept preset {preset:?}; backend {backend} accepts: {allowed} ({hint})"
    )]
    PresetNotForBackend {
        /// The backend.
        backend: String,
        /// The preset.
        preset: String,
        /// Presets the backend accepts.
        allowed: String,
        /// What to change.
        hint: String,
    },
    /// A size that is negative, NaN or infinite.
    #[error("{field} = {} (from {origin}) must be a finite number >= 0 (GiB)", Number(*.value))]
    InvalidSize {
        /// The setting.
        field: String,
        /// The value.
        value: f64,
        /// Where it came from.
        origin: Origin,
    },
    /// A number outside its range.
    #[error("{field} = {value} (from {origin}) is out of range; allowed: {range}")]
    OutOfRange {
        /// The setting.
        field: String,
        /// The value, as written.
        value: String,
        /// Where it came from.
        origin: Origin,
        /// The allowed range.
        range: String,
    },
    /// The registration ceiling does not fit the retained storage ceiling.
    #[error(
        "vmm_source_registered_gb = {} (from {origin}) exceeds vmm_source_cache_gb = {}: registration must fit the retained storage; lower vmm_source_registered_gb, raise vmm_source_cache_gb, or set vmm_source_registered_gb to 0 (same as storage)",
        Number(*.registered),
        Number(*.storage)
    )]
    RegistrationExceedsStorage {
        /// Registration ceiling (GiB).
        registered: f64,
        /// Storage ceiling (GiB).
        storage: f64,
        /// Where the registration value came from.
        origin: Origin,
    },
    /// The registration ceiling is not a whole number of segments.
    #[error(
        "vmm_source_registered_gb = {} (from {origin}) is not a whole number of {segment_mib} MiB segments; use a multiple of {step} GiB (for example {suggestion})",
        Number(*.registered)
    )]
    RegistrationNotWholeSegments {
        /// Registration ceiling (GiB).
        registered: f64,
        /// Where it came from.
        origin: Origin,
        /// Segment size in MiB.
        segment_mib: u64,
        /// Segment size in GiB.
        step: f64,
        /// The nearest whole number of segments below (or one segment), in GiB.
        suggestion: f64,
    },
    /// An environment variable whose value cannot be parsed.
    #[error("environment variable {var}={value:?} is not {expected}")]
    InvalidEnv {
        /// The variable.
        var: String,
        /// Its value.
        value: String,
        /// What was expected.
        expected: String,
    },
    /// A setting ddo does not implement, set to something other than its default.
    #[error(
        "{field} = {value} (from {origin}) is not supported by ddo: {instead}; leave it unset or at its default {default}"
    )]
    Unsupported {
        /// The setting.
        field: &'static str,
        /// The value given, as written in messages (text quoted).
        value: String,
        /// Where it came from.
        origin: Origin,
        /// What ddo does instead.
        instead: &'static str,
        /// The one value accepted, as written in messages.
        default: String,
    },
    /// A module pattern that is not a valid regular expression.
    #[error("{field} = {pattern:?} (from {origin}) is not a valid regular expression: {reason}")]
    InvalidPattern {
        /// The setting.
        field: String,
        /// The pattern (for a list setting, the entry that is invalid).
        pattern: String,
        /// Where it came from.
        origin: Origin,
        /// What is wrong with it.
        reason: String,
    },
    /// A route that cannot run under the resolved preset.
    #[error("{0}")]
    RouteConflict(String),
}

/// A number as a message shows it: as written for ordinary magnitudes, in exponent form for
/// extreme ones (`1e-300`, not three hundred digits).
pub(crate) struct Number(pub(crate) f64);

impl std::fmt::Display for Number {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = self.0;
        if v.is_finite() && v != 0.0 && !(1e-6..1e15).contains(&v.abs()) {
            write!(f, "{v:e}")
        } else {
            write!(f, "{v}")
        }
    }
}
