//! Configuration, presets and route resolution: the one source of truth for what ddo does with
//! each component of a pipeline.
//!
//! A host describes what it wants as a [`Request`]: explicit arguments, an optional
//! [`DynamicOffloadConfig`], per-component policies, and an injected [`Environment`].
//! [`resolve`] turns it into a [`Plan`]: the backend, the effective [`Preset`], the [`Route`] and
//! every [`Settings`] value with the [`Origin`] that decided it. Settings ddo does not implement
//! ([`UNSUPPORTED_SETTINGS`]) are refused unless left at their default, and every `DDO_*` variable
//! ddo does not read becomes a warning on the plan. The crate is pure (no I/O beyond
//! [`Environment::from_process`]); the Python package calls it rather than re-implementing the
//! rules.
#![forbid(unsafe_code)]

mod config;
mod env;
mod error;
mod format;
mod origin;
mod preset;
mod resolve;
mod route;
mod validate;
mod value;
mod variables;

pub use config::{
    ComponentPolicy, DynamicOffloadConfig, ENV_ALIASES, SETTING_KEYS, Settings,
    UNSUPPORTED_SETTINGS,
};
pub use env::{ENV_PREFIX, Environment, component_env_name};
pub use error::ConfigError;
pub use format::format_presets;
pub use origin::Origin;
pub use preset::{Backend, ExecutionMode, Preset, VaeDefault, resolve_backend};
pub use resolve::{
    MAX_PREFETCH_DEPTH, MAX_SOURCE_CACHE_GB, Plan, REGISTRATION_SEGMENT_MIB, Request, resolve,
};
pub use route::{GroupOffload, Placement, Route, RouteChoice};
pub use value::{
    AutoBudgetPolicy, ConversionSite, OffloadType, ReadBackend, Selection, SettingValue,
    WeightEncoding,
};

/// The JSON Schema of [`DynamicOffloadConfig`], as users write it.
pub fn config_schema() -> serde_json::Value {
    serde_json::to_value(schemars::schema_for!(DynamicOffloadConfig)).expect("schema serializes")
}
