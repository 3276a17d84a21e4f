//! The weight-source port: immutable tensor slices and their bytes.

use crate::{CheckpointFileId, HostSlice, SourceError, TensorSlice};

/// One tensor of a batch read: tensor `slice` lands at `dst_offset` of the batch's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReadRequest {
    /// Index of the tensor in [`WeightSource::slices`].
    pub slice: usize,
    /// Where its bytes go in the destination buffer.
    pub dst_offset: u64,
}

/// `len` bytes at absolute `offset` of checkpoint file `file`: a range a caller will ask of
/// [`WeightSource::host_pieces`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileRange {
    /// The file.
    pub file: CheckpointFileId,
    /// Absolute offset in the file.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

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
/// - [`read_batch`](WeightSource::read_batch) fills several tensors into one buffer; destination
///   ranges must lie inside `dst` and not overlap. Sources override it to coalesce adjacent
///   tensors into large reads.
/// - [`announce`](WeightSource::announce) is a hint and never changes what any call returns:
///   the ranges the caller will ask of [`host_pieces`](WeightSource::host_pieces) next, in
///   that order. A source may read them ahead into host memory it owns; each call replaces
///   the previous announcement, and host memory held for a range that is no longer announced
///   (announced, then never asked for) is free for reuse. The default does nothing.
#[cfg_attr(feature = "mocks", mockall::automock)]
pub trait WeightSource: Send + Sync {
    /// All tensors of the source.
    fn slices(&self) -> &[TensorSlice];
    /// Checks every file's identity against the one recorded at open.
    fn check_unchanged(&self) -> Result<(), SourceError>;
    /// The check made around every upload: as [`check_unchanged`](WeightSource::check_unchanged)
    /// by default; cheaper where a source can make it so (the status of descriptors it holds,
    /// no path lookup), noticing a file written in place but not necessarily a path renamed
    /// over, which users of the source check with `check_unchanged` once per pass.
    fn check_in_use(&self) -> Result<(), SourceError> {
        self.check_unchanged()
    }
    /// Reads tensor `slice` into `dst`.
    fn read(&self, slice: usize, dst: &mut [u8]) -> Result<(), SourceError>;
    /// The tensor's bytes in host memory, when the source holds them there.
    fn host_bytes(&self, slice: usize) -> Option<HostSlice>;
    /// `len` bytes at absolute `offset` of `file` in host memory, when the source holds the
    /// whole range there (a mapping), so several adjacent tensors upload in one copy.
    fn host_range(&self, file: CheckpointFileId, offset: u64, len: u64) -> Option<HostSlice> {
        let _ = (file, offset, len);
        None
    }
    /// `len` bytes at absolute `offset` of `file` in host memory as pieces in order, each
    /// `(offset within the range, bytes)`, when the source holds the whole range in host memory
    /// (a mapping, or retained buffers that split it); `None` otherwise (the caller reads it).
    fn host_pieces(
        &self,
        file: CheckpointFileId,
        offset: u64,
        len: u64,
    ) -> Option<Vec<(u64, HostSlice)>> {
        self.host_range(file, offset, len).map(|h| vec![(0, h)])
    }
    /// Announces the ranges [`host_pieces`](WeightSource::host_pieces) will be asked for next,
    /// in order (a hint; see the trait's contract). The default ignores it.
    fn announce(&self, upcoming: &[FileRange]) {
        let _ = upcoming;
    }
    /// Where the source holds an entropy-coded form of tensor `slice` (the bytes
    /// `ddo_codec::EncodedBf16::to_bytes` writes, decoding to exactly the tensor's bytes): a
    /// range of a file id past the checkpoint's files that
    /// [`host_pieces`](WeightSource::host_pieces) answers while the source lives. `None` (the
    /// default) for a tensor served only as its own bytes.
    fn encoding(&self, slice: usize) -> Option<FileRange> {
        let _ = slice;
        None
    }
    /// Reads several tensors into `dst` at their requested offsets.
    fn read_batch(&self, requests: &[ReadRequest], dst: &mut [u8]) -> Result<(), SourceError> {
        for r in requests {
            let slice = self.slices().get(r.slice).ok_or_else(|| SourceError::NoSuchTensor {
                index: r.slice,
                count: self.slices().len(),
            })?;
            let start = usize::try_from(r.dst_offset).unwrap_or(usize::MAX);
            let end = start.saturating_add(usize::try_from(slice.len).unwrap_or(usize::MAX));
            let dst_len = dst.len();
            let piece = dst.get_mut(start..end).ok_or_else(|| {
                SourceError::InvalidBatch(format!(
                    "tensor {:?} at offset {} needs {} bytes, the buffer has {dst_len}",
                    slice.name, r.dst_offset, slice.len
                ))
            })?;
            self.read(r.slice, piece)?;
        }
        Ok(())
    }
}
