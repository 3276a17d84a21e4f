//! Configuration, presets and route resolution: the one source of truth for what ddo does with
//! each component of a pipeline.
//!
//! A host describes what it wants as a [`Request`]: explicit arguments, an optional
//! [`DynamicOffloadConfig`], per-component policies, and an injected [`Environment`].
//! [`resolve`] turns it into a [`Plan`]: the backend, the effective [`Preset`], the [`Route`] and
//! every [`Settings`] value with the [`Origin`] that decided it. Settings ddo does not implement
//! ([`UNSUPPORTED_SETTINGS`]) are refused unless left at their default, and every `DDO_*` variable
//! ddo does not read becomes a warning on the plan. The rules a host applies while a component
//! runs live here too: the automatic GPU budget ([`auto_budget`]), capacity profiles
//! ([`capacity_profile`]), the default encoded-file folder and its bound ([`encoded_cache`]) and
//! the route's predicates ([`Route::facts`]). The crate is pure (no I/O beyond
//! [`Environment::from_process`]); the Python package calls it rather than re-implementing the
//! rules.
#![forbid(unsafe_code)]

pub mod auto_budget;
pub mod capacity_profile;
mod config;
pub mod encoded_cache;
mod env;
mod error;
mod format;
pub mod generation;
mod limits;
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
pub use limits::{MAX_PREFETCH_DEPTH, MAX_SOURCE_CACHE_GB, REGISTRATION_SEGMENT_MIB};
pub use origin::Origin;
pub use preset::{Backend, ExecutionMode, Preset, VaeDefault, resolve_backend};
pub use resolve::{Plan, Request, resolve};
pub use route::{
    GroupOffload, LAYER_ROUTE_DTYPES, LAYER_ROUTE_RESIDENT_KIB, Placement, Route, RouteChoice,
    RouteFacts,
};
pub use value::{
    AutoBudgetPolicy, ConversionSite, OffloadType, ReadBackend, Selection, SettingValue,
    WeightEncoding,
};

/// The JSON Schema of [`DynamicOffloadConfig`], as users write it.
pub fn config_schema() -> serde_json::Value {
    serde_json::to_value(schemars::schema_for!(DynamicOffloadConfig)).expect("schema serializes")
}
