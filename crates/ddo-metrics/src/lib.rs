//! Metrics: a versioned snapshot of what ddo did for one component, its JSON form (`as_dict`)
//! and its text profile (`format_profile`).
//!
//! The snapshot is plain data, built by the routes and read by hosts; hosts consume only this
//! object, never internal state. It never invents data: every counter is optional, a counter a
//! route does not have is absent (not zero), and [`DynamicOffloadMetrics::validate`] refuses a
//! snapshot that reports a counter its route cannot measure.
#![forbid(unsafe_code)]

mod phases;
mod profile;
mod snapshot;

pub use phases::{
    AutoBudgetSetup, AuxiliaryDetachment, CapacityProfileSetup, DiagnosticStepWait,
    ExecutionTiming, HostCacheRelease, IdleCacheRelease,
};
pub use profile::format_profile;
pub use snapshot::{
    DynamicOffloadMetrics, ExecutionSection, GroupOffloadSetup, HostMemorySection, MetricsError,
    RuntimeSection, SCHEMA_VERSION, SetupSection, published_route, runtime_counters_of,
};

/// The JSON Schema of [`DynamicOffloadMetrics::as_dict`].
pub fn metrics_schema() -> serde_json::Value {
    serde_json::to_value(schemars::schema_for!(DynamicOffloadMetrics)).expect("schema serializes")
}
