//! Memory mappings of checkpoint files.

use std::fs::File;
use std::path::{Path, PathBuf};

use ddo_core::{HostRegion, SourceError};

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
    /// would be read as they are. ddo checks the file's identity before and after each read
    /// batch and upload, which catches a changed file but cannot make concurrent modification
    /// safe. Truncation is survivable: the lost range reads as zeros and is reported as a change.
    pub unsafe fn map(path: &Path) -> Result<MappedFile, SourceError> {
        let file =
            File::open(path).map_err(|source| SourceError::Io { file: path.to_owned(), source })?;
        // SAFETY: forwarded from this function's contract.
        unsafe { Self::map_open(&file, path) }
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
