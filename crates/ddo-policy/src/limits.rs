//! The ranges settings must fall in: shared by resolution and validation.

/// Size of one host registration segment.
pub const REGISTRATION_SEGMENT_MIB: u64 = 64;
/// Largest retained source storage ceiling, in GiB.
pub const MAX_SOURCE_CACHE_GB: f64 = 32.0;
/// Largest prefetch depth.
pub const MAX_PREFETCH_DEPTH: u32 = 16;
