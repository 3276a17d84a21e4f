//! [`RetainedSource`]: a checkpoint whose bytes are held in retained host windows, as far as the
//! storage ceiling allows, and read from the checkpoint for the rest.

use std::sync::Arc;

use ddo_core::{
    CheckpointFileId, HostRegion, HostSlice, ReadRequest, SourceError, TensorSlice, WeightSource,
};

use crate::{RetainedBuffer, RetainedStore};

/// Retained bytes of one file range: whole tensors, contiguous in the file.
#[derive(Debug)]
struct Window {
    file: CheckpointFileId,
    start: u64,
    end: u64,
    buffer: Arc<RetainedBuffer>,
}

/// What [`RetainedSource::retain`] kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetainedReport {
    /// Bytes held in retained windows.
    pub retained_bytes: u64,
    /// Number of windows.
    pub windows: usize,
    /// Tensor bytes left to the checkpoint reads.
    pub unretained_bytes: u64,
    /// Why retention stopped early (the ceiling or the host's refusal), if it did.
    pub stopped: Option<String>,
}

/// A [`WeightSource`] over `inner` whose tensors are copied, in file order, into retained
/// windows of about `window` bytes (whole tensors; a larger tensor is a window of its own) until
/// the store's ceiling or the host refuses. Retained ranges are served from host memory without
/// copying ([`WeightSource::host_pieces`] splits a range at window boundaries); the rest comes
/// from `inner` (its mapping, or reads). The windows are [`HostRegion`]s a
/// [`Registrar`](crate::Registrar) can page-lock; unregistering keeps their bytes.
pub struct RetainedSource {
    inner: Arc<dyn WeightSource>,
    windows: Vec<Window>,
}

impl std::fmt::Debug for RetainedSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetainedSource")
            .field("windows", &self.windows.len())
            .finish_non_exhaustive()
    }
}

impl RetainedSource {
    /// Reads `inner`'s tensors into windows of `store`, stopping at the first window the ceiling
    /// or the host refuses (what is retained stays; the report says why it stopped). Read errors
    /// fail the whole call and release what was retained.
    pub fn retain(
        inner: Arc<dyn WeightSource>,
        store: &RetainedStore,
        window: u64,
    ) -> Result<(RetainedSource, RetainedReport), SourceError> {
        Self::retain_only(inner, store, window, |_| true)
    }

    /// [`retain`](Self::retain) for the tensors `keep` selects (by index); the others are
    /// always read from `inner` and count in neither figure of the report (a tensor served in
    /// another form, such as converted, needs no retained copy as stored).
    pub fn retain_only(
        inner: Arc<dyn WeightSource>,
        store: &RetainedStore,
        window: u64,
        keep: impl Fn(usize) -> bool,
    ) -> Result<(RetainedSource, RetainedReport), SourceError> {
        let slices = inner.slices();
        let mut order: Vec<usize> = (0..slices.len()).filter(|&i| keep(i)).collect();
        order.sort_by_key(|&i| (slices[i].file.0, slices[i].offset));
        let mut windows = Vec::new();
        let mut stopped = None;
        let mut i = 0;
        while i < order.len() {
            // Whole tensors, contiguous in one file, up to `window` bytes.
            let first = &slices[order[i]];
            let (file, start) = (first.file, first.offset);
            let mut end = first.offset + first.len;
            let mut j = i + 1;
            while j < order.len() {
                let s = &slices[order[j]];
                if s.file != file || s.offset != end || s.offset + s.len - start > window {
                    break;
                }
                end = s.offset + s.len;
                j += 1;
            }
            let requests: Vec<ReadRequest> = order[i..j]
                .iter()
                .map(|&k| ReadRequest { slice: k, dst_offset: slices[k].offset - start })
                .collect();
            match store.retain(inner.as_ref(), &requests, end - start) {
                Ok(buffer) => windows.push(Window { file, start, end, buffer }),
                Err(e @ (SourceError::CeilingExceeded { .. } | SourceError::Refused(_))) => {
                    stopped = Some(e.to_string());
                    break;
                }
                Err(e) => return Err(e),
            }
            i = j;
        }
        let retained_bytes = windows.iter().map(|w| w.end - w.start).sum();
        let total: u64 = order.iter().map(|&i| slices[i].len).sum();
        let report = RetainedReport {
            retained_bytes,
            windows: windows.len(),
            unretained_bytes: total - retained_bytes,
            stopped,
        };
        Ok((RetainedSource { inner, windows }, report))
    }

    /// Each retained window as a whole slice (to register).
    pub fn windows(&self) -> Vec<HostSlice> {
        self.windows
            .iter()
            .map(|w| HostSlice::whole(w.buffer.clone() as Arc<dyn HostRegion>))
            .collect()
    }

    /// The window holding byte `offset` of `file`.
    fn window_at(&self, file: CheckpointFileId, offset: u64) -> Option<&Window> {
        let i = self.windows.partition_point(|w| (w.file.0, w.end) <= (file.0, offset));
        self.windows.get(i).filter(|w| w.file == file && w.start <= offset && offset < w.end)
    }
}

impl WeightSource for RetainedSource {
    fn slices(&self) -> &[TensorSlice] {
        self.inner.slices()
    }

    fn check_unchanged(&self) -> Result<(), SourceError> {
        self.inner.check_unchanged()
    }

    fn check_in_use(&self) -> Result<(), SourceError> {
        self.inner.check_in_use()
    }

    fn read(&self, slice: usize, dst: &mut [u8]) -> Result<(), SourceError> {
        match self.host_bytes(slice) {
            Some(h) if h.len() == dst.len() => {
                dst.copy_from_slice(h.as_bytes());
                Ok(())
            }
            _ => self.inner.read(slice, dst),
        }
    }

    fn host_bytes(&self, slice: usize) -> Option<HostSlice> {
        let s = self.slices().get(slice)?;
        self.host_range(s.file, s.offset, s.len)
    }

    fn host_range(&self, file: CheckpointFileId, offset: u64, len: u64) -> Option<HostSlice> {
        match self.window_at(file, offset) {
            Some(w) if offset + len <= w.end => HostSlice::new(
                w.buffer.clone(),
                usize::try_from(offset - w.start).ok()?,
                usize::try_from(len).ok()?,
            ),
            Some(_) => None,
            None => self.inner.host_range(file, offset, len),
        }
    }

    fn host_pieces(
        &self,
        file: CheckpointFileId,
        offset: u64,
        len: u64,
    ) -> Option<Vec<(u64, HostSlice)>> {
        let mut pieces = Vec::new();
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let piece = match self.window_at(file, at) {
                Some(w) => {
                    let n = w.end.min(end) - at;
                    let h = HostSlice::new(
                        w.buffer.clone(),
                        usize::try_from(at - w.start).ok()?,
                        usize::try_from(n).ok()?,
                    )?;
                    (n, h)
                }
                None => {
                    // Up to the next window (or the end) from the inner source's host memory.
                    let i = self.windows.partition_point(|w| (w.file.0, w.start) <= (file.0, at));
                    let next = self
                        .windows
                        .get(i)
                        .filter(|w| w.file == file)
                        .map_or(end, |w| w.start.min(end));
                    (next - at, self.inner.host_range(file, at, next - at)?)
                }
            };
            pieces.push((at - offset, piece.1));
            at += piece.0;
        }
        Some(pieces)
    }

    fn read_batch(&self, requests: &[ReadRequest], dst: &mut [u8]) -> Result<(), SourceError> {
        self.inner.check_in_use()?;
        let mut rest = Vec::new();
        for r in requests {
            match self.host_bytes(r.slice) {
                Some(h) => {
                    let start = usize::try_from(r.dst_offset).unwrap_or(usize::MAX);
                    let dst_len = dst.len();
                    let piece =
                        dst.get_mut(start..start.saturating_add(h.len())).ok_or_else(|| {
                            SourceError::InvalidBatch(format!(
                                "tensor {} at offset {} needs {} bytes, the buffer has {dst_len}",
                                r.slice,
                                r.dst_offset,
                                h.len()
                            ))
                        })?;
                    piece.copy_from_slice(h.as_bytes());
                }
                None => rest.push(*r),
            }
        }
        if rest.is_empty() { Ok(()) } else { self.inner.read_batch(&rest, dst) }
    }
}
