//! The use case of ddo: one component of a diffusion pipeline streamed through the GPU weight
//! arena, for every host alike (the Python package, the demo, Rust programs).
//!
//! A [`ComponentSession`] runs on an [`ExecutionTarget`] a composition root built (the device,
//! its ports as a [`ddo_core::Platform`] value, the link measured to it: `ddo-compose`), and
//! takes the component's resolved [`ddo_policy::Plan`], its [`Weights`]
//! (a safetensors checkpoint, or tensors already in host memory) and optionally its
//! [`ModuleTree`], and owns everything after: the unit rule ([`ModuleTree::assign`]), the source
//! (mapping, retained windows, reads, or host tensors in place with small ones packed), host
//! registration under its ceiling, the arena under the GPU budget, per-unit leases on the
//! caller's streams, reclaim, unload and reload, and the metrics snapshot. Routes are a type
//! ([`SessionRoute`]): `linear_runtime` (and `linear_convolution`), `vmm_fast_runtime` and
//! `vmm_runtime` are the same arena fed by three sources (host tensors, the checkpoint's
//! mapping or retained windows, disk reads into registered staging). The crate forbids `unsafe`: mapping a file is the caller's promise
//! ([`ddo_source::MmapChoice`]), adopting a foreign stream the CUDA adapter's.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("model.safetensors");
//! # ddo_session::testing::write_blocks(&path, 3, 1024)?;
//! use ddo_session::{ComponentSession, SessionSpec, Weights};
//!
//! // Settings as a host would resolve them: here, the native route on the host backend.
//! let plan = ddo_session::resolve("transformer", &[
//!     ("backend", "vmm"), ("execution_device", "cpu"), ("vmm_resident_weight_budget_gb", "0.01"),
//! ])?;
//! let weights = Weights::Checkpoint { path, mmap: ddo_source::MmapChoice::never() };
//! // The composition root builds the device's platform; the session takes it.
//! let machine = ddo_compose::Machine::for_plan(&plan)?;
//! let session = ComponentSession::open(SessionSpec { plan, weights, tree: None }, machine.target())?;
//! let stream = ddo_core::StreamId(0); // the host backend runs every copy synchronously
//! for pass in 0..2 {
//!     // The blocks the plan keeps resident are leased for the whole pass on `stream`.
//!     let resident = session.begin_pass(stream)?;
//!     for unit in session.units()?.iter().filter(|u| !u.pinned) {
//!         if resident.contains(&unit.id) {
//!             session.reached(unit.id)?; // order and prefetch; no lease, no fence
//!             // ... run the block on `stream` ...
//!             continue;
//!         }
//!         let lease = session.acquire(unit.id, stream)?;
//!         // ... run the block on `stream`, reading session.tensor(name)?.address ...
//!         session.release(lease, stream)?;
//!     }
//!     session.end_pass(stream)?;
//! }
//! let metrics = session.metrics(None);
//! assert_eq!(metrics.runtime.passes, Some(2));
//! session.close()?;
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

// The crates whose types the session's API speaks of, for hosts that depend on the session
// alone.
pub use ddo_arena as arena;
pub use ddo_core as core;
pub use ddo_metrics as metrics;
pub use ddo_policy as policy;
pub use ddo_source as source;

mod decode_speed;
mod device;
mod error;
mod host_files;
mod report;
mod session;
pub mod testing;

pub use ddo_arena::{
    Assignment, FoundUnit, ModuleNode, ModuleTree, Parameter, ParameterRef, UnitKind, UnitRule,
};
pub use decode_speed::measure_decode_rate;
pub use device::{EncodedCacheFolder, ExecutionDevice, ExecutionTarget, PeerLinkProbe};
pub use error::SessionError;
pub use report::plan_snapshot;
pub use session::{
    ComponentSession, LeaseId, SessionRoute, SessionSpec, TensorView, UnitInfo, Weights,
};

/// Resolves one component's plan from explicit `(setting, value)` arguments (as a host's
/// keyword arguments), the process's `DDO_*` variables, the preset and defaults.
pub fn resolve(
    component: &str,
    arguments: &[(&str, &str)],
) -> Result<ddo_policy::Plan, SessionError> {
    let mut object = serde_json::Map::new();
    for (k, v) in arguments {
        let value =
            serde_json::from_str(v).unwrap_or_else(|_| serde_json::Value::String((*v).to_owned()));
        object.insert((*k).to_owned(), value);
    }
    let arguments: ddo_policy::DynamicOffloadConfig =
        serde_json::from_value(serde_json::Value::Object(object))
            .map_err(|e| SessionError::Config { setting: "arguments", message: e.to_string() })?;
    let request = ddo_policy::Request {
        component,
        arguments,
        environment: ddo_policy::Environment::from_process(),
        ..ddo_policy::Request::default()
    };
    Ok(ddo_policy::resolve(&request)?)
}
/// The README's Rust examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;

/// The book's page on the component session, its examples run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/src/rust/session.md")]
struct BookSessionDoctests;

/// The book's page on the Platform and the host backend, its examples run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/src/rust/platform.md")]
struct BookPlatformDoctests;

/// The book's page on the arena used on its own, its example run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/src/rust/arena.md")]
struct BookArenaDoctests;
