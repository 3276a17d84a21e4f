//! [`EncodedSource`]: a source whose chosen bf16 tensors are also held entropy-coded
//! (`ddo_codec`), in retained host memory, for uploads that carry the encoding and decode it on
//! the device ([`WeightSource::encoding`]).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use ddo_core::{
    CheckpointFileId, Dtype, FileRange, HostSlice, ReadRequest, SourceError, TensorSlice,
    WeightSource,
};

use crate::RetainedStore;

/// Encodings start at multiples of this within their buffer (the decoder needs 4).
const ENCODING_ALIGN: usize = 256;
/// An encoding is kept only below this fraction of the tensor's bytes.
const KEEP_BELOW: f64 = 0.95;

/// What encoding did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EncodingReport {
    /// Tensors held encoded.
    pub tensors: u64,
    /// Tensors asked for but served as their own bytes (not bf16, or no smaller encoded).
    pub raw_tensors: u64,
    /// Bytes of the encoded tensors as served (bf16).
    pub source_bytes: u64,
    /// Bytes of their encodings (retained).
    pub encoded_bytes: u64,
    /// Wall seconds encoding took.
    pub seconds: f64,
    /// Threads that encoded.
    pub workers: u64,
}

/// A [`WeightSource`] over `inner` that also holds the entropy-coded form of chosen bf16
/// tensors, one after another in the order given (a unit's encodings upload as one copy) in one
/// retained buffer addressed as the file id after `inner`'s. Every call but
/// [`encoding`](WeightSource::encoding) and [`host_pieces`](WeightSource::host_pieces) of that
/// file is `inner`'s: the tensors' own bytes stay available.
pub struct EncodedSource {
    inner: Arc<dyn WeightSource>,
    file: CheckpointFileId,
    buffer: Option<HostSlice>,
    /// Per slice: where its encoding lies in the buffer.
    ranges: Vec<Option<FileRange>>,
    report: EncodingReport,
}

impl std::fmt::Debug for EncodedSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncodedSource").field("report", &self.report).finish_non_exhaustive()
    }
}

impl EncodedSource {
    /// Encodes the tensors `slices` of `inner` (in that order) on `workers` threads into one
    /// buffer of `store`. `done(slice)` is called once a tensor's bytes were read (a mapped
    /// source can drop those pages). A tensor that is not bf16, or whose encoding is not
    /// smaller, is served as its own bytes.
    ///
    /// Refused, with nothing kept, when a slice does not exist, a read fails, or the store's
    /// ceiling or the host refuses the bytes.
    pub fn encode(
        inner: Arc<dyn WeightSource>,
        slices: &[usize],
        store: &RetainedStore,
        workers: usize,
        done: &(dyn Fn(usize) + Sync),
    ) -> Result<EncodedSource, SourceError> {
        let t = Instant::now();
        let count = inner.slices().len();
        if let Some(&i) = slices.iter().find(|&&i| i >= count) {
            return Err(SourceError::NoSuchTensor { index: i, count });
        }
        let file = CheckpointFileId(inner.slices().iter().map(|s| s.file.0 + 1).max().unwrap_or(0));
        let workers = workers.max(1);
        let encoded = Self::encode_all(&*inner, slices, workers, done)?;
        let mut report = EncodingReport { workers: workers as u64, ..EncodingReport::default() };
        let mut ranges = vec![None; count];
        let mut cursor = 0usize;
        let mut placed = Vec::new();
        for (&i, enc) in slices.iter().zip(&encoded) {
            match enc {
                Some(bytes) => {
                    cursor = cursor.div_ceil(ENCODING_ALIGN) * ENCODING_ALIGN;
                    ranges[i] =
                        Some(FileRange { file, offset: cursor as u64, len: bytes.len() as u64 });
                    placed.push((cursor, bytes));
                    report.tensors += 1;
                    report.source_bytes += inner.slices()[i].len;
                    report.encoded_bytes += bytes.len() as u64;
                    cursor += bytes.len();
                }
                None => report.raw_tensors += 1,
            }
        }
        let buffer = if cursor > 0 {
            let mut buffer = store.reserve(cursor as u64)?;
            let out = buffer.bytes_mut();
            for (at, bytes) in placed {
                out[at..at + bytes.len()].copy_from_slice(bytes);
            }
            Some(HostSlice::whole(Arc::new(buffer)))
        } else {
            None
        };
        // The bytes were read from the source: a file that changed under the reads is noticed
        // before its encodings are used.
        inner.check_unchanged()?;
        report.seconds = t.elapsed().as_secs_f64();
        Ok(EncodedSource { inner, file, buffer, ranges, report })
    }

    /// Each tensor's encoding (`None`: served raw), `workers` threads taking tensors in turn.
    fn encode_all(
        inner: &dyn WeightSource,
        slices: &[usize],
        workers: usize,
        done: &(dyn Fn(usize) + Sync),
    ) -> Result<Vec<Option<Vec<u8>>>, SourceError> {
        let results: Mutex<Vec<Option<Vec<u8>>>> = Mutex::new(vec![None; slices.len()]);
        let next = Mutex::new(slices.iter().enumerate());
        let first_error = Mutex::new(None::<SourceError>);
        std::thread::scope(|scope| {
            for _ in 0..workers.min(slices.len().max(1)) {
                scope.spawn(|| {
                    let mut scratch = Vec::new();
                    loop {
                        if first_error.lock().unwrap_or_else(PoisonError::into_inner).is_some() {
                            break;
                        }
                        let item = next.lock().unwrap_or_else(PoisonError::into_inner).next();
                        let Some((k, &i)) = item else { break };
                        match encode_tensor(inner, i, &mut scratch) {
                            Ok(enc) => {
                                done(i);
                                results.lock().unwrap_or_else(PoisonError::into_inner)[k] = enc;
                            }
                            Err(e) => {
                                first_error
                                    .lock()
                                    .unwrap_or_else(PoisonError::into_inner)
                                    .get_or_insert(e);
                                break;
                            }
                        }
                    }
                });
            }
        });
        match first_error.into_inner().unwrap_or_else(PoisonError::into_inner) {
            Some(e) => Err(e),
            None => Ok(results.into_inner().unwrap_or_else(PoisonError::into_inner)),
        }
    }

    /// What encoding did.
    pub fn report(&self) -> EncodingReport {
        self.report
    }

    /// The host memory of the encodings, to register for DMA.
    pub fn windows(&self) -> Vec<HostSlice> {
        self.buffer.iter().cloned().collect()
    }
}

/// Tensor `i`'s encoding, or `None` when it is not bf16 or fp16 or its encoding is not smaller.
fn encode_tensor(
    inner: &dyn WeightSource,
    i: usize,
    scratch: &mut Vec<u8>,
) -> Result<Option<Vec<u8>>, SourceError> {
    let s = &inner.slices()[i];
    if !matches!(s.dtype, Dtype::BF16 | Dtype::F16) || s.len == 0 {
        return Ok(None);
    }
    let bytes: &[u8] = match inner.host_bytes(i) {
        Some(h) => {
            scratch.clear();
            scratch.extend_from_slice(h.as_bytes());
            scratch
        }
        None => {
            scratch.resize(s.len as usize, 0);
            inner.read(i, scratch)?;
            scratch
        }
    };
    let enc = ddo_codec::encode_bf16(bytes, 1).map_err(|e| {
        SourceError::InvalidBatch(format!("tensor {:?} cannot be encoded: {e}", s.name))
    })?;
    Ok((enc.ratio() < KEEP_BELOW).then(|| enc.to_bytes()))
}

impl WeightSource for EncodedSource {
    fn slices(&self) -> &[TensorSlice] {
        self.inner.slices()
    }

    fn check_unchanged(&self) -> Result<(), SourceError> {
        self.inner.check_unchanged()
    }

    fn read(&self, slice: usize, dst: &mut [u8]) -> Result<(), SourceError> {
        self.inner.read(slice, dst)
    }

    fn host_bytes(&self, slice: usize) -> Option<HostSlice> {
        self.inner.host_bytes(slice)
    }

    fn host_range(&self, file: CheckpointFileId, offset: u64, len: u64) -> Option<HostSlice> {
        if file == self.file {
            return self
                .buffer
                .as_ref()?
                .slice(usize::try_from(offset).ok()?, usize::try_from(len).ok()?);
        }
        self.inner.host_range(file, offset, len)
    }

    fn host_pieces(
        &self,
        file: CheckpointFileId,
        offset: u64,
        len: u64,
    ) -> Option<Vec<(u64, HostSlice)>> {
        if file == self.file {
            return self.host_range(file, offset, len).map(|h| vec![(0, h)]);
        }
        self.inner.host_pieces(file, offset, len)
    }

    fn announce(&self, upcoming: &[FileRange]) {
        let theirs: Vec<FileRange> =
            upcoming.iter().filter(|r| r.file != self.file).copied().collect();
        self.inner.announce(&theirs);
    }

    fn read_batch(&self, requests: &[ReadRequest], dst: &mut [u8]) -> Result<(), SourceError> {
        self.inner.read_batch(requests, dst)
    }

    fn encoding(&self, slice: usize) -> Option<FileRange> {
        self.ranges.get(slice).copied().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddo_core::{
        Admission, AdmissionProbe, GrowthRequest, HostBytes, HostMemoryObservation, HostRegion,
    };

    #[derive(Debug)]
    struct Generous;
    impl AdmissionProbe for Generous {
        fn admit(&self, _: &GrowthRequest) -> Admission {
            Admission::Granted { headroom: u64::MAX }
        }
        fn observe(&self) -> HostMemoryObservation {
            HostMemoryObservation::default()
        }
    }

    /// A source of one file held in memory.
    struct InMemory {
        slices: Vec<TensorSlice>,
        bytes: HostSlice,
    }

    impl WeightSource for InMemory {
        fn slices(&self) -> &[TensorSlice] {
            &self.slices
        }
        fn check_unchanged(&self) -> Result<(), SourceError> {
            Ok(())
        }
        fn read(&self, slice: usize, dst: &mut [u8]) -> Result<(), SourceError> {
            let s = &self.slices[slice];
            dst.copy_from_slice(
                &self.bytes.as_bytes()[s.offset as usize..(s.offset + s.len) as usize],
            );
            Ok(())
        }
        fn host_bytes(&self, _: usize) -> Option<HostSlice> {
            None
        }
    }

    fn weights(n: usize, seed: u32) -> Vec<u8> {
        // Normal-ish values of scale ~0.02: a sum of uniforms.
        let mut state = seed.wrapping_mul(2_654_435_761) | 1;
        (0..n)
            .flat_map(|_| {
                let mut sum = 0f32;
                for _ in 0..4 {
                    state ^= state << 13;
                    state ^= state >> 17;
                    state ^= state << 5;
                    sum += (state as f32 / u32::MAX as f32) - 0.5;
                }
                (((sum * 0.02).to_bits() >> 16) as u16).to_le_bytes()
            })
            .collect()
    }

    fn source() -> Arc<dyn WeightSource> {
        let mut bytes = Vec::new();
        let mut slices = Vec::new();
        let mut add = |name: &str, dtype: Dtype, data: Vec<u8>| {
            let shape = vec![(data.len() as u64) / dtype.size_bytes()];
            slices.push(TensorSlice {
                name: name.into(),
                dtype,
                shape,
                file: CheckpointFileId(0),
                path: "m.safetensors".into(),
                offset: bytes.len() as u64,
                len: data.len() as u64,
            });
            bytes.extend_from_slice(&data);
        };
        add("a.weight", Dtype::BF16, weights(300_000, 1));
        add("all_patterns", Dtype::BF16, (0..=u16::MAX).flat_map(u16::to_le_bytes).collect());
        add("f32", Dtype::F32, vec![7; 4096]);
        add("b.weight", Dtype::BF16, weights(200_001, 2));
        let bytes = HostSlice::whole(Arc::new(HostBytes::from(bytes)) as Arc<dyn HostRegion>);
        Arc::new(InMemory { slices, bytes })
    }

    #[test]
    fn encodings_decode_to_the_tensors_bytes_in_the_order_asked() {
        let inner = source();
        let store = RetainedStore::new(u64::MAX, Arc::new(Generous));
        let done = Mutex::new(Vec::new());
        let note = |i: usize| done.lock().unwrap().push(i);
        let enc = EncodedSource::encode(inner.clone(), &[3, 1, 2, 0], &store, 3, &note).unwrap();
        let r = enc.report();
        // Random bit patterns do not shrink; F32 is not encoded.
        assert_eq!((r.tensors, r.raw_tensors), (2, 2), "{r:?}");
        assert!(r.encoded_bytes < r.source_bytes * 7 / 10, "{r:?}");
        let (b, a) = (enc.encoding(3).unwrap(), enc.encoding(0).unwrap());
        assert!(b.offset < a.offset && b.offset % 256 == 0 && a.offset % 256 == 0);
        assert_eq!(b.file, CheckpointFileId(1));
        assert_eq!((enc.encoding(1), enc.encoding(2)), (None, None));
        for (i, range) in [(0, a), (3, b)] {
            let pieces = enc.host_pieces(range.file, range.offset, range.len).unwrap();
            let parsed = ddo_codec::EncodedBf16::parse(pieces[0].1.as_bytes()).unwrap();
            let mut got = vec![0; inner.slices()[i].len as usize];
            ddo_codec::decode_bf16(&parsed, &mut got, 2).unwrap();
            let mut want = vec![0; got.len()];
            inner.read(i, &mut want).unwrap();
            assert!(got == want, "tensor {i}");
        }
        // Other ranges, and the tensors' own bytes, are the inner source's.
        let mut own = vec![0; 4096];
        enc.read(2, &mut own).unwrap();
        assert_eq!(own, vec![7; 4096]);
        assert_eq!(enc.windows().len(), 1);
        let mut seen = done.into_inner().unwrap();
        seen.sort_unstable();
        assert_eq!(seen, vec![0, 1, 2, 3]);
    }

    #[test]
    fn a_missing_tensor_or_a_refusing_store_keeps_nothing() {
        let store = RetainedStore::new(u64::MAX, Arc::new(Generous));
        let e = EncodedSource::encode(source(), &[9], &store, 1, &|_| {}).unwrap_err();
        assert!(matches!(e, SourceError::NoSuchTensor { index: 9, .. }), "{e}");
        let small = RetainedStore::new(1024, Arc::new(Generous));
        let e = EncodedSource::encode(source(), &[0], &small, 1, &|_| {}).unwrap_err();
        assert!(matches!(e, SourceError::CeilingExceeded { .. }), "{e}");
        assert_eq!(small.used(), 0);
    }
}
