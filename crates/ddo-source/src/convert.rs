//! Dtype conversion at load: a checkpoint stored in one floating dtype served in the dtype the
//! module's parameters have (fp32 -> bf16/fp16, fp16 <-> bf16, the bf16/fp16 -> fp32 upcast
//! of modules a framework keeps in fp32, and fp8 -> fp16/bf16/fp32).
//!
//! Values convert by [`ddo_core::convert`], as PyTorch's `Tensor.to(dtype)` converts them.
//!
//! [`ConvertedSource`] converts once, on several threads, into retained host memory under a
//! [`RetainedStore`]'s ceiling, and serves every other tensor from the source it wraps.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use ddo_core::{
    CheckpointFileId, Dtype, HostSlice, ReadRequest, SourceError, TensorSlice, WeightSource,
};

pub use ddo_core::{convert, convertible};

use crate::{RetainedBuffer, RetainedStore};

/// What conversion did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ConversionReport {
    /// Tensors converted.
    pub tensors: u64,
    /// Bytes read in the checkpoint's dtypes.
    pub source_bytes: u64,
    /// Bytes written in the module's dtypes (retained).
    pub bytes: u64,
    /// Wall seconds converting took.
    pub seconds: f64,
    /// Threads that converted.
    pub workers: u64,
}

/// A source whose chosen tensors are served converted to another dtype, from retained host
/// memory; every other tensor comes from the source it wraps, unchanged.
pub struct ConvertedSource {
    inner: Arc<dyn WeightSource>,
    slices: Vec<TensorSlice>,
    /// File id of the first converted buffer (one buffer per file of the inner source).
    first_file: u32,
    buffers: Vec<HostSlice>,
    converted: Vec<bool>,
    report: ConversionReport,
}

impl std::fmt::Debug for ConvertedSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConvertedSource")
            .field("tensors", &self.slices.len())
            .field("report", &self.report)
            .finish_non_exhaustive()
    }
}

impl ConvertedSource {
    /// Converts each `(slice, dtype)` of `targets` from `inner` on `workers` threads into
    /// buffers of `store` (one per file, tensors in file order, so tensors adjacent in the
    /// checkpoint stay adjacent). `done(slice)` is called once a tensor's source bytes are no
    /// longer needed (a mapped source can drop those pages).
    ///
    /// Refused, with nothing kept, when a pair is not convertible, the store's ceiling or the
    /// host refuses the bytes, or a read fails.
    pub fn convert(
        inner: Arc<dyn WeightSource>,
        targets: &[(usize, Dtype)],
        store: &RetainedStore,
        workers: usize,
        done: &(dyn Fn(usize) + Sync),
    ) -> Result<ConvertedSource, SourceError> {
        let t = Instant::now();
        let mut slices = inner.slices().to_vec();
        let first_file = slices.iter().map(|s| s.file.0 + 1).max().unwrap_or(0);
        let mut converted = vec![false; slices.len()];
        // Inner file -> converted tensors in file order.
        let mut by_file: BTreeMap<u32, Vec<(u64, usize, Dtype)>> = BTreeMap::new();
        for &(i, to) in targets {
            let s =
                slices.get(i).ok_or(SourceError::NoSuchTensor { index: i, count: slices.len() })?;
            if !convertible(s.dtype, to) {
                return Err(SourceError::InvalidBatch(format!(
                    "tensor {:?} is {} and cannot be converted to {}; ddo converts between F32, F16 and BF16",
                    s.name,
                    s.dtype.as_str(),
                    to.as_str()
                )));
            }
            if std::mem::replace(&mut converted[i], true) {
                return Err(SourceError::InvalidBatch(format!(
                    "tensor {:?} converted twice",
                    s.name
                )));
            }
            by_file.entry(s.file.0).or_default().push((s.offset, i, to));
        }
        let mut report = ConversionReport::default();
        let mut buffers = Vec::new();
        // (slice, buffer index, offset in it, new dtype, new len)
        let mut placed = Vec::new();
        for tensors in by_file.values_mut() {
            tensors.sort_unstable_by_key(|&(offset, i, _)| (offset, i));
            let mut cursor = 0u64;
            let buffer = buffers.len();
            for &(_, i, to) in tensors.iter() {
                let s = &slices[i];
                let elements = s.len / s.dtype.size_bytes();
                let len = elements * to.size_bytes();
                placed.push((i, buffer, cursor, to, len));
                report.tensors += 1;
                report.source_bytes += s.len;
                report.bytes += len;
                cursor += len;
            }
            buffers.push(store.reserve(cursor)?);
        }
        let workers = workers.max(1);
        report.workers = workers as u64;
        Self::fill(&*inner, &slices, &placed, &mut buffers, workers, done)?;
        let buffers: Vec<HostSlice> =
            buffers.into_iter().map(|b| HostSlice::whole(Arc::new(b))).collect();
        for &(i, buffer, offset, to, len) in &placed {
            let s = &mut slices[i];
            s.file = CheckpointFileId(first_file + buffer as u32);
            s.offset = offset;
            s.len = len;
            s.dtype = to;
        }
        report.seconds = t.elapsed().as_secs_f64();
        // The stored bytes were read from the source: a file that changed under the reads (a
        // mapping read past a truncated end) is noticed before the converted values are used.
        inner.check_unchanged()?;
        Ok(ConvertedSource { inner, slices, first_file, buffers, converted, report })
    }

    /// Converts every placed tensor into its buffer, `workers` threads taking chunks in turn.
    fn fill(
        inner: &dyn WeightSource,
        slices: &[TensorSlice],
        placed: &[(usize, usize, u64, Dtype, u64)],
        buffers: &mut [RetainedBuffer],
        workers: usize,
        done: &(dyn Fn(usize) + Sync),
    ) -> Result<(), SourceError> {
        // Each tensor's destination, split off its buffer so threads write disjoint bytes.
        let mut outputs: Vec<(usize, &mut [u8])> = Vec::with_capacity(placed.len());
        let mut rest: Vec<&mut [u8]> = buffers.iter_mut().map(RetainedBuffer::bytes_mut).collect();
        for &(i, buffer, _, _, len) in placed {
            let whole = std::mem::take(&mut rest[buffer]);
            let (head, tail) = whole.split_at_mut(len as usize);
            rest[buffer] = tail;
            outputs.push((i, head));
        }
        let next = std::sync::Mutex::new(outputs.into_iter().zip(placed));
        let first_error = std::sync::Mutex::new(None::<SourceError>);
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| {
                    let mut scratch = Vec::new();
                    loop {
                        if first_error.lock().unwrap_or_else(|p| p.into_inner()).is_some() {
                            break; // another worker failed: the result is an error anyway
                        }
                        let item = next.lock().unwrap_or_else(|p| p.into_inner()).next();
                        let Some(((i, out), &(_, _, _, to, _))) = item else { break };
                        let s = &slices[i];
                        let result = convert_tensor(inner, i, s, to, out, &mut scratch);
                        if let Err(e) = result {
                            first_error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                            break;
                        }
                        done(i);
                    }
                });
            }
        });
        match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// What conversion did.
    pub fn report(&self) -> ConversionReport {
        self.report
    }

    /// The buffers holding converted tensors (retained, page-aligned): a host registers them.
    pub fn buffers(&self) -> &[HostSlice] {
        &self.buffers
    }

    /// Whether tensor `slice` is served converted.
    pub fn is_converted(&self, slice: usize) -> bool {
        self.converted.get(slice).copied().unwrap_or(false)
    }

    fn buffer(&self, file: CheckpointFileId) -> Option<&HostSlice> {
        file.0.checked_sub(self.first_file).and_then(|b| self.buffers.get(b as usize))
    }
}

/// Converts tensor `i` of `inner` into `out`: from its host bytes when the source holds them,
/// else through one read into `scratch`.
fn convert_tensor(
    inner: &dyn WeightSource,
    i: usize,
    s: &TensorSlice,
    to: Dtype,
    out: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<(), SourceError> {
    match inner.host_bytes(i) {
        Some(h) => convert(s.dtype, to, h.as_bytes(), out),
        None => {
            scratch.resize(s.len as usize, 0);
            inner.read(i, scratch)?;
            convert(s.dtype, to, scratch, out);
        }
    }
    Ok(())
}

impl WeightSource for ConvertedSource {
    fn slices(&self) -> &[TensorSlice] {
        &self.slices
    }

    fn check_unchanged(&self) -> Result<(), SourceError> {
        self.inner.check_unchanged()
    }

    fn check_in_use(&self) -> Result<(), SourceError> {
        self.inner.check_in_use()
    }

    fn read(&self, slice: usize, dst: &mut [u8]) -> Result<(), SourceError> {
        if !self.is_converted(slice) {
            return self.inner.read(slice, dst);
        }
        let bytes = self.host_bytes(slice).expect("converted tensors are retained");
        crate::copy_host_bytes(&self.slices[slice].name, &bytes, dst)
    }

    fn host_bytes(&self, slice: usize) -> Option<HostSlice> {
        if !self.is_converted(slice) {
            return self.inner.host_bytes(slice);
        }
        let s = &self.slices[slice];
        self.buffer(s.file)?.slice(s.offset as usize, s.len as usize)
    }

    fn host_range(&self, file: CheckpointFileId, offset: u64, len: u64) -> Option<HostSlice> {
        match self.buffer(file) {
            Some(b) => b.slice(usize::try_from(offset).ok()?, usize::try_from(len).ok()?),
            None => self.inner.host_range(file, offset, len),
        }
    }

    fn host_pieces(
        &self,
        file: CheckpointFileId,
        offset: u64,
        len: u64,
    ) -> Option<Vec<(u64, HostSlice)>> {
        match self.buffer(file) {
            Some(_) => self.host_range(file, offset, len).map(|h| vec![(0, h)]),
            None => self.inner.host_pieces(file, offset, len),
        }
    }

    fn read_batch(&self, requests: &[ReadRequest], dst: &mut [u8]) -> Result<(), SourceError> {
        let (converted, rest): (Vec<ReadRequest>, Vec<ReadRequest>) =
            requests.iter().copied().partition(|r| self.is_converted(r.slice));
        self.inner.read_batch(&rest, dst)?;
        for r in converted {
            let len = self.slices[r.slice].len as usize;
            let start = usize::try_from(r.dst_offset).unwrap_or(usize::MAX);
            let piece = start.checked_add(len).and_then(|end| dst.get_mut(start..end)).ok_or_else(
                || {
                    SourceError::InvalidBatch(format!(
                        "tensor {:?} at offset {} does not fit the buffer",
                        self.slices[r.slice].name, r.dst_offset
                    ))
                },
            )?;
            self.read(r.slice, piece)?;
        }
        Ok(())
    }
}
