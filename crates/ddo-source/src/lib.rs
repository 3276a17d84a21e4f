//! Checkpoint sources: safetensors files opened as immutable tensor slices whose bytes reach the
//! arena through mmap, `pread` or O_DIRECT reads, within separate retained-storage and
//! registration ceilings.
//!
//! The readers are not written yet; until they are, the crate only names its place in the
//! workspace.

pub use ddo_core::{TensorSlice, WeightSource};
