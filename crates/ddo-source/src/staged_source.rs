//! [`StagedSource`]: a source whose ranges not held in host memory are read ahead into a
//! [`StagingPool`].

use std::sync::{Arc, Mutex, PoisonError};

use ddo_core::{
    CheckpointFileId, FileRange, HostSlice, ReadRequest, SourceError, TensorSlice, WeightSource,
};

use crate::StagingPool;

/// A [`WeightSource`] over `inner` (reads on demand, or retained windows for part of the
/// checkpoint) whose [`host_pieces`](WeightSource::host_pieces) are `inner`'s where it holds the
/// range in host memory, else the staging pool's: a buffer read ahead when the range was
/// [`announce`](WeightSource::announce)d, or read now into an idle buffer.
///
/// Identity is checked on the pool's open descriptors ([`StagingPool::check_unchanged`]): no
/// file is opened or looked up by path per upload. A range that fails to stage is served as
/// `None`, so the caller reads it through [`read_batch`](WeightSource::read_batch), which
/// reports the error.
pub struct StagedSource {
    inner: Arc<dyn WeightSource>,
    pool: Arc<StagingPool>,
    /// The ranges of the last announcement that need staging (reused: announcing allocates
    /// nothing once it has grown).
    staged: Mutex<Vec<FileRange>>,
}

impl StagedSource {
    /// Serves `inner`'s tensors, staging through `pool` (which reads the same checkpoint).
    pub fn new(inner: Arc<dyn WeightSource>, pool: Arc<StagingPool>) -> StagedSource {
        StagedSource { inner, pool, staged: Mutex::new(Vec::new()) }
    }

    /// The staging pool.
    pub fn pool(&self) -> &Arc<StagingPool> {
        &self.pool
    }

    fn inner_holds(&self, r: &FileRange) -> bool {
        self.inner.host_pieces(r.file, r.offset, r.len).is_some()
    }
}

impl std::fmt::Debug for StagedSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedSource").field("pool", &self.pool).finish_non_exhaustive()
    }
}

impl WeightSource for StagedSource {
    fn slices(&self) -> &[TensorSlice] {
        self.inner.slices()
    }

    fn check_unchanged(&self) -> Result<(), SourceError> {
        self.pool.check_unchanged()
    }

    fn read(&self, slice: usize, dst: &mut [u8]) -> Result<(), SourceError> {
        self.inner.read(slice, dst)
    }

    fn host_bytes(&self, slice: usize) -> Option<HostSlice> {
        self.inner.host_bytes(slice)
    }

    fn host_pieces(
        &self,
        file: CheckpointFileId,
        offset: u64,
        len: u64,
    ) -> Option<Vec<(u64, HostSlice)>> {
        if let Some(p) = self.inner.host_pieces(file, offset, len) {
            return Some(p);
        }
        match self.pool.take(FileRange { file, offset, len }) {
            Ok(Some(h)) => Some(vec![(0, h)]),
            Ok(None) | Err(_) => None,
        }
    }

    fn announce(&self, upcoming: &[FileRange]) {
        // Ranges the inner source holds in memory take no staging buffer.
        let mut staged = self.staged.lock().unwrap_or_else(PoisonError::into_inner);
        staged.clear();
        staged.extend(upcoming.iter().filter(|r| !self.inner_holds(r)));
        self.pool.announce(&staged);
    }

    fn read_batch(&self, requests: &[ReadRequest], dst: &mut [u8]) -> Result<(), SourceError> {
        self.pool.check_unchanged()?;
        self.inner.read_batch(requests, dst)
    }
}
