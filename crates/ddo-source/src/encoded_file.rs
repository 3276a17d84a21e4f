//! Encoded files: the encodings an [`EncodedSource`] holds, written once beside what they were
//! made from (the checkpoint's files, the tensors, the format), and mapped by later loads instead
//! of encoding again.
//!
//! A file is `MAGIC`, the header's length (`u64`), its CRC-32 (`u32`) and 4 zero bytes, the
//! header (JSON: [`ENCODED_FILE_VERSION`], the codec's version, every checkpoint file's canonical
//! path, size, modification and status-change times, and per chosen tensor its name, dtype,
//! file, offset, length and where its encoding lies), then, from the next multiple of
//! [`BODY_ALIGN`], the encodings byte for byte as the retained buffer lays them out.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use ddo_core::{
    CheckpointFileId, FileRange, HostRegion, HostSlice, SourceError, TensorSlice, WeightSource,
};
use serde::{Deserialize, Serialize};

use crate::Checkpoint;
use crate::encoded_mapping::MappedEncodings;
use crate::encoded_source::{ENCODING_ALIGN, EncodedSource, EncodingReport};
use crate::mapping::MappedFile;

/// The version of the encoded files this build writes and reads.
pub const ENCODED_FILE_VERSION: u32 = 1;
/// The encodings start at a multiple of this in the file: whole pages (of up to 64 KiB), so
/// the mapped encodings register for DMA as a checkpoint mapping's pages do.
pub const BODY_ALIGN: u64 = 64 << 10;
const MAGIC: &[u8; 8] = b"DDOENC\r\n";
/// Magic, header length, header CRC-32, reserved.
const PREFIX: usize = 8 + 8 + 4 + 4;
/// A larger header is not one this build wrote.
const MAX_HEADER: u64 = 1 << 30;

/// One checkpoint file as an encoded file records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct FileEntry {
    path: String,
    size: u64,
    mtime_ns: i64,
    /// No user can set it: a file rewritten with its modification time restored differs here
    /// (0 in a file that does not record it: stale).
    #[serde(default)]
    ctime_ns: i64,
}

/// One chosen tensor as an encoded file records it; `encoding`: where its encoding lies in the
/// body (`None`: served as its own bytes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct TensorEntry {
    name: String,
    dtype: String,
    file: u32,
    offset: u64,
    len: u64,
    encoding: Option<[u64; 2]>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    version: u32,
    codec: u8,
    files: Vec<FileEntry>,
    tensors: Vec<TensorEntry>,
    /// Bytes of the encodings, from the body's start to the last one's end.
    body_len: u64,
}

/// What the encodings of chosen tensors are made from: the checkpoint's files (canonical path,
/// size, modification and status-change times) and the tensors (name, dtype, file, offset,
/// length), in the order they are encoded. An encoded file is used only for an identity equal
/// to the one it records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedFileIdentity {
    files: Vec<FileEntry>,
    tensors: Vec<TensorEntry>,
    /// The tensors' slices in the source.
    slices: Vec<usize>,
}

/// Why an encoded file was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodedFileRefusal {
    /// There is none.
    Missing,
    /// It was written for other checkpoint files, other tensors or by another format version.
    Stale(String),
    /// It cannot be read, or its header or an encoding in it is damaged.
    Damaged(String),
}

impl std::fmt::Display for EncodedFileRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EncodedFileRefusal::Missing => f.write_str("there is no encoded file"),
            EncodedFileRefusal::Stale(why) | EncodedFileRefusal::Damaged(why) => f.write_str(why),
        }
    }
}

impl EncodedFileIdentity {
    /// The identity of the tensors `chosen` (slices of `slices`, served from `checkpoint`).
    pub fn of(
        checkpoint: &Checkpoint,
        slices: &[TensorSlice],
        chosen: &[usize],
    ) -> Result<EncodedFileIdentity, SourceError> {
        let mut files = Vec::with_capacity(checkpoint.files().len());
        for f in checkpoint.files() {
            let path = std::fs::canonicalize(&f.path)
                .map_err(|source| SourceError::Io { file: f.path.clone(), source })?;
            files.push(FileEntry {
                path: path.to_string_lossy().into_owned(),
                size: f.identity.size,
                mtime_ns: i64::try_from(f.identity.mtime_ns).unwrap_or(i64::MAX),
                ctime_ns: i64::try_from(f.identity.ctime_ns).unwrap_or(i64::MAX),
            });
        }
        let mut tensors = Vec::with_capacity(chosen.len());
        for &i in chosen {
            let s =
                slices.get(i).ok_or(SourceError::NoSuchTensor { index: i, count: slices.len() })?;
            tensors.push(TensorEntry {
                name: s.name.clone(),
                dtype: s.dtype.as_str().to_owned(),
                file: s.file.0,
                offset: s.offset,
                len: s.len,
                encoding: None,
            });
        }
        Ok(EncodedFileIdentity { files, tensors, slices: chosen.to_vec() })
    }

    /// The encoded file's name: a hash of the checkpoint files' paths and the tensors' names
    /// (`<16 hex digits>.ddoenc`). Sizes, times and the version are left out of it, so a file
    /// written for a checkpoint since changed is found under the same name and written again.
    pub fn file_name(&self) -> String {
        // FNV-1a: stable across builds and platforms.
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        let mut eat = |bytes: &[u8]| {
            for &b in bytes.iter().chain([0u8].iter()) {
                hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        };
        for f in &self.files {
            eat(f.path.as_bytes());
        }
        eat(b"");
        for t in &self.tensors {
            eat(t.name.as_bytes());
        }
        format!("{hash:016x}.ddoenc")
    }
}

impl EncodedFileIdentity {
    /// The name of the file that records a decision about this checkpoint's encoding
    /// ([`record_decision`]): a hash of the checkpoint files' paths alone
    /// (`<16 hex digits>.decision`), whatever tensors are chosen.
    pub fn decision_name(&self) -> String {
        let files = EncodedFileIdentity { tensors: Vec::new(), ..self.clone() };
        files.file_name().replace(".ddoenc", ".decision")
    }
}

/// A decision recorded for a checkpoint: its files as they were, and why.
#[derive(Debug, Serialize, Deserialize)]
struct Decision {
    version: u32,
    files: Vec<FileEntry>,
    why: String,
}

/// Records in `folder` that the checkpoint of `identity` streams encoded, and `why`, for later
/// loads of the same checkpoint files ([`recorded_decision`]); written under a temporary name and
/// renamed into place.
pub fn record_decision(
    folder: &Path,
    identity: &EncodedFileIdentity,
    why: &str,
) -> Result<(), std::io::Error> {
    let decision =
        Decision { version: ENCODED_FILE_VERSION, files: identity.files.clone(), why: why.into() };
    let json = serde_json::to_vec(&decision).map_err(std::io::Error::other)?;
    std::fs::create_dir_all(folder)?;
    let path = folder.join(identity.decision_name());
    let (_, temp) = temporary(&path);
    std::fs::write(&temp, json).and_then(|()| std::fs::rename(&temp, &path)).inspect_err(|_| {
        let _ = std::fs::remove_file(&temp);
    })
}

/// Why the checkpoint of `identity` streams encoded, when a decision recorded in `folder`
/// ([`record_decision`]) names exactly its files (paths, sizes, modification and status-change
/// times); `None` otherwise (none recorded, another checkpoint's, or unreadable).
pub fn recorded_decision(folder: &Path, identity: &EncodedFileIdentity) -> Option<String> {
    let bytes = std::fs::read(folder.join(identity.decision_name())).ok()?;
    let d: Decision = serde_json::from_slice(&bytes).ok()?;
    (d.version == ENCODED_FILE_VERSION && d.files == identity.files).then_some(d.why)
}

/// Marks the encoded file at `path` used now, for a bounded folder's least-recently-used order
/// ([`cached_files`]): a `<name>.used` file beside it takes the time, so the encoded file itself
/// (which readers map and check for changes) is never touched.
pub fn mark_used(path: &Path) -> Result<(), std::io::Error> {
    let mut used = path.as_os_str().to_owned();
    used.push(".used");
    let f = File::create(&used)?;
    f.set_modified(std::time::SystemTime::now())
}

/// A file of an encoded-file folder, as [`cached_files`] finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedFile {
    /// The file.
    pub path: PathBuf,
    /// Its bytes.
    pub bytes: u64,
    /// When it was last used (written, or marked used), nanoseconds since the Unix epoch.
    pub last_used_ns: u128,
    /// A temporary file no writer touched for [`ABANDONED_AFTER`]: a writer that was killed.
    pub abandoned: bool,
}

/// A temporary file of an encoded-file folder untouched this long was left by a writer that
/// died (a live writer writes it tensor after tensor).
pub const ABANDONED_AFTER: std::time::Duration = std::time::Duration::from_secs(3600);

/// The encoded files of `folder` (`*.ddoenc`) and its temporary files (`*.tmp`), with their
/// bytes and when each was last used; decisions and use marks are not listed (they go with
/// their files through [`remove_cached`]). An unreadable folder lists nothing.
pub fn cached_files(folder: &Path) -> Vec<CachedFile> {
    let ns = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
    };
    let now = ns(std::time::SystemTime::now());
    let Ok(entries) = std::fs::read_dir(folder) else { return Vec::new() };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        let temp = name.ends_with(".tmp");
        if !(name.ends_with(".ddoenc") || temp) {
            continue;
        }
        let Ok(meta) = e.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        let mut last = meta.modified().map_or(0, ns);
        let mut used = path.as_os_str().to_owned();
        used.push(".used");
        if let Ok(m) = std::fs::metadata(&used).and_then(|m| m.modified()) {
            last = last.max(ns(m));
        }
        let abandoned = temp && now.saturating_sub(last) > ABANDONED_AFTER.as_nanos();
        out.push(CachedFile { path, bytes: meta.len(), last_used_ns: last, abandoned });
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

/// Removes an encoded file and its use mark (a reader that mapped it keeps its pages).
pub fn remove_cached(path: &Path) -> Result<(), std::io::Error> {
    let mut used = path.as_os_str().to_owned();
    used.push(".used");
    let _ = std::fs::remove_file(used);
    std::fs::remove_file(path)
}

/// Lowers the calling thread's scheduling priority (Linux: a niceness of 10), so work it and
/// the threads it starts do in the background yields the cores to the foreground's. Elsewhere
/// it does nothing.
pub fn lower_thread_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: gettid and setpriority take and return plain integers; on Linux a thread id as
    // `who` of PRIO_PROCESS sets that one thread's niceness.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 10);
    }
}

impl EncodedSource {
    /// Writes the encodings to `path`, recording `identity` (that of the tensors this source
    /// encoded, in that order): to a temporary file in the same folder, synced, then renamed
    /// over `path`, so a reader never sees a partial file and a failure leaves none behind.
    /// Gives the file's bytes; the report names the file.
    pub fn save(
        &mut self,
        identity: &EncodedFileIdentity,
        path: &Path,
    ) -> Result<u64, std::io::Error> {
        let t = Instant::now();
        let mut tensors = identity.tensors.clone();
        for (entry, &i) in tensors.iter_mut().zip(&identity.slices) {
            entry.encoding = self.ranges.get(i).copied().flatten().map(|r| [r.offset, r.len]);
        }
        let body: &[u8] = self.buffer.as_ref().map_or(&[], HostSlice::as_bytes);
        let header = Header {
            version: ENCODED_FILE_VERSION,
            codec: ddo_codec::ENCODING_VERSION,
            files: identity.files.clone(),
            tensors,
            body_len: body.len() as u64,
        };
        let json = serde_json::to_vec(&header).map_err(std::io::Error::other)?;
        let mut prefix = Vec::with_capacity(PREFIX);
        prefix.extend_from_slice(MAGIC);
        prefix.extend_from_slice(&(json.len() as u64).to_le_bytes());
        prefix.extend_from_slice(&crc32fast::hash(&json).to_le_bytes());
        prefix.extend_from_slice(&[0; 4]);
        let pad = body_offset(json.len() as u64) as usize - PREFIX - json.len();
        let (folder, temp) = temporary(path);
        let write = || -> Result<u64, std::io::Error> {
            let mut f = File::options().write(true).create_new(true).open(&temp)?;
            f.write_all(&prefix)?;
            f.write_all(&json)?;
            f.write_all(&vec![0; pad])?;
            f.write_all(body)?;
            f.sync_all()?;
            drop(f);
            std::fs::rename(&temp, path)?;
            Ok((PREFIX + json.len() + pad + body.len()) as u64)
        };
        let written = write().inspect_err(|_| {
            let _ = std::fs::remove_file(&temp);
        })?;
        // The rename is durable once the folder is synced (a failure only risks the new name).
        if let Ok(dir) = File::open(folder) {
            let _ = dir.sync_all();
        }
        self.report.file = Some(path.to_owned());
        self.report.file_seconds = t.elapsed().as_secs_f64();
        Ok(written)
    }

    /// Encodes the tensors of `identity` read from `inner` (a source of the checkpoint it was
    /// made of) straight into the encoded file at `path`, tensor after tensor on `workers`
    /// threads: host memory holds one tensor's bytes and encoding at a time, never the whole
    /// encodings. The file is written under a temporary name in the same folder, synced, then
    /// renamed over `path`, so no reader ever sees a partial file; a failure or `cancel` (checked
    /// between tensors) removes the temporary file. The file is the one
    /// [`save`](Self::save) writes, its header padded with spaces to the length reserved before
    /// the encodings were known. Gives the file's bytes, or `None` when cancelled.
    pub fn write_file(
        inner: &dyn WeightSource,
        identity: &EncodedFileIdentity,
        path: &Path,
        workers: usize,
        cancel: &AtomicBool,
    ) -> Result<Option<u64>, SourceError> {
        let io = |source: std::io::Error| SourceError::Io { file: path.to_owned(), source };
        let count = inner.slices().len();
        if let Some(&i) = identity.slices.iter().find(|&&i| i >= count) {
            return Err(SourceError::NoSuchTensor { index: i, count });
        }
        // The header's room: every encoding and the body at their longest.
        let header = |tensors: Vec<TensorEntry>, body_len: u64| Header {
            version: ENCODED_FILE_VERSION,
            codec: ddo_codec::ENCODING_VERSION,
            files: identity.files.clone(),
            tensors,
            body_len,
        };
        let longest: Vec<TensorEntry> = identity
            .tensors
            .iter()
            .map(|t| TensorEntry { encoding: Some([u64::MAX; 2]), ..t.clone() })
            .collect();
        let room = serde_json::to_vec(&header(longest, u64::MAX)).map_err(|e| io(e.into()))?.len();
        let body_at = body_offset(room as u64);
        let (folder, temp) = temporary(path);
        let write = || -> Result<Option<u64>, SourceError> {
            use std::os::unix::fs::FileExt;
            let f = File::options().write(true).create_new(true).open(&temp).map_err(io)?;
            let mut tensors = identity.tensors.clone();
            let mut end = 0u64;
            let (mut scratch, mut encoded) = (Vec::new(), Vec::new());
            for (entry, &i) in tensors.iter_mut().zip(&identity.slices) {
                if cancel.load(Ordering::Relaxed) {
                    return Ok(None);
                }
                let Some(enc) =
                    crate::encoded_source::encode_tensor(inner, i, workers, &mut scratch)?
                else {
                    continue;
                };
                let offset = end.next_multiple_of(ENCODING_ALIGN as u64);
                encoded.clear();
                encoded.resize(enc.encoded_len() as usize, 0);
                enc.write_into(&mut encoded).expect("the bytes taken are the encoding's");
                drop(enc);
                f.write_all_at(&encoded, body_at + offset).map_err(io)?;
                entry.encoding = Some([offset, encoded.len() as u64]);
                end = offset + encoded.len() as u64;
            }
            drop((scratch, encoded));
            crate::encoded_source::release_freed_memory();
            // The bytes were read from the source: a file that changed under the reads is
            // noticed before its encodings are written as its.
            inner.check_unchanged()?;
            let mut json = serde_json::to_vec(&header(tensors, end)).map_err(|e| io(e.into()))?;
            json.resize(room, b' ');
            let mut prefix = Vec::with_capacity(PREFIX + room);
            prefix.extend_from_slice(MAGIC);
            prefix.extend_from_slice(&(room as u64).to_le_bytes());
            prefix.extend_from_slice(&crc32fast::hash(&json).to_le_bytes());
            prefix.extend_from_slice(&[0; 4]);
            prefix.extend_from_slice(&json);
            f.write_all_at(&prefix, 0).map_err(io)?;
            // No encoding: the body is empty and the file ends at its start.
            f.set_len(body_at + end).map_err(io)?;
            f.sync_all().map_err(io)?;
            drop(f);
            if cancel.load(Ordering::Relaxed) {
                return Ok(None);
            }
            std::fs::rename(&temp, path).map_err(io)?;
            Ok(Some(body_at + end))
        };
        let written = write();
        if !matches!(written, Ok(Some(_))) {
            let _ = std::fs::remove_file(&temp);
        }
        if let Ok(Some(_)) = written
            && let Ok(dir) = File::open(folder)
        {
            let _ = dir.sync_all();
        }
        written
    }

    /// The encodings of the tensors of `identity`, from the encoded file at `path` when it
    /// records exactly that identity, every encoding in it checks (CRC-32 and structure, on
    /// `workers` threads) and decodes to its tensor's length; the other calls are `inner`'s, as
    /// [`encode`](Self::encode) gives them.
    ///
    /// The file is mapped, not read into retained memory: host memory holds the encodings once
    /// (as page cache, shared by every process loading them and given back under pressure, the
    /// checkpoint's pages of those tensors never touched), and the mapped pages register for DMA
    /// as the checkpoint mapping's do, so uploads run at link speed.
    pub fn open_file(
        inner: Arc<dyn WeightSource>,
        identity: &EncodedFileIdentity,
        path: &Path,
        workers: usize,
    ) -> Result<EncodedSource, EncodedFileRefusal> {
        let t = Instant::now();
        let shown = path.display();
        let damaged =
            |why: String| EncodedFileRefusal::Damaged(format!("{shown} is damaged: {why}"));
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(EncodedFileRefusal::Missing);
            }
            Err(e) => {
                return Err(EncodedFileRefusal::Damaged(format!("{shown} cannot be read: {e}")));
            }
        };
        let meta = file
            .metadata()
            .map_err(|e| EncodedFileRefusal::Damaged(format!("{shown} cannot be read: {e}")))?;
        if !meta.is_file() || meta.len() < PREFIX as u64 {
            return Err(damaged(format!("it is {} bytes, shorter than its header", meta.len())));
        }
        // SAFETY: encoded files are only ever written whole under a temporary name and renamed
        // into place, never written in place; a file changed in place anyway is noticed by
        // `check_unchanged` (its size and modification time, through the open file), and a
        // truncated one reads zeros, not a fault (the mapping's guard).
        let map = unsafe { MappedFile::map_open(&file, path) }
            .map(Arc::new)
            .map_err(|e| EncodedFileRefusal::Damaged(format!("{shown} cannot be mapped: {e}")))?;
        let bytes = map.as_bytes();
        let (header, body_at) = match read_header(bytes).map_err(damaged)? {
            Read::Header(h, at) if h.codec == ddo_codec::ENCODING_VERSION => (h, at),
            Read::Header(h, _) => {
                return Err(EncodedFileRefusal::Stale(format!(
                    "{shown} holds encodings of codec version {}; this build reads version {}",
                    h.codec,
                    ddo_codec::ENCODING_VERSION
                )));
            }
            Read::Version(v) => {
                return Err(EncodedFileRefusal::Stale(format!(
                    "{shown} was written in format version {v}; this build reads version \
                     {ENCODED_FILE_VERSION}"
                )));
            }
        };
        if header.files != identity.files {
            return Err(EncodedFileRefusal::Stale(format!(
                "the checkpoint changed since {shown} was written ({})",
                difference(&header.files, &identity.files)
            )));
        }
        let keys = |t: &[TensorEntry]| -> Vec<TensorEntry> {
            t.iter().map(|e| TensorEntry { encoding: None, ..e.clone() }).collect()
        };
        if keys(&header.tensors) != identity.tensors {
            return Err(EncodedFileRefusal::Stale(format!(
                "{shown} holds the encodings of other tensors than the ones chosen"
            )));
        }
        let end = body_at.checked_add(header.body_len);
        if end != Some(bytes.len() as u64) {
            return Err(damaged(format!(
                "it is {} bytes; its header describes {}",
                bytes.len(),
                end.map_or("more than 2^64".into(), |n| n.to_string())
            )));
        }
        // The encodings lie as `encode` lays them out: in order, each from the next multiple of
        // 256 after the one before, the last ending the body.
        let mut placed = 0u64;
        let mut checks = Vec::new();
        for e in &header.tensors {
            let Some([offset, len]) = e.encoding else { continue };
            if offset != placed.next_multiple_of(ENCODING_ALIGN as u64) || len == 0 {
                return Err(damaged(format!("the encoding of tensor {:?} is misplaced", e.name)));
            }
            placed = offset + len;
            if placed > header.body_len {
                return Err(damaged(format!("the encoding of tensor {:?} ends past it", e.name)));
            }
            checks.push((e, offset, len));
        }
        if placed != header.body_len {
            return Err(damaged("bytes follow the last encoding".into()));
        }
        let buffer = (header.body_len > 0).then(|| {
            HostSlice::new(
                map.clone() as Arc<dyn HostRegion>,
                body_at as usize,
                header.body_len as usize,
            )
            .expect("the body lies in the file")
        });
        let body = buffer.as_ref().map_or(&[][..], HostSlice::as_bytes);
        check_all(body, &checks, workers.max(1)).map_err(damaged)?;
        if map.faulted() {
            return Err(damaged("it shrank while read".into()));
        }
        let file_id =
            CheckpointFileId(inner.slices().iter().map(|s| s.file.0 + 1).max().unwrap_or(0));
        let mut ranges = vec![None; inner.slices().len()];
        let mut report = EncodingReport {
            workers: workers.max(1) as u64,
            from_file: true,
            file: Some(path.to_owned()),
            file_bytes_read: meta.len(),
            ..EncodingReport::default()
        };
        for (slice, e) in identity.slices.iter().zip(&header.tensors) {
            match e.encoding {
                Some([offset, len]) => {
                    ranges[*slice] = Some(FileRange { file: file_id, offset, len });
                    report.tensors += 1;
                    report.source_bytes += e.len;
                    report.encoded_bytes += len;
                }
                None => report.raw_tensors += 1,
            }
        }
        report.file_seconds = t.elapsed().as_secs_f64();
        let mapped = MappedEncodings::new(file, path.to_owned(), &meta, map);
        Ok(EncodedSource { inner, file: file_id, buffer, ranges, report, mapped: Some(mapped) })
    }
}

/// The folder of `path`, and a temporary name in it that no other writer takes
/// (`.<name>.<process>.<n>.tmp`): written there, then renamed over `path`.
fn temporary(path: &Path) -> (&Path, PathBuf) {
    let folder = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let temp = folder.join(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    (folder, temp)
}

/// Where the body starts after a header of `len` bytes.
fn body_offset(len: u64) -> u64 {
    (PREFIX as u64 + len).next_multiple_of(BODY_ALIGN)
}

/// What an encoded file's header says.
enum Read {
    /// The header, and where the body starts.
    Header(Header, u64),
    /// The file is of another format version.
    Version(u64),
}

/// The header of an encoded file's bytes (an error says why it is damaged).
fn read_header(bytes: &[u8]) -> Result<Read, String> {
    if bytes.get(..MAGIC.len()) != Some(&MAGIC[..]) {
        return Err("it is not an encoded file (magic)".into());
    }
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
    let len = u64_at(8);
    let crc = u32::from_le_bytes(bytes[16..20].try_into().expect("4"));
    if bytes[20..24] != [0; 4] {
        return Err("reserved bytes of its header are not zero".into());
    }
    if len > MAX_HEADER || PREFIX as u64 + len > bytes.len() as u64 {
        return Err(format!("its header of {len} bytes does not fit in its {} bytes", bytes.len()));
    }
    let json = &bytes[PREFIX..PREFIX + len as usize];
    if crc32fast::hash(json) != crc {
        return Err("its header's CRC-32 differs from the one recorded: the bytes changed".into());
    }
    // The version first: a later format may lay its header out otherwise.
    let value: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| format!("its header is not JSON: {e}"))?;
    match value.get("version").and_then(serde_json::Value::as_u64) {
        Some(v) if v != u64::from(ENCODED_FILE_VERSION) => Ok(Read::Version(v)),
        _ => {
            let header: Header = serde_json::from_value(value)
                .map_err(|e| format!("its header is not an encoded file's: {e}"))?;
            Ok(Read::Header(header, body_offset(len)))
        }
    }
}

/// What differs between the checkpoint files an encoded file records and the ones loaded.
fn difference(was: &[FileEntry], now: &[FileEntry]) -> String {
    if was.len() != now.len() {
        return format!("{} files, now {}", was.len(), now.len());
    }
    let changed: Vec<String> = was
        .iter()
        .zip(now)
        .filter(|(a, b)| a != b)
        .map(|(a, b)| match (a.path == b.path, a.size == b.size) {
            (false, _) => format!("{} is now {}", a.path, b.path),
            (true, false) => format!("{}: {} bytes, now {}", a.path, a.size, b.size),
            (true, true) => format!("{}: modified since", a.path),
        })
        .collect();
    changed.join("; ")
}

/// Checks every encoding `(entry, offset, len)` of `body` in place, on `workers` threads: each
/// must be whole and undamaged and decode to its tensor's bytes.
fn check_all(
    body: &[u8],
    checks: &[(&TensorEntry, u64, u64)],
    workers: usize,
) -> Result<(), String> {
    let next = Mutex::new(checks.iter());
    let first_error = Mutex::new(None::<String>);
    std::thread::scope(|scope| {
        for _ in 0..workers.min(checks.len()) {
            scope.spawn(|| {
                loop {
                    if first_error.lock().unwrap_or_else(PoisonError::into_inner).is_some() {
                        break;
                    }
                    let item = next.lock().unwrap_or_else(PoisonError::into_inner).next();
                    let Some(&(e, offset, len)) = item else { break };
                    let bytes = &body[offset as usize..(offset + len) as usize];
                    let result = match ddo_codec::EncodedBf16::check(bytes) {
                        Ok(elements) if elements.checked_mul(2) == Some(e.len) => Ok(()),
                        Ok(elements) => Err(format!(
                            "the encoding of tensor {:?} holds {elements} elements, the tensor {} bytes",
                            e.name, e.len
                        )),
                        Err(err) => Err(format!("the encoding of tensor {:?}: {err}", e.name)),
                    };
                    if let Err(why) = result {
                        first_error.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(why);
                        break;
                    }
                }
            });
        }
    });
    match first_error.into_inner().unwrap_or_else(PoisonError::into_inner) {
        Some(why) => Err(why),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    use crate::encoded_mapping::mtime_ns;
    use crate::{CheckpointSource, ReadOptions, RetainedStore};
    use ddo_core::{Admission, AdmissionProbe, GrowthRequest, HostMemoryObservation};

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

    /// Little-endian bf16 of a weight-like spread: few exponents, random signs and mantissas.
    fn weights(n: usize, seed: u64) -> Vec<u8> {
        (0..n as u64)
            .flat_map(|i| {
                let h = (seed * 0x9e37_79b9 + i).wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
                [h as u8, (0x3b + (h >> 8) % 3) as u8 | (((h >> 12) & 1) << 7) as u8]
            })
            .collect()
    }

    /// A checkpoint of two weight-like tensors, random bytes (kept raw) and an F32 tensor.
    fn checkpoint(dir: &Path) -> PathBuf {
        let random: Vec<u8> =
            (0..40_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
        let data = [
            ("a.weight", safetensors::Dtype::BF16, weights(70_000, 1)),
            ("noise", safetensors::Dtype::BF16, random),
            ("f32", safetensors::Dtype::F32, vec![3; 4096]),
            ("b.weight", safetensors::Dtype::BF16, weights(50_001, 2)),
        ];
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
            .iter()
            .map(|(n, d, bytes)| {
                let shape = vec![bytes.len() / if *d == safetensors::Dtype::F32 { 4 } else { 2 }];
                (n.to_string(), safetensors::tensor::TensorView::new(*d, shape, bytes).unwrap())
            })
            .collect();
        let path = dir.join("model.safetensors");
        std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
        path
    }

    struct Fixture {
        checkpoint: Arc<Checkpoint>,
        inner: Arc<dyn WeightSource>,
        chosen: Vec<usize>,
    }

    fn fixture(path: &Path) -> Fixture {
        let checkpoint = Arc::new(Checkpoint::open(path).unwrap());
        let inner: Arc<dyn WeightSource> =
            Arc::new(CheckpointSource::new(checkpoint.clone(), ReadOptions::pread()).unwrap());
        let find = |n: &str| checkpoint.find(n).unwrap();
        let chosen = vec![find("b.weight"), find("noise"), find("a.weight")];
        Fixture { checkpoint, inner, chosen }
    }

    fn identity(f: &Fixture) -> EncodedFileIdentity {
        EncodedFileIdentity::of(&f.checkpoint, f.inner.slices(), &f.chosen).unwrap()
    }

    /// Encodes the fixture's tensors and saves them in `dir`; gives the file.
    fn encode_and_save(f: &Fixture, dir: &Path) -> (EncodedSource, PathBuf) {
        let store = RetainedStore::new(u64::MAX, Arc::new(Generous));
        let mut enc =
            EncodedSource::encode(f.inner.clone(), &f.chosen, &store, 2, &|_| {}).unwrap();
        let id = identity(f);
        let path = dir.join(id.file_name());
        let written = enc.save(&id, &path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), written);
        assert_eq!(enc.report().file.as_deref(), Some(path.as_path()));
        (enc, path)
    }

    fn open(f: &Fixture, path: &Path) -> Result<EncodedSource, EncodedFileRefusal> {
        EncodedSource::open_file(f.inner.clone(), &identity(f), path, 3)
    }

    #[test]
    fn saved_encodings_open_as_they_were_encoded() {
        let dir = tempfile::tempdir().unwrap();
        let f = fixture(&checkpoint(dir.path()));
        let (enc, path) = encode_and_save(&f, dir.path());
        assert!(path.file_name().unwrap().to_str().unwrap().ends_with(".ddoenc"));
        assert_eq!(path.file_name().unwrap().len(), 16 + ".ddoenc".len());
        let read = open(&f, &path).unwrap();
        let (r, e) = (read.report(), enc.report());
        assert!(r.from_file && !e.from_file, "{r:?}");
        assert_eq!((r.tensors, r.raw_tensors), (2, 1), "{r:?}");
        assert_eq!((r.source_bytes, r.encoded_bytes), (e.source_bytes, e.encoded_bytes));
        assert_eq!(r.file_bytes_read, std::fs::metadata(&path).unwrap().len());
        assert_eq!(r.seconds, 0.0);
        for i in 0..f.inner.slices().len() {
            assert_eq!(read.encoding(i), enc.encoding(i), "slice {i}");
            let Some(range) = read.encoding(i) else { continue };
            let got = read.host_pieces(range.file, range.offset, range.len).unwrap();
            let want = enc.host_pieces(range.file, range.offset, range.len).unwrap();
            assert!(got[0].1.as_bytes() == want[0].1.as_bytes(), "slice {i}");
        }
        // The mapped body starts on a page and registers read-only.
        let windows = read.windows();
        assert_eq!(windows.len(), 1);
        let (body, read_only) = &windows[0];
        assert!(*read_only);
        assert_eq!(body.as_bytes().as_ptr() as usize % 4096, 0);
        assert!(body.as_bytes() == enc.windows()[0].0.as_bytes());
        read.check_unchanged().unwrap();
        // The identity is made of the canonical paths: another spelling finds the same file.
        let other = dir.path().join(".").join("model.safetensors");
        let g = fixture(&other);
        assert_eq!(identity(&g).file_name(), identity(&f).file_name());
        // Another choice of tensors is another file.
        let h = Fixture { chosen: f.chosen[..2].to_vec(), ..fixture(&other) };
        assert_ne!(identity(&h).file_name(), identity(&f).file_name());
        assert!(matches!(open(&h, &path), Err(EncodedFileRefusal::Stale(_))));
        assert_eq!(
            open(&f, &dir.path().join("none.ddoenc")).err(),
            Some(EncodedFileRefusal::Missing)
        );
    }

    /// The header's JSON of the file at `path`, and where it lies.
    fn header_of(path: &Path) -> (serde_json::Value, usize) {
        let bytes = std::fs::read(path).unwrap();
        let len = u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize;
        (serde_json::from_slice(&bytes[PREFIX..PREFIX + len]).unwrap(), len)
    }

    /// Rewrites the header of the file at `path` as `value`, with its CRC.
    fn rewrite_header(path: &Path, value: &serde_json::Value) {
        let bytes = std::fs::read(path).unwrap();
        let (_, len) = header_of(path);
        let json = serde_json::to_vec(value).unwrap();
        assert!(json.len() <= len, "the test rewrites headers no longer than they were");
        let mut json = json;
        json.resize(len, b' ');
        let mut out = bytes.clone();
        out[16..20].copy_from_slice(&crc32fast::hash(&json).to_le_bytes());
        out[PREFIX..PREFIX + len].copy_from_slice(&json);
        std::fs::write(path, out).unwrap();
    }

    #[test]
    fn a_damaged_changed_or_other_version_file_is_never_used() {
        let dir = tempfile::tempdir().unwrap();
        let f = fixture(&checkpoint(dir.path()));
        let (enc, path) = encode_and_save(&f, dir.path());
        let good = std::fs::read(&path).unwrap();
        let (_, header_len) = header_of(&path);
        let body_at = body_offset(header_len as u64) as usize;
        let damaged = |bytes: &[u8], what: &str| {
            std::fs::write(&path, bytes).unwrap();
            match open(&f, &path) {
                Err(EncodedFileRefusal::Damaged(why)) => {
                    assert!(why.contains(&path.display().to_string()), "{what}: {why}")
                }
                other => panic!("{what}: {:?}", other.map(|s| s.report())),
            }
        };
        // Every byte of the prefix and the header, and bytes all through every encoding.
        let ends: Vec<u64> = f
            .chosen
            .iter()
            .filter_map(|&i| enc.encoding(i))
            .flat_map(|r| [r.offset, r.offset + r.len])
            .collect();
        let mut at: Vec<usize> = (0..PREFIX + header_len).collect();
        for pair in ends.chunks(2) {
            let (from, to) = (body_at + pair[0] as usize, body_at + pair[1] as usize);
            at.extend((from..to).step_by(97).chain([from, from + 1, to - 1]));
        }
        for &i in &at {
            let mut bytes = good.clone();
            bytes[i] ^= 0x04;
            damaged(&bytes, &format!("a flip at byte {i}"));
        }
        for len in [0, 7, PREFIX, PREFIX + header_len, body_at, good.len() - 1] {
            damaged(&good[..len], &format!("cut at {len}"));
        }
        let mut longer = good.clone();
        longer.push(0);
        damaged(&longer, "a byte more");
        // A later version, or other encodings, are stale: written again by whoever finds them.
        std::fs::write(&path, &good).unwrap();
        let (mut header, _) = header_of(&path);
        header["version"] = serde_json::json!(ENCODED_FILE_VERSION + 1);
        rewrite_header(&path, &header);
        match open(&f, &path) {
            Err(EncodedFileRefusal::Stale(why)) => {
                assert!(why.contains("format version 2"), "{why}")
            }
            other => panic!("{:?}", other.map(|s| s.report())),
        }
        std::fs::write(&path, &good).unwrap();
        let (mut header, _) = header_of(&path);
        header["codec"] = serde_json::json!(ddo_codec::ENCODING_VERSION + 1);
        rewrite_header(&path, &header);
        assert!(matches!(open(&f, &path), Err(EncodedFileRefusal::Stale(_))));
        // An encoding moved by a consistent header is refused as misplaced.
        std::fs::write(&path, &good).unwrap();
        let (mut header, _) = header_of(&path);
        assert_eq!(header["tensors"][0]["encoding"][0], serde_json::json!(0));
        header["tensors"][0]["encoding"][0] = serde_json::json!(4);
        rewrite_header(&path, &header);
        assert!(matches!(open(&f, &path), Err(EncodedFileRefusal::Damaged(_))));
        std::fs::write(&path, &good).unwrap();
        assert!(open(&f, &path).is_ok());
    }

    #[test]
    fn a_changed_checkpoint_makes_its_file_stale() {
        let dir = tempfile::tempdir().unwrap();
        let model = checkpoint(dir.path());
        let f = fixture(&model);
        let (_, path) = encode_and_save(&f, dir.path());
        let file = File::options().write(true).open(&model).unwrap();
        file.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5))
            .unwrap();
        drop(file);
        let g = fixture(&model);
        assert_eq!(identity(&g).file_name(), identity(&f).file_name());
        match open(&g, &path) {
            Err(EncodedFileRefusal::Stale(why)) => {
                assert!(why.starts_with("the checkpoint changed since"), "{why}");
                assert!(why.contains("modified since"), "{why}");
            }
            other => panic!("{:?}", other.map(|s| s.report())),
        }
        // Written again, it serves.
        let (_, again) = encode_and_save(&g, dir.path());
        assert_eq!(again, path);
        assert!(open(&g, &path).is_ok());
    }

    #[test]
    fn a_checkpoint_rewritten_with_its_modification_time_restored_makes_its_file_stale() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let model = checkpoint(dir.path());
        let f = fixture(&model);
        let (_, path) = encode_and_save(&f, dir.path());
        let before = std::fs::metadata(&model).unwrap();
        // Past the coarse clock's tick, so the rewrite's status-change time differs.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let file = File::options().write(true).open(&model).unwrap();
        let last = before.len() - 1;
        file.write_all_at(&[0x5a], last).unwrap();
        file.set_modified(before.modified().unwrap()).unwrap();
        drop(file);
        let after = std::fs::metadata(&model).unwrap();
        assert_eq!((after.len(), mtime_ns(&after)), (before.len(), mtime_ns(&before)));
        match open(&fixture(&model), &path) {
            Err(EncodedFileRefusal::Stale(why)) => assert!(why.contains("modified since"), "{why}"),
            other => panic!("{:?}", other.map(|s| s.report())),
        }
    }

    #[test]
    fn a_file_that_cannot_be_written_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let f = fixture(&checkpoint(dir.path()));
        let store = RetainedStore::new(u64::MAX, Arc::new(Generous));
        let mut enc =
            EncodedSource::encode(f.inner.clone(), &f.chosen, &store, 2, &|_| {}).unwrap();
        let id = identity(&f);
        // A folder that is a file; a name taken by a folder (the rename fails after the write).
        let not_a_folder = dir.path().join("model.safetensors").join(id.file_name());
        assert!(enc.save(&id, &not_a_folder).is_err());
        let taken = dir.path().join("taken");
        std::fs::create_dir_all(taken.join("inside")).unwrap();
        assert!(enc.save(&id, &taken).is_err());
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
        assert_eq!(enc.report().file, None);
    }

    #[test]
    fn a_file_written_in_place_while_mapped_is_noticed() {
        let dir = tempfile::tempdir().unwrap();
        let f = fixture(&checkpoint(dir.path()));
        let (_, path) = encode_and_save(&f, dir.path());
        let read = open(&f, &path).unwrap();
        read.check_unchanged().unwrap();
        let file = File::options().append(true).open(&path).unwrap();
        (&file).write_all(&[0]).unwrap();
        let e = read.check_unchanged().unwrap_err();
        assert!(e.to_string().contains("written while mapped"), "{e}");
    }

    #[test]
    fn an_encoded_file_written_tensor_by_tensor_serves_what_save_writes() {
        let dir = tempfile::tempdir().unwrap();
        let f = fixture(&checkpoint(dir.path()));
        let (enc, saved) = encode_and_save(&f, dir.path());
        let id = identity(&f);
        let streamed = dir.path().join("streamed").join(id.file_name());
        std::fs::create_dir_all(streamed.parent().unwrap()).unwrap();
        let cancel = AtomicBool::new(false);
        let written = EncodedSource::write_file(&*f.inner, &id, &streamed, 2, &cancel).unwrap();
        assert_eq!(written, Some(std::fs::metadata(&streamed).unwrap().len()));
        let read = open(&f, &streamed).unwrap();
        let from_save = open(&f, &saved).unwrap();
        assert_eq!(read.report().tensors, 2);
        for i in 0..f.inner.slices().len() {
            assert_eq!(read.encoding(i), enc.encoding(i), "slice {i}");
            let Some(r) = read.encoding(i) else { continue };
            let got = read.host_pieces(r.file, r.offset, r.len).unwrap();
            let want = from_save.host_pieces(r.file, r.offset, r.len).unwrap();
            assert!(got[0].1.as_bytes() == want[0].1.as_bytes(), "slice {i}");
        }
        let names = |d: &Path| -> Vec<String> {
            std::fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(names(streamed.parent().unwrap()), vec![id.file_name()]);
        // Cancelled, it leaves nothing behind, and no file at its name.
        let other = dir.path().join("cancelled");
        std::fs::create_dir_all(&other).unwrap();
        let cancel = AtomicBool::new(true);
        let path = other.join(id.file_name());
        assert_eq!(EncodedSource::write_file(&*f.inner, &id, &path, 2, &cancel).unwrap(), None);
        assert!(names(&other).is_empty(), "{:?}", names(&other));
        // A temporary file a killed writer left (a prefix of a good file) is never opened.
        let good = std::fs::read(&streamed).unwrap();
        let temp = other.join(format!(".{}.1.0.tmp", id.file_name()));
        std::fs::write(&temp, &good[..good.len() / 2]).unwrap();
        assert_eq!(open(&f, &path).err(), Some(EncodedFileRefusal::Missing));
        let listed = cached_files(&other);
        assert_eq!(listed.len(), 1);
        assert!(!listed[0].abandoned, "a fresh temporary file may still be written");
        let old = std::time::SystemTime::now() - ABANDONED_AFTER * 2;
        File::options().write(true).open(&temp).unwrap().set_modified(old).unwrap();
        assert!(cached_files(&other)[0].abandoned);
    }

    #[test]
    fn a_decision_is_recorded_for_the_checkpoint_files_it_was_made_for() {
        let dir = tempfile::tempdir().unwrap();
        let model = checkpoint(dir.path());
        let f = fixture(&model);
        let folder = dir.path().join("cache");
        let id = identity(&f);
        assert_eq!(recorded_decision(&folder, &id), None);
        record_decision(&folder, &id, "transfer-bound").unwrap();
        assert_eq!(recorded_decision(&folder, &id).as_deref(), Some("transfer-bound"));
        // Any choice of tensors of the same files finds it.
        let fewer = Fixture { chosen: f.chosen[..1].to_vec(), ..fixture(&model) };
        assert_eq!(
            recorded_decision(&folder, &identity(&fewer)).as_deref(),
            Some("transfer-bound")
        );
        assert!(id.decision_name().ends_with(".decision"));
        assert!(cached_files(&folder).is_empty(), "decisions are not encoded files");
        // A changed checkpoint has none.
        let file = File::options().write(true).open(&model).unwrap();
        file.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5))
            .unwrap();
        drop(file);
        assert_eq!(recorded_decision(&folder, &identity(&fixture(&model))), None);
    }

    #[test]
    fn a_use_mark_orders_encoded_files_without_touching_them() {
        let dir = tempfile::tempdir().unwrap();
        let f = fixture(&checkpoint(dir.path()));
        let folder = dir.path().join("cache");
        std::fs::create_dir_all(&folder).unwrap();
        let (_, path) = encode_and_save(&f, &folder);
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(100);
        File::options().write(true).open(&path).unwrap().set_modified(old).unwrap();
        let before = std::fs::metadata(&path).unwrap();
        let listed = cached_files(&folder);
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].bytes, before.len());
        mark_used(&path).unwrap();
        let after = std::fs::metadata(&path).unwrap();
        assert_eq!(mtime_ns(&after), mtime_ns(&before), "the encoded file is not touched");
        assert!(cached_files(&folder)[0].last_used_ns > listed[0].last_used_ns);
        remove_cached(&path).unwrap();
        assert_eq!(std::fs::read_dir(&folder).unwrap().count(), 0);
    }
}
