//! The bounded GPU weight arena: execution units packed into stable device ranges, resident units
//! kept under a budget, streamed units cycled through execution slots, and reuse gated on fences.
//!
//! This crate is generic over the ports of [`ddo_core`] and forbids `unsafe`. Its state machine
//! is not written yet; until it is, the crate only names its place in the workspace.
#![forbid(unsafe_code)]

pub use ddo_core::{ExecutionUnit, SlotId, UnitId};
