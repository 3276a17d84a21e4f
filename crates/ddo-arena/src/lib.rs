//! The bounded GPU weight arena: a component's execution units packed into stable device
//! ranges, as many kept resident as the budget allows, the rest streamed through execution slots
//! with uploads overlapped with compute, and memory reused only when a fence proves it free.
//!
//! The crate is generic over the ports of [`ddo_core`] (a [`ddo_core::Platform`] value) and
//! forbids `unsafe`. The same code runs on CUDA, on the host backend, and on mocks.
//!
//! ```text
//! units    module tree (data) -> blocks of the outermost repeated lists; shared parameters and
//!          always-resident modules stay resident (one rule for every host)
//! layout   units -> contiguous, aligned ranges; adjacent tensors upload in one copy; tensors
//!          converted on the device upload their stored bytes into two staging buffers
//! plan     budget -> resident units + N slots (N >= 2, prefetch depth + 1 when it fits),
//!          each streamed unit's slot chosen so its upload overlaps the most work
//! arena    prime()                          (enqueue resident + first streamed uploads)
//!          acquire(unit, stream) -> Lease   (upload if needed, then convert on the conversion
//!                                            stream; stream waits on the upload)
//!          release(lease, stream)           (records the fence that gates reuse)
//!          reclaim_idle(), close()          (free only what a fence proves idle)
//! ```
#![forbid(unsafe_code)]

mod arena;
mod error;
mod layout;
mod plan;
mod stats;
mod tree;

pub use arena::{Arena, Lease, PeerStoreReport, ReclaimReport, drop_failure};
pub use error::ArenaError;
pub use layout::{
    ALIGNED_TENSOR_BYTES, DeviceConversion, DeviceWork, EXTENT_ALIGN, Extent, Layout,
    MAX_BRIDGED_GAP, MAX_LAYOUT, MIN_TENSOR_ALIGN, STAGING_ROUND, TensorPlacement, UnitLayout,
    UnitSpec,
};
pub use plan::{Budget, ResidencyPlan};
pub use stats::ArenaStats;
pub use tree::{
    Assignment, FoundUnit, ModuleNode, ModuleTree, Parameter, ParameterRef, UnitKind, UnitRule,
};

pub use ddo_core::{ExecutionUnit, SlotId, UnitId};
