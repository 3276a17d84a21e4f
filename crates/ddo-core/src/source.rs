//! The weight-source port: immutable tensor slices and their bytes.

use crate::{HostSlice, SourceError, TensorSlice};

/// A checkpoint's tensors and a way to get their bytes.
///
/// Contract:
/// - [`slices`](WeightSource::slices) never changes during the source's life; indices into it
///   name tensors in every other call.
/// - Bytes delivered for a slice are exactly the checkpoint's bytes for it as they were when the
///   source was opened; if a file changed since, calls fail with
///   [`SourceError::CheckpointChanged`] instead of delivering different bytes.
/// - [`host_bytes`](WeightSource::host_bytes) returns the slice's bytes already in host memory
///   (a mapping or a retained buffer) when the source has them, without copying; they stay valid
///   while the returned slice lives.
/// - [`read`](WeightSource::read) fills `dst` (exactly the slice's length) with the bytes.
#[cfg_attr(feature = "mocks", mockall::automock)]
pub trait WeightSource: Send + Sync {
    /// All tensors of the source.
    fn slices(&self) -> &[TensorSlice];
    /// Checks every file's identity against the one recorded at open.
    fn check_unchanged(&self) -> Result<(), SourceError>;
    /// Reads tensor `slice` into `dst`.
    fn read(&self, slice: usize, dst: &mut [u8]) -> Result<(), SourceError>;
    /// The tensor's bytes in host memory, when the source holds them there.
    fn host_bytes(&self, slice: usize) -> Option<HostSlice>;
}
