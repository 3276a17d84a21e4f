//! Reading a checkpoint's files into the page cache in the background, while the host builds
//! the module that will map them.

use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;

use ddo_core::SourceError;

use crate::mapping::POPULATE_CHUNK;

/// Reads files into the page cache on worker threads, each taking the next
/// [`POPULATE_CHUNK`] in file order (the order a mapping's read-in and the first pass want
/// them), many reads in flight. Nothing is copied and each chunk is unmapped once read, so the
/// process's memory grows by at most a chunk per worker; a file changed meanwhile is read as
/// it now is (its identity is checked when it is opened for use). Dropping it stops the
/// workers after their current chunk.
#[derive(Debug)]
pub struct ReadAhead {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    files: Vec<(File, u64)>,
    /// `(file, offset)` of every chunk, in file order.
    chunks: Vec<(usize, u64)>,
    next: AtomicUsize,
    asked: AtomicU64,
    stop: AtomicBool,
}

impl ReadAhead {
    /// Starts reading `paths` with `workers` threads. A file that cannot be opened is an error
    /// naming it; nothing is started then.
    pub fn start(paths: &[PathBuf], workers: usize) -> Result<ReadAhead, SourceError> {
        let mut files = Vec::with_capacity(paths.len());
        let mut chunks = Vec::new();
        for path in paths {
            let io = |source| SourceError::Io { file: path.clone(), source };
            let file = File::open(path).map_err(io)?;
            let len = file.metadata().map_err(io)?.len();
            let index = files.len();
            chunks.extend(
                (0..len.div_ceil(POPULATE_CHUNK as u64))
                    .map(|c| (index, c * POPULATE_CHUNK as u64)),
            );
            files.push((file, len));
        }
        let shared = Arc::new(Shared {
            files,
            chunks,
            next: AtomicUsize::new(0),
            asked: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let n = workers.clamp(1, shared.chunks.len().max(1));
        let mut started = Vec::with_capacity(n);
        for _ in 0..n {
            let shared = shared.clone();
            match std::thread::Builder::new()
                .name("ddo-read-ahead".into())
                .spawn(move || shared.work())
            {
                Ok(handle) => started.push(handle),
                // Fewer workers read the same chunks; none at all reads nothing ahead.
                Err(_) => break,
            }
        }
        Ok(ReadAhead { shared, workers: started })
    }

    /// Bytes read in so far (chunks already in the page cache are not counted).
    pub fn asked(&self) -> u64 {
        self.shared.asked.load(Ordering::Relaxed)
    }

    /// The files' total bytes.
    pub fn total(&self) -> u64 {
        self.shared.files.iter().map(|(_, len)| len).sum()
    }

    /// Waits until every chunk was read in or found cached; returns the bytes read in.
    pub fn wait(mut self) -> u64 {
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        self.asked()
    }
}

impl Shared {
    fn work(&self) {
        while !self.stop.load(Ordering::Relaxed) {
            let c = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(&(file, offset)) = self.chunks.get(c) else { break };
            let (f, len) = &self.files[file];
            let n = (POPULATE_CHUNK as u64).min(len - offset);
            match read_in(f, offset, n) {
                Ok(true) => {
                    self.asked.fetch_add(n, Ordering::Relaxed);
                }
                Ok(false) => {}
                Err(_) => break,
            }
        }
    }
}

/// Brings `n` bytes of `file` at `offset` into the page cache through a mapping of just that
/// chunk, unmapped at once: the process holds at most one chunk's pages per worker. (Advice
/// alone, `POSIX_FADV_WILLNEED`, reads only a readahead window per call.)
fn read_in(file: &File, offset: u64, n: u64) -> std::io::Result<bool> {
    let len = usize::try_from(n).map_err(std::io::Error::other)?;
    // SAFETY: the mapping is read-only and its bytes are never read here: the kernel only
    // faults its pages in. A file truncated meanwhile makes MADV_POPULATE_READ fail (it does
    // not raise SIGBUS), which stops this worker.
    let map = unsafe { memmap2::MmapOptions::new().offset(offset).len(len).map(file) }?;
    if cached(&map) {
        return Ok(false);
    }
    let _ = map.advise(memmap2::Advice::WillNeed);
    map.advise(memmap2::Advice::PopulateRead).map(|()| true)
}

/// Whether every page of `map` is in the page cache already (a warm file is not walked again).
fn cached(map: &memmap2::Mmap) -> bool {
    let mut pages = vec![0u8; map.len().div_ceil(4096)];
    // SAFETY: `pages` has a byte for every page of the mapping, which starts page-aligned.
    let rc =
        unsafe { libc::mincore(map.as_ptr() as *mut libc::c_void, map.len(), pages.as_mut_ptr()) };
    rc == 0 && pages.iter().all(|p| p & 1 == 1)
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
