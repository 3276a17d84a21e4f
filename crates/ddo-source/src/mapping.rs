//! Memory mappings of checkpoint files.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use ddo_core::{HostRegion, SourceError};

use crate::shared::Registry;

/// File identity (device, inode, length, modification seconds and nanoseconds) -> the live
/// shared mapping of that file.
type SharedKey = (u64, u64, u64, i64, i64);
static SHARED: Registry<SharedKey, MappedFile> = Registry::new();

/// The bytes one worker of [`MappedFile::populate`] brings in at a time.
pub const POPULATE_CHUNK: usize = 32 << 20;

/// A read-only mapping of a whole checkpoint file; a [`HostRegion`] so device copies and
/// registrations can hold it alive. A read past the end of a file truncated while mapped does
/// not kill the process: it reads zeros and [`MappedFile::faulted`] says so.
#[derive(Debug)]
pub struct MappedFile {
    path: PathBuf,
    // Declared before the mapping: the guard ends before the addresses are unmapped.
    guard: crate::fault::FaultGuard,
    map: memmap2::Mmap,
}

impl MappedFile {
    /// Maps the file at `path`.
    ///
    /// # Safety
    ///
    /// The file must not be modified while the mapping (or any `Arc` of it) lives: changed bytes
    /// would be read as they are. ddo checks the file's status before and after each read
    /// batch and upload, which catches a changed file but cannot make concurrent modification
    /// safe. Truncation is survivable: the lost range reads as zeros and is reported as a change.
    pub unsafe fn map(path: &Path) -> Result<MappedFile, SourceError> {
        let file =
            File::open(path).map_err(|source| SourceError::Io { file: path.to_owned(), source })?;
        // SAFETY: forwarded from this function's contract.
        unsafe { Self::map_open(&file, path) }
    }

    /// The process's mapping of the file at `path`: the live one when another source of this
    /// process mapped the same file (same device, inode, length and modification time), else a
    /// new one that later callers share. Sessions of one checkpoint on several GPUs, or several
    /// components of one file, then hold one mapping, and one page-locked registration of it
    /// (host registrations are shared per address).
    ///
    /// # Safety
    ///
    /// As [`map`](Self::map).
    pub unsafe fn shared(path: &Path) -> Result<Arc<MappedFile>, SourceError> {
        let file =
            File::open(path).map_err(|source| SourceError::Io { file: path.to_owned(), source })?;
        // SAFETY: forwarded from this function's contract.
        unsafe { Self::shared_open(&file, path) }
    }

    /// As [`shared`](Self::shared), for `file`, open at `path`: the mapping is of the file
    /// this descriptor reads, whatever the path names by now.
    ///
    /// # Safety
    ///
    /// As [`map`](Self::map).
    pub unsafe fn shared_open(file: &File, path: &Path) -> Result<Arc<MappedFile>, SourceError> {
        use std::os::unix::fs::MetadataExt;
        let io = |source| SourceError::Io { file: path.to_owned(), source };
        let m = file.metadata().map_err(io)?;
        let key = (m.dev(), m.ino(), m.len(), m.mtime(), m.mtime_nsec());
        // A mapping read past a truncated end is not shared again.
        // SAFETY: forwarded from this function's contract.
        SHARED.get_or_make(key, |map| !map.faulted(), || unsafe { Self::map_open(file, path) })
    }

    /// Maps `file`, open at `path`, as [`map`](Self::map) maps the file at a path.
    ///
    /// # Safety
    ///
    /// As [`map`](Self::map).
    pub(crate) unsafe fn map_open(file: &File, path: &Path) -> Result<MappedFile, SourceError> {
        let io = |source| SourceError::Io { file: path.to_owned(), source };
        // SAFETY: the caller promises the file is not modified while mapped.
        let map = unsafe { memmap2::MmapOptions::new().map(file) }.map_err(io)?;
        let guard = crate::fault::FaultGuard::new(map.as_ptr(), map.len());
        Ok(MappedFile { path: path.to_owned(), guard, map })
    }

    /// Whether a read of the mapping went past the end of its file (truncated while mapped):
    /// those reads gave zeros, and nothing read from the mapping since it was made can be
    /// trusted.
    pub fn faulted(&self) -> bool {
        self.guard.faulted()
    }

    /// Maps the file at `path` when `choice` allows mapping; `None` otherwise.
    pub fn map_with(
        path: &Path,
        choice: crate::MmapChoice,
    ) -> Result<Option<MappedFile>, SourceError> {
        if !choice.is_allowed() {
            return Ok(None);
        }
        // SAFETY: `choice` carries the caller's promise, made through `MmapChoice::auto`.
        unsafe { Self::map(path) }.map(Some)
    }

    /// The mapped bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.map
    }

    /// Drops this process's pages of `len` bytes at `offset` (whole pages around them): the
    /// bytes stay the file's and are read again from the page cache or the disk when next
    /// touched. Frees resident memory once a range was consumed (converted elsewhere).
    pub fn drop_pages(&self, offset: usize, len: usize) {
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > self.map.len()) {
            return;
        }
        // SAFETY: the mapping is shared and read-only, so discarding its pages loses nothing:
        // the next access reads the file's bytes again. A failure only leaves the pages resident.
        let _ = unsafe {
            self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len)
        };
    }

    /// Brings `len` bytes at `offset` into the page cache and this mapping's page tables on
    /// `workers` threads, each taking the next [`POPULATE_CHUNK`] in file order: a cold file
    /// arrives at the disk's speed, many large reads in flight, instead of one page fault at a
    /// time when it is registered. Returns the bytes populated. It stops early, leaving the rest
    /// to the first touch, on a range past the file's end (truncated: `MADV_POPULATE_READ`
    /// refuses rather than faulting) or a kernel without `MADV_POPULATE_READ` (before 5.14).
    pub fn populate(&self, offset: usize, len: usize, workers: usize) -> usize {
        let Some(end) = offset.checked_add(len).filter(|&end| end <= self.map.len()) else {
            return 0;
        };
        // Whole pages: madvise takes a page-aligned start.
        let start = offset - offset % 4096;
        let chunks = (end - start).div_ceil(POPULATE_CHUNK);
        let next = AtomicUsize::new(0);
        let done = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            for _ in 0..workers.clamp(1, chunks.max(1)) {
                scope.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        let c = next.fetch_add(1, Ordering::Relaxed);
                        if c >= chunks {
                            break;
                        }
                        let at = start + c * POPULATE_CHUNK;
                        let n = POPULATE_CHUNK.min(end - at);
                        // Read-ahead first: the whole chunk's reads are queued at once.
                        let _ = self.map.advise_range(memmap2::Advice::WillNeed, at, n);
                        match self.map.advise_range(memmap2::Advice::PopulateRead, at, n) {
                            Ok(()) => {
                                done.fetch_add(n, Ordering::Relaxed);
                            }
                            Err(_) => stop.store(true, Ordering::Relaxed),
                        }
                    }
                });
            }
        });
        done.into_inner()
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

// SAFETY: the mapping lives as long as the value and never moves; its contents stay the file's,
// which the caller of `MappedFile::map` promised not to modify while mapped.
unsafe impl HostRegion for MappedFile {
    fn bytes(&self) -> &[u8] {
        &self.map
    }
}
