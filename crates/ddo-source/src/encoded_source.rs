//! [`EncodedSource`]: a source whose chosen bf16 tensors are also held entropy-coded
//! (`ddo_codec`), in retained host memory, for uploads that carry the encoding and decode it on
//! the device ([`WeightSource::encoding`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use ddo_core::{
    CheckpointFileId, Dtype, FileRange, HostSlice, ReadRequest, SourceError, TensorSlice,
    WeightSource,
};

use crate::RetainedStore;
use crate::encoded_mapping::MappedEncodings;

/// Encodings start at multiples of this within their buffer (the decoder needs 4).
pub(crate) const ENCODING_ALIGN: usize = 256;
/// An encoding is kept only below this fraction of the tensor's bytes.
const KEEP_BELOW: f64 = 0.95;

/// What encoding did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EncodingReport {
    /// Tensors held encoded.
    pub tensors: u64,
    /// Tensors asked for but served as their own bytes (not bf16, or no smaller encoded).
    pub raw_tensors: u64,
    /// Bytes of the encoded tensors as served (bf16).
    pub source_bytes: u64,
    /// Bytes of their encodings (retained, or mapped from an encoded file).
    pub encoded_bytes: u64,
    /// Wall seconds encoding took (0 when read from an encoded file).
    pub seconds: f64,
    /// Threads that encoded (or checked the encodings of an encoded file).
    pub workers: u64,
    /// Whether the encodings were read from an encoded file instead of encoded.
    pub from_file: bool,
    /// The encoded file read, or written once encoded.
    pub file: Option<PathBuf>,
    /// Bytes of the encoded file read and checked (0 when encoded).
    pub file_bytes_read: u64,
    /// Wall seconds reading and checking the encoded file, or writing it, took.
    pub file_seconds: f64,
}

/// A [`WeightSource`] over `inner` that also holds the entropy-coded form of chosen bf16
/// tensors, one after another in the order given (a unit's encodings upload as one copy) in one
/// retained buffer addressed as the file id after `inner`'s. Every call but
/// [`encoding`](WeightSource::encoding) and [`host_pieces`](WeightSource::host_pieces) of that
/// file is `inner`'s: the tensors' own bytes stay available.
pub struct EncodedSource {
    pub(crate) inner: Arc<dyn WeightSource>,
    pub(crate) file: CheckpointFileId,
    pub(crate) buffer: Option<HostSlice>,
    /// Per slice: where its encoding lies in the buffer.
    pub(crate) ranges: Vec<Option<FileRange>>,
    pub(crate) report: EncodingReport,
    /// The encoded file the buffer maps, when read from one.
    pub(crate) mapped: Option<MappedEncodings>,
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
    /// The buffer is reserved first, for the most the encodings can take (every asked tensor's
    /// bytes, each from a multiple of 256: an encoding is kept only when smaller), and each
    /// encoding is written into it as soon as it is made (tensors one at a time, each on every
    /// worker); what they did not take is then given back. Host memory holds the encodings
    /// once, plus one tensor's bytes and encoding.
    ///
    /// Refused, with nothing kept, when a slice does not exist, a read fails, or the store's
    /// ceiling or the host refuses the bytes (then before any tensor is read).
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
        let most = slices
            .iter()
            .try_fold(0u64, |sum, &i| {
                sum.checked_add(
                    inner.slices()[i].len.checked_next_multiple_of(ENCODING_ALIGN as u64)?,
                )
            })
            .ok_or_else(|| SourceError::InvalidBatch("the tensors' bytes overflow".into()))?;
        let mut buffer = if most > 0 { Some(store.reserve(most)?) } else { None };
        let out: &mut [u8] = match &mut buffer {
            Some(b) => b.bytes_mut(),
            None => &mut [],
        };
        let placed = Self::encode_all(&*inner, slices, workers, done, out)?;
        let mut report = EncodingReport { workers: workers as u64, ..EncodingReport::default() };
        let mut ranges = vec![None; count];
        let mut end = 0usize;
        for (&i, at) in slices.iter().zip(&placed) {
            match *at {
                Some((offset, len)) => {
                    ranges[i] = Some(FileRange { file, offset: offset as u64, len: len as u64 });
                    report.tensors += 1;
                    report.source_bytes += inner.slices()[i].len;
                    report.encoded_bytes += len as u64;
                    end = offset + len;
                }
                None => report.raw_tensors += 1,
            }
        }
        // What the encodings did not take goes back to the store.
        let buffer = buffer.filter(|_| end > 0).map(|mut b| {
            b.truncate(end);
            HostSlice::whole(Arc::new(b))
        });
        // The bytes were read from the source: a file that changed under the reads is noticed
        // before its encodings are used.
        inner.check_unchanged()?;
        report.seconds = t.elapsed().as_secs_f64();
        Ok(EncodedSource { inner, file, buffer, ranges, report, mapped: None })
    }

    /// Encodes the tensors one after another, each on `workers` threads (its chunks split
    /// between them), and writes each encoding into `out` in the order of `slices`, each from a
    /// multiple of [`ENCODING_ALIGN`] right after the one before. Host memory holds one tensor's
    /// bytes and encoding beyond `out` at any time. Gives where each encoding lies (`None`:
    /// served raw).
    fn encode_all(
        inner: &dyn WeightSource,
        slices: &[usize],
        workers: usize,
        done: &(dyn Fn(usize) + Sync),
        out: &mut [u8],
    ) -> Result<Vec<Option<(usize, usize)>>, SourceError> {
        let size = out.len();
        let mut placed = Vec::with_capacity(slices.len());
        let mut end = 0usize;
        let mut scratch = Vec::new();
        for &i in slices {
            let enc = encode_tensor(inner, i, workers, &mut scratch)?;
            done(i);
            let Some(enc) = enc else {
                placed.push(None);
                continue;
            };
            let offset = end.next_multiple_of(ENCODING_ALIGN);
            let len = enc.encoded_len() as usize;
            let Some(dst) = out.get_mut(offset..offset + len) else {
                return Err(SourceError::InvalidBatch(format!(
                    "the encodings outgrew the {size} bytes reserved for them"
                )));
            };
            enc.write_into(dst).expect("the bytes taken are the encoding's");
            placed.push(Some((offset, len)));
            end = offset + len;
        }
        release_freed_memory();
        Ok(placed)
    }

    /// The same encodings over `inner`, another source of the same tensors (the checkpoint
    /// opened again with other ranges registered); `None` when its tensors differ.
    pub fn serving(mut self, inner: Arc<dyn WeightSource>) -> Option<EncodedSource> {
        if inner.slices() != self.inner.slices() {
            return None;
        }
        self.inner = inner;
        Some(self)
    }

    /// What encoding did.
    pub fn report(&self) -> EncodingReport {
        self.report.clone()
    }

    /// The host memory of the encodings, to register for DMA, and whether it is read-only (a
    /// mapped encoded file).
    pub fn windows(&self) -> Vec<(HostSlice, bool)> {
        self.buffer.iter().map(|b| (b.clone(), self.mapped.is_some())).collect()
    }
}

/// Tensor `i`'s encoding, made on `workers` threads, or `None` when it is not bf16 or fp16 or
/// its encoding is not smaller. A tensor in host memory (a mapping) is encoded where it lies;
/// another is read into `scratch` first.
pub(crate) fn encode_tensor(
    inner: &dyn WeightSource,
    i: usize,
    workers: usize,
    scratch: &mut Vec<u8>,
) -> Result<Option<ddo_codec::EncodedBf16>, SourceError> {
    let s = &inner.slices()[i];
    if !matches!(s.dtype, Dtype::BF16 | Dtype::F16) || s.len == 0 {
        return Ok(None);
    }
    let held = inner.host_bytes(i);
    let bytes: &[u8] = match &held {
        Some(h) => h.as_bytes(),
        None => {
            scratch.resize(s.len as usize, 0);
            inner.read(i, scratch)?;
            scratch
        }
    };
    let enc = ddo_codec::encode_bf16(bytes, workers).map_err(|e| {
        SourceError::InvalidBatch(format!("tensor {:?} cannot be encoded: {e}", s.name))
    })?;
    Ok((enc.ratio() < KEEP_BELOW).then_some(enc))
}

/// Gives the heap's free memory back to the host: the encoder's buffers, freed tensor by
/// tensor, would otherwise stay resident in the allocator's arenas.
pub(crate) fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the system; it touches no live
    // allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

impl WeightSource for EncodedSource {
    fn slices(&self) -> &[TensorSlice] {
        self.inner.slices()
    }

    fn check_unchanged(&self) -> Result<(), SourceError> {
        self.inner.check_unchanged()?;
        self.mapped.as_ref().map_or(Ok(()), |m| m.check_unchanged())
    }

    fn check_in_use(&self) -> Result<(), SourceError> {
        self.inner.check_in_use()?;
        self.mapped.as_ref().map_or(Ok(()), |m| m.check_unchanged())
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
    use std::sync::Mutex;

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
        assert!(!enc.windows()[0].1, "retained memory is writable");
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
        let read = std::sync::atomic::AtomicUsize::new(0);
        let note = |_: usize| {
            read.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        };
        let e = EncodedSource::encode(source(), &[0], &small, 1, &note).unwrap_err();
        assert!(matches!(e, SourceError::CeilingExceeded { .. }), "{e}");
        assert_eq!(small.used(), 0);
        // The store refused before any tensor was read.
        assert_eq!(read.into_inner(), 0);
    }

    /// A probe that grants every growth and records it, with the tensors read by then.
    #[derive(Debug, Default)]
    struct Recording {
        read: std::sync::atomic::AtomicUsize,
        grants: Mutex<Vec<(GrowthRequest, usize)>>,
    }
    impl AdmissionProbe for Recording {
        fn admit(&self, request: &GrowthRequest) -> Admission {
            let read = self.read.load(std::sync::atomic::Ordering::SeqCst);
            self.grants.lock().unwrap().push((*request, read));
            Admission::Granted { headroom: u64::MAX }
        }
        fn observe(&self) -> HostMemoryObservation {
            HostMemoryObservation::default()
        }
    }

    #[test]
    fn encodings_are_written_into_one_reservation_made_before_any_read_and_cut_to_their_end() {
        let inner = source();
        let asked = [3, 1, 2, 0];
        for workers in [1, 2, 4] {
            let probe = Arc::new(Recording::default());
            let store = RetainedStore::new(u64::MAX, probe.clone());
            let note = |_: usize| {
                probe.read.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            };
            let enc = EncodedSource::encode(inner.clone(), &asked, &store, workers, &note).unwrap();
            // One reservation, asked before the first tensor was read, for every asked
            // tensor's bytes from a multiple of 256: the encodings never lie anywhere else.
            let most: u64 =
                asked.iter().map(|&i| inner.slices()[i].len.next_multiple_of(256)).sum();
            let grants = probe.grants.lock().unwrap().clone();
            assert_eq!(grants.len(), 1, "{grants:?}");
            assert_eq!((grants[0].0.bytes, grants[0].1), (most, 0), "{grants:?}");
            // What the encodings did not take went back: the store holds the buffer, which
            // ends with the last encoding.
            let window: Vec<HostSlice> = enc.windows().into_iter().map(|(w, _)| w).collect();
            let (b, a) = (enc.encoding(3).unwrap(), enc.encoding(0).unwrap());
            assert_eq!(window[0].len() as u64, a.offset + a.len);
            assert_eq!(store.used(), window[0].len() as u64);
            assert_eq!(enc.report().encoded_bytes, a.len + b.len);
            // Adjacent, in the order asked.
            assert_eq!(a.offset, (b.offset + b.len).next_multiple_of(256));
            drop((enc, window));
            assert_eq!(store.used(), 0);
        }
        // Nothing to encode keeps no buffer.
        let store = RetainedStore::new(u64::MAX, Arc::new(Generous));
        let enc = EncodedSource::encode(inner, &[1, 2], &store, 2, &|_| {}).unwrap();
        assert!(enc.windows().is_empty());
        assert_eq!((store.used(), enc.report().raw_tensors), (0, 2));
    }

    /// A source whose reads of one tensor fail.
    struct Failing(Arc<dyn WeightSource>, usize);
    impl WeightSource for Failing {
        fn slices(&self) -> &[TensorSlice] {
            self.0.slices()
        }
        fn check_unchanged(&self) -> Result<(), SourceError> {
            Ok(())
        }
        fn read(&self, slice: usize, dst: &mut [u8]) -> Result<(), SourceError> {
            if slice == self.1 {
                return Err(SourceError::InvalidBatch("the disk is gone".into()));
            }
            self.0.read(slice, dst)
        }
        fn host_bytes(&self, _: usize) -> Option<HostSlice> {
            None
        }
    }

    #[test]
    fn a_failed_read_keeps_nothing() {
        // First (the others wait for it to be placed) or last.
        for (workers, order) in [(1, [3, 1, 0]), (3, [3, 1, 0]), (3, [0, 3, 1])] {
            let store = RetainedStore::new(u64::MAX, Arc::new(Generous));
            let inner = Arc::new(Failing(source(), 0));
            let e = EncodedSource::encode(inner, &order, &store, workers, &|_| {}).unwrap_err();
            assert!(e.to_string().contains("the disk is gone"), "{e}");
            assert_eq!(store.used(), 0);
        }
    }
}
