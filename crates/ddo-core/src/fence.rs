//! The fence port: completion values recorded on streams.

use crate::{DeviceError, StreamId};

/// A completion value handed out by [`Fence::record`]. Values increase with every record, across
/// all streams of one fence source; a value says nothing about work on other streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FenceValue(pub u64);

/// Completion tracking for device work.
///
/// Contract:
/// - [`record`](Fence::record) returns a fresh value that completes once all work enqueued on
///   `stream` before the call has completed.
/// - [`query`](Fence::query) never blocks; `Ok(true)` is proof of completion, `Ok(false)` means
///   not yet. An `Err` proves nothing: callers must treat the guarded memory as still in use.
/// - [`wait`](Fence::wait) blocks the calling thread until the value completes.
/// - [`stream_wait`](Fence::stream_wait) makes later work on `stream` wait for the value without
///   blocking the host.
/// - Asking about a value this source never handed out is [`DeviceError::InvalidUse`].
#[cfg_attr(feature = "mocks", mockall::automock)]
pub trait Fence: Send + Sync {
    /// Records a completion value after all work enqueued on `stream` so far.
    fn record(&self, stream: StreamId) -> Result<FenceValue, DeviceError>;
    /// Whether `value` has completed, without blocking.
    fn query(&self, value: FenceValue) -> Result<bool, DeviceError>;
    /// Blocks until `value` has completed.
    fn wait(&self, value: FenceValue) -> Result<(), DeviceError>;
    /// Makes work enqueued on `stream` after this call wait for `value`.
    fn stream_wait(&self, stream: StreamId, value: FenceValue) -> Result<(), DeviceError>;
}
