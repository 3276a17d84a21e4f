//! The staging pool: a fixed set of host buffers, allocated once (aligned for O_DIRECT), that
//! reader threads created once fill with checkpoint ranges ahead of the uploads that copy from
//! them.
//!
//! A buffer is lent to a copy as a [`HostSlice`] of a loan region; a device adapter keeps that
//! slice until the copy is proven complete (the [`ddo_core::Residency`] contract). A buffer
//! whose loans have all dropped is idle and may be filled again; the last loan to drop starts
//! the reads of announced ranges that were waiting for a buffer.

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ddo_core::{FileIdentity, FileRange, HostRegion, HostSlice, Residency, SourceError};

use crate::read::{DIRECT_ALIGN, ReadMethod};
use crate::{Checkpoint, RetainedBuffer, RetainedStore};

/// How long an upload waits for a staging buffer whose copies are still in flight before the
/// pool gives up on it (the caller then reads the range into memory of its own).
const IDLE_WAIT: Duration = Duration::from_secs(30);

/// Shape of a [`StagingPool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingOptions {
    /// Host bytes all buffers may take together (the staging ceiling).
    pub ceiling: u64,
    /// The largest range the pool serves (a buffer holds one range, or a cover of several
    /// announced ranges a small gap apart).
    pub largest_range: u64,
    /// Reader threads (created once).
    pub readers: usize,
    /// `Direct` (O_DIRECT where the file system allows, else `Pread`) or `Pread`.
    pub method: ReadMethod,
    /// Largest single read request (several are in flight at once).
    pub chunk_bytes: usize,
}

/// What the pool did, for the profile. Seconds are wall time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StagingStats {
    /// Buffers in the pool.
    pub buffers: u64,
    /// Host bytes the buffers hold (allocated once).
    pub bytes: u64,
    /// Bytes read from disk into the buffers.
    pub disk_bytes: u64,
    /// Seconds at least one read was in flight.
    pub disk_seconds: f64,
    /// Seconds uploads waited for their range's read to land.
    pub stall_seconds: f64,
    /// Ranges (or covers of a unit's ranges) read because they were announced before they
    /// were needed.
    pub read_ahead: u64,
    /// Ranges nobody announced, read when an upload asked for them.
    pub on_demand: u64,
    /// Announced ranges dropped unused (their buffer went to another range).
    pub dropped: u64,
    /// Takes that found no idle buffer in time: the caller reads the range some other way.
    pub gave_up: u64,
}

/// A buffer's memory: an anonymous mapping (page-aligned, so O_DIRECT-aligned) written by the
/// pool's readers while no loan of it exists. It is registered whole; the registration never
/// reads the bytes.
#[derive(Debug)]
struct Memory {
    /// Owns the mapping (and its charge); all access goes through `ptr`.
    _buffer: RetainedBuffer,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is owned by the value and freed only when it drops; `ptr` points into it.
// Writes happen only through the pool's readers while the buffer is not lent (see `StagingPool`).
unsafe impl Send for Memory {}
// SAFETY: as above: shared references only read, and only after the readers finished.
unsafe impl Sync for Memory {}

// SAFETY: the address and length never change while the value lives. The bytes change only
// while no loan of the buffer exists: the only holders then are the pool and registrations,
// which page-lock the address and never read the bytes through this value.
unsafe impl HostRegion for Memory {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is the start of a live mapping of `len` bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// The region one served range's copies read. While any loan of a buffer lives its bytes do
/// not change; dropping the last one (the device proved the copies complete) makes the buffer
/// idle and starts the reads of announced ranges waiting for a buffer.
#[derive(Debug)]
struct Loan {
    memory: Arc<Memory>,
    pool: Weak<Inner>,
    buffer: usize,
}

// SAFETY: the address and length are the memory's, fixed; the pool writes the memory only while
// its buffer counts no loan (`Buffer::lent`), so a holder never sees the bytes change.
unsafe impl HostRegion for Loan {
    fn bytes(&self) -> &[u8] {
        self.memory.bytes()
    }
}

impl Drop for Loan {
    fn drop(&mut self) {
        let Some(inner) = self.pool.upgrade() else { return };
        let mut state = inner.lock();
        let b = &mut state.buffers[self.buffer];
        b.lent -= 1;
        if b.lent == 0 {
            inner.fill(&mut state);
            drop(state);
            inner.changed.notify_all();
        }
    }
}

/// One buffer's state.
#[derive(Debug, Default)]
struct Buffer {
    /// The range it holds or is receiving, and where the range starts in the buffer.
    range: Option<(FileRange, usize)>,
    /// Reads of the range not landed yet.
    pending: u32,
    /// The first read error of the range.
    error: Option<SourceError>,
    /// Named by the latest announcement.
    wanted: bool,
    /// Read because an upload asked (not announced).
    on_demand: bool,
    /// An upload is waiting for (or taking) the range: no one else may drop or reuse it.
    claimed: u32,
    /// Loans of the buffer alive outside the pool (copies the device has not retired).
    lent: u32,
    /// Part of the range was served: the buffer keeps it for the rest (a unit's other
    /// extents) until it is given to another range, or dropped as stale by an announcement
    /// that does not name it.
    served: bool,
}

impl Buffer {
    /// No read in flight, no take waiting, no loan outside the pool: it may be filled again.
    fn idle(&self) -> bool {
        self.pending == 0 && self.claimed == 0 && self.lent == 0
    }
}

/// Announced ranges of one file whose gap is at most this are read as one cover into one
/// buffer (a unit's extents, split by the tensors converted on the device, stay together).
const COVER_GAP: u64 = 1 << 20;

fn contains(held: &FileRange, r: &FileRange) -> bool {
    held.file == r.file && held.offset <= r.offset && r.offset + r.len <= held.offset + held.len
}

/// A read request: `len` bytes at `file_offset` into buffer `buffer` at `at`; the request needs
/// at least `needed` bytes (less only at the end of the file).
#[derive(Debug, Clone, Copy)]
struct Job {
    buffer: usize,
    file: usize,
    file_offset: u64,
    at: usize,
    len: usize,
    needed: usize,
}

#[derive(Debug, Default)]
struct Shared {
    buffers: Vec<Buffer>,
    jobs: VecDeque<Job>,
    stop: bool,
    in_flight: u32,
    busy_since: Option<Instant>,
    stats: StagingStats,
    /// The latest announcement, as covers, at most one per buffer: those without a buffer get
    /// one as buffers become idle; a served cover leaves the list.
    covers: Vec<FileRange>,
}

/// What the readers share with the pool.
#[derive(Debug)]
struct Inner {
    files: Vec<File>,
    paths: Vec<PathBuf>,
    identities: Vec<FileIdentity>,
    direct: bool,
    memory: Vec<Arc<Memory>>,
    /// Bytes of each buffer.
    buffer_len: usize,
    /// Bytes of one read request.
    chunk: usize,
    state: Mutex<Shared>,
    /// Signalled when jobs are queued, when a range lands, and on stop.
    changed: Condvar,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn idle(&self, state: &Shared, i: usize) -> bool {
        state.buffers[i].idle()
    }

    /// Gives idle buffers to the announced covers that have none, in order; a cover already
    /// held keeps its buffer, wanted again if it was served before. Returns whether reads were
    /// queued.
    fn fill(&self, state: &mut Shared) -> bool {
        let mut queued = false;
        for k in 0..state.covers.len() {
            let r = state.covers[k];
            if let Some(b) =
                state.buffers.iter_mut().find(|b| b.range.is_some_and(|(h, _)| contains(&h, &r)))
            {
                b.wanted = true;
                b.served = false;
                continue;
            }
            let Some(i) = self.pick(state) else { break };
            self.assign(state, i, r, false, false);
            queued = true;
        }
        queued
    }

    /// Forgets the landed ranges no longer announced (nobody asked for them): their buffers
    /// hold nothing. A range an upload is waiting for (read on demand) is kept.
    fn drop_stale(&self, state: &mut Shared) {
        let mut dropped = 0;
        for b in &mut state.buffers {
            if b.idle() && !b.wanted && b.range.is_some() {
                b.range = None;
                b.error = None;
                if !std::mem::take(&mut b.served) {
                    dropped += 1;
                }
            }
        }
        state.stats.dropped += dropped;
    }

    /// An idle buffer not wanted: an empty one first, then one whose range was served, else
    /// one holding a stale range nobody took.
    fn pick(&self, state: &Shared) -> Option<usize> {
        let idle = |i: &usize| self.idle(state, *i) && !state.buffers[*i].wanted;
        (0..self.memory.len()).filter(idle).min_by_key(|&i| {
            let b = &state.buffers[i];
            (b.range.is_some() && !b.served, b.range.is_some())
        })
    }

    /// Gives buffer `i` to range `r` and queues its reads (at the front when `urgent`).
    fn assign(&self, state: &mut Shared, i: usize, r: FileRange, urgent: bool, on_demand: bool) {
        if state.buffers[i].range.is_some() && !state.buffers[i].served {
            state.stats.dropped += 1;
        }
        let file = r.file.0 as usize;
        let (start, head) = if self.direct {
            let start = r.offset - r.offset % DIRECT_ALIGN as u64;
            (start, (r.offset - start) as usize)
        } else {
            (r.offset, 0)
        };
        let needed = head + r.len as usize;
        let cover = if self.direct { needed.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN } else { needed };
        let mut jobs = Vec::new();
        let mut at = 0;
        while at < cover || (cover == 0 && jobs.is_empty()) {
            let len = self.chunk.min(cover - at);
            jobs.push(Job {
                buffer: i,
                file,
                file_offset: start + at as u64,
                at,
                len,
                needed: needed.saturating_sub(at).min(len),
            });
            at += len;
            if len == 0 {
                break;
            }
        }
        let b = &mut state.buffers[i];
        b.range = Some((r, head));
        b.served = false;
        b.error = None;
        b.wanted = !on_demand;
        b.on_demand = on_demand;
        b.pending = jobs.len() as u32;
        if urgent {
            for j in jobs.into_iter().rev() {
                state.jobs.push_front(j);
            }
        } else {
            state.jobs.extend(jobs);
        }
    }
}

/// A fixed set of staging buffers and the reader threads that fill them.
///
/// Contract:
/// - Buffers, reader threads and file descriptors are created by [`StagingPool::new`] only;
///   serving a range allocates no buffer, opens no file and spawns no thread.
/// - [`StagingPool::announce`] starts reads of upcoming ranges into idle buffers; a buffer is
///   idle when no loan of it is held outside the pool (every copy from it was proven complete
///   and its slice dropped) and it is not receiving a read.
/// - [`StagingPool::take`] returns the range's bytes from a full buffer, waiting for its read if
///   it has not landed, or reading it (an unannounced range) into an idle buffer; the bytes are
///   the files' bytes, checked against their identity at open on the open descriptors.
pub struct StagingPool {
    inner: Arc<Inner>,
    readers: Vec<JoinHandle<()>>,
    retire: Option<Arc<dyn Residency>>,
}

impl std::fmt::Debug for StagingPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingPool")
            .field("buffers", &self.inner.memory.len())
            .field("buffer_len", &self.inner.buffer_len)
            .field("direct", &self.inner.direct)
            .finish_non_exhaustive()
    }
}

fn io(path: &std::path::Path, e: std::io::Error) -> SourceError {
    SourceError::Io { file: path.to_owned(), source: e }
}

/// Opens every file of `checkpoint` once, all with O_DIRECT when `direct` and every file
/// allows it, else all for positioned reads; each descriptor must be the file recorded at open.
fn open_files(checkpoint: &Checkpoint, direct: bool) -> Result<(Vec<File>, bool), SourceError> {
    if direct {
        let opened: Result<Vec<File>, SourceError> = checkpoint
            .files()
            .iter()
            .map(|f| crate::read::open_for_reads(&f.path, ReadMethod::Direct))
            .collect();
        match opened {
            Ok(files) => return same_files(checkpoint, files).map(|f| (f, true)),
            Err(SourceError::Unsupported(_)) => {}
            Err(e) => return Err(e),
        }
    }
    let files = checkpoint
        .files()
        .iter()
        .map(|f| File::open(&f.path).map_err(|e| io(&f.path, e)))
        .collect::<Result<Vec<_>, _>>()?;
    same_files(checkpoint, files).map(|f| (f, false))
}

fn same_files(checkpoint: &Checkpoint, files: Vec<File>) -> Result<Vec<File>, SourceError> {
    for (f, file) in checkpoint.files().iter().zip(&files) {
        let same = file
            .metadata()
            .is_ok_and(|m| m.dev() == f.identity.device && m.ino() == f.identity.inode);
        if !same {
            return Err(SourceError::CheckpointChanged {
                file: f.path.clone(),
                what: "the file was replaced".into(),
            });
        }
    }
    Ok(files)
}

impl StagingPool {
    /// Bytes one buffer takes to hold a range of `largest` bytes at any file offset (the
    /// aligned cover of an O_DIRECT read).
    pub fn buffer_bytes(largest: u64) -> u64 {
        largest.div_ceil(DIRECT_ALIGN as u64) * DIRECT_ALIGN as u64 + DIRECT_ALIGN as u64
    }

    /// Opens the checkpoint's files once (O_DIRECT for `ReadMethod::Direct` where the file
    /// system allows it, else positioned reads), allocates as many buffers as fit under the
    /// ceiling, each charged to `store` (the ceiling; growth admitted by the host first), and
    /// starts the reader threads. `retire`, when given, is asked to drop its holds on completed
    /// copies when a take finds every buffer lent and when announced ranges find no idle
    /// buffer.
    ///
    /// Refused with [`SourceError::CeilingExceeded`] when not even one buffer fits.
    pub fn new(
        checkpoint: &Checkpoint,
        options: StagingOptions,
        store: &RetainedStore,
        retire: Option<Arc<dyn Residency>>,
    ) -> Result<StagingPool, SourceError> {
        let buffer_len = Self::buffer_bytes(options.largest_range.max(1));
        let count = options.ceiling / buffer_len;
        if count == 0 {
            return Err(SourceError::CeilingExceeded {
                what: "staging",
                ceiling: options.ceiling,
                used: 0,
                requested: buffer_len,
            });
        }
        let (files, direct) = open_files(checkpoint, options.method == ReadMethod::Direct)?;
        let paths = checkpoint.files().iter().map(|f| f.path.clone()).collect();
        let identities = checkpoint.files().iter().map(|f| f.identity).collect();
        let mut memory = Vec::new();
        for _ in 0..count.min(256) {
            // Charged to the store (the ceiling, admitted by the host) until the memory drops.
            let mut buffer = store.reserve(buffer_len)?;
            let bytes = buffer.bytes_mut();
            let (ptr, len) = (bytes.as_mut_ptr(), bytes.len());
            memory.push(Arc::new(Memory { _buffer: buffer, ptr, len }));
        }
        let buffer_len = memory[0].len;
        let stats = StagingStats {
            buffers: memory.len() as u64,
            bytes: (memory.len() * buffer_len) as u64,
            ..StagingStats::default()
        };
        let inner = Arc::new(Inner {
            files,
            paths,
            identities,
            direct,
            buffer_len,
            chunk: options.chunk_bytes.max(DIRECT_ALIGN) / DIRECT_ALIGN * DIRECT_ALIGN,
            state: Mutex::new(Shared {
                buffers: std::iter::repeat_with(Buffer::default).take(memory.len()).collect(),
                stats,
                ..Shared::default()
            }),
            memory,
            changed: Condvar::new(),
        });
        let readers = (0..options.readers.clamp(1, 16))
            .map(|i| {
                let inner = inner.clone();
                std::thread::Builder::new()
                    .name(format!("ddo-staging-{i}"))
                    .spawn(move || read_loop(&inner))
                    .map_err(|e| SourceError::InvalidBatch(format!("starting a reader: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(StagingPool { inner, readers, retire })
    }

    /// Whether reads bypass the page cache (O_DIRECT).
    pub fn is_direct(&self) -> bool {
        self.inner.direct
    }

    /// Each buffer's memory, whole: the ranges to register for DMA (writable memory).
    pub fn buffers(&self) -> Vec<HostSlice> {
        self.inner
            .memory
            .iter()
            .map(|m| HostSlice::whole(m.clone() as Arc<dyn HostRegion>))
            .collect()
    }

    /// Bytes of one buffer.
    pub fn buffer_len(&self) -> usize {
        self.inner.buffer_len
    }

    /// Buffers lent to copies now (their loan held outside the pool).
    pub fn lent(&self) -> usize {
        self.inner.lock().buffers.iter().filter(|b| b.lent > 0).count()
    }

    /// Buffers holding or receiving a range that was announced and not taken yet.
    pub fn holding(&self) -> usize {
        self.inner.lock().buffers.iter().filter(|b| b.range.is_some() && !b.served).count()
    }

    /// A copy of the counters.
    pub fn stats(&self) -> StagingStats {
        let state = self.inner.lock();
        let mut stats = state.stats;
        if let Some(since) = state.busy_since {
            stats.disk_seconds += since.elapsed().as_secs_f64();
        }
        stats
    }

    /// Checks every file's identity on the open descriptors against the one recorded when the
    /// checkpoint was opened.
    pub fn check_unchanged(&self) -> Result<(), SourceError> {
        (0..self.inner.files.len()).try_for_each(|i| self.check_file(i))
    }

    fn check_file(&self, i: usize) -> Result<(), SourceError> {
        let path = &self.inner.paths[i];
        let changed = |what: String| SourceError::CheckpointChanged { file: path.clone(), what };
        let m = self.inner.files[i]
            .metadata()
            .map_err(|e| changed(format!("it cannot be read: {e}")))?;
        let was = self.inner.identities[i];
        if m.len() != was.size {
            return Err(changed(format!("size {} -> {}", was.size, m.len())));
        }
        let mtime = i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec());
        let ctime = i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec());
        if mtime != was.mtime_ns || ctime != was.ctime_ns {
            return Err(changed("it was written while in use".into()));
        }
        Ok(())
    }

    /// Starts reads of `upcoming` (in order) into idle buffers, as many as there are, and the
    /// rest as buffers are given back; a range already held or in flight keeps its buffer.
    /// Consecutive ranges of one file a small gap apart are read as one cover into one buffer,
    /// while it fits. Buffers holding ranges no longer announced become free for reuse.
    pub fn announce(&self, upcoming: &[FileRange]) {
        let capacity = (self.inner.buffer_len - DIRECT_ALIGN) as u64;
        let mut covers: Vec<FileRange> = Vec::new();
        for r in upcoming {
            if let Some(c) = covers.last_mut()
                && c.file == r.file
                && r.offset >= c.offset + c.len
                && r.offset - (c.offset + c.len) <= COVER_GAP
                && r.offset + r.len - c.offset <= capacity
            {
                c.len = r.offset + r.len - c.offset;
                continue;
            }
            covers.push(*r);
        }
        let capacity = capacity as usize;
        covers.retain(|c| c.len as usize <= capacity);
        covers.truncate(self.inner.memory.len());
        let mut state = self.inner.lock();
        for b in &mut state.buffers {
            b.wanted = false;
        }
        state.covers = covers;
        let queued = self.inner.fill(&mut state);
        let waiting = state.covers.len() > state.buffers.iter().filter(|b| b.wanted).count();
        self.inner.drop_stale(&mut state);
        drop(state);
        if queued {
            self.inner.changed.notify_all();
        }
        // Covers left without a buffer: buffers whose copies completed come back now (their
        // loans drop and start the reads); the rest as the device retires them.
        if waiting && let Some(device) = &self.retire {
            let _ = device.retire_completed_copies();
        }
    }

    /// The bytes of range `r` from a full buffer (see the type's contract), or the error of its
    /// read. An unannounced range waits for an idle buffer, asking `retire` to drop completed
    /// copies' holds meanwhile; `Ok(None)` when none became idle in time or the range is larger
    /// than a buffer (the caller reads it itself).
    pub fn take(&self, r: FileRange) -> Result<Option<HostSlice>, SourceError> {
        if u64::try_from(self.inner.buffer_len).is_ok_and(|l| r.len > l - DIRECT_ALIGN as u64) {
            return Ok(None);
        }
        let t = Instant::now();
        let deadline = t + IDLE_WAIT;
        let holding = |state: &Shared| {
            state.buffers.iter().position(|b| b.range.is_some_and(|(h, _)| contains(&h, &r)))
        };
        let mut state = self.inner.lock();
        let i = loop {
            // Checked on every round: a buffer given back meanwhile may have been given to
            // this range's cover.
            if let Some(i) = holding(&state) {
                state.buffers[i].claimed += 1;
                while state.buffers[i].pending > 0 {
                    state = self.inner.changed.wait(state).unwrap_or_else(PoisonError::into_inner);
                }
                state.buffers[i].claimed -= 1;
                // Another take of the buffer saw its read fail and emptied it: start again.
                if holding(&state) == Some(i) {
                    break i;
                }
                continue;
            }
            if let Some(i) = self.inner.pick(&state).or_else(|| {
                // Every idle buffer holds an announced range: take the last one.
                (0..self.inner.memory.len()).rev().find(|&i| self.inner.idle(&state, i))
            }) {
                self.inner.assign(&mut state, i, r, true, true);
                self.inner.changed.notify_all();
                continue;
            }
            if Instant::now() >= deadline {
                state.stats.gave_up += 1;
                return Ok(None);
            }
            if let Some(device) = &self.retire {
                drop(state);
                device.retire_completed_copies()?;
                state = self.inner.lock();
                if holding(&state).is_some() || self.inner.pick(&state).is_some() {
                    continue;
                }
            }
            state = self
                .inner
                .changed
                .wait_timeout(state, Duration::from_micros(200))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        };
        state.stats.stall_seconds += t.elapsed().as_secs_f64();
        let b = &mut state.buffers[i];
        let (held, head) = b.range.expect("a held range");
        b.wanted = false;
        if let Some(e) = b.error.take() {
            // A failed read serves none of its cover; the buffer goes to covers waiting.
            b.range = None;
            b.served = false;
            b.on_demand = false;
            if self.inner.fill(&mut state) {
                self.inner.changed.notify_all();
            }
            return Err(e);
        }
        if !std::mem::replace(&mut b.served, true) {
            if std::mem::take(&mut b.on_demand) {
                state.stats.on_demand += 1;
            } else {
                state.stats.read_ahead += 1;
            }
        }
        // Served: the buffer keeps the cover for the unit's other ranges, and the cover is not
        // read again for this announcement.
        state.covers.retain(|c| *c != held);
        state.buffers[i].lent += 1;
        let loan = Loan {
            memory: self.inner.memory[i].clone(),
            pool: Arc::downgrade(&self.inner),
            buffer: i,
        };
        drop(state);
        let head = head + (r.offset - held.offset) as usize;
        // A file written during the read is noticed before its bytes are used (the loan
        // drops with the error, the pool unlocked).
        self.check_file(r.file.0 as usize)?;
        let region: Arc<dyn HostRegion> = Arc::new(loan);
        Ok(HostSlice::new(region, head, r.len as usize))
    }
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        self.inner.lock().stop = true;
        self.inner.changed.notify_all();
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}

/// A reader thread: takes queued reads until the pool stops.
fn read_loop(inner: &Inner) {
    let mut state = inner.lock();
    loop {
        if state.stop {
            return;
        }
        let Some(job) = state.jobs.pop_front() else {
            state = inner.changed.wait(state).unwrap_or_else(PoisonError::into_inner);
            continue;
        };
        if state.in_flight == 0 {
            state.busy_since = Some(Instant::now());
        }
        state.in_flight += 1;
        drop(state);
        let result = read_job(inner, &job);
        state = inner.lock();
        state.in_flight -= 1;
        if state.in_flight == 0
            && let Some(since) = state.busy_since.take()
        {
            state.stats.disk_seconds += since.elapsed().as_secs_f64();
        }
        let b = &mut state.buffers[job.buffer];
        b.pending -= 1;
        match result {
            Ok(n) => state.stats.disk_bytes += n as u64,
            Err(e) => {
                b.error.get_or_insert(e);
            }
        }
        if state.buffers[job.buffer].pending == 0 {
            inner.changed.notify_all();
        }
    }
}

/// Reads one request into its buffer; returns the bytes read.
fn read_job(inner: &Inner, job: &Job) -> Result<usize, SourceError> {
    let memory = &inner.memory[job.buffer];
    assert!(job.at + job.len <= memory.len, "a read inside its buffer");
    // SAFETY: the buffer is assigned to this job's range and not lent (the pool assigns only
    // idle buffers and lends only after every read landed), and the jobs of one range write
    // disjoint parts of it: nothing else reads or writes these bytes now.
    let dst = unsafe { std::slice::from_raw_parts_mut(memory.ptr.add(job.at), job.len) };
    let file = &inner.files[job.file];
    let mut got = 0;
    while got < job.needed {
        match file.read_at(&mut dst[got..], job.file_offset + got as u64) {
            Ok(0) => {
                return Err(io(
                    &inner.paths[job.file],
                    std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "file ended before the end of a tensor read",
                    ),
                ));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io(&inner.paths[job.file], e)),
        }
    }
    Ok(got)
}
