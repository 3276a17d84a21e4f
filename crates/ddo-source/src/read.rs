//! The read paths: positioned reads with a worker pool, O_DIRECT through aligned bounce buffers,
//! and copies out of a mapping. All land in caller-provided buffers.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Mutex;

use ddo_core::SourceError;

use crate::mapping::MappedFile;
use crate::plan::Run;

/// How a source reads tensor bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadMethod {
    /// Positioned reads through the page cache.
    Pread,
    /// O_DIRECT reads that bypass the page cache (cold loads, the disk route).
    Direct,
    /// Copies out of a memory mapping (requires [`crate::CheckpointSource::with_mmap`]).
    Mmap,
}

/// Tuning of the read paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadOptions {
    /// The read path.
    pub method: ReadMethod,
    /// Worker threads per batch.
    pub workers: usize,
    /// Largest single read (runs are split at this size so workers share large tensors).
    pub chunk_bytes: usize,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions::pread()
    }
}

impl ReadOptions {
    /// Positioned reads: 16 workers, 8 MiB reads (measured best on the GPU machine's disk).
    pub fn pread() -> Self {
        ReadOptions { method: ReadMethod::Pread, workers: 16, chunk_bytes: 8 << 20 }
    }

    /// O_DIRECT reads: 6 workers, 16 MiB reads (measured best on the GPU machine's disk; more
    /// concurrent direct requests ran slower there).
    pub fn direct() -> Self {
        ReadOptions { method: ReadMethod::Direct, workers: 6, chunk_bytes: 16 << 20 }
    }
}

/// Alignment of O_DIRECT offsets, lengths and buffers.
pub const DIRECT_ALIGN: usize = 4096;

/// A run and the destination slices of its pieces.
type Job<'a> = (Run, Vec<&'a mut [u8]>);

/// Executes `runs` with their carved destinations on `workers` threads.
pub(crate) fn execute(
    paths: &[&Path],
    maps: Option<&[std::sync::Arc<MappedFile>]>,
    files: &[File],
    options: ReadOptions,
    runs: Vec<Run>,
    dsts: Vec<Vec<&mut [u8]>>,
) -> Result<(), SourceError> {
    let queue: Mutex<Vec<Job<'_>>> = Mutex::new(runs.into_iter().zip(dsts).rev().collect());
    let workers = options
        .workers
        .max(1)
        .min(queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len().max(1));
    let first_error: Mutex<Option<SourceError>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                let mut worker = Worker::new(paths, maps, files, options);
                loop {
                    if first_error
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .is_some()
                    {
                        return;
                    }
                    let Some((run, mut dst)) =
                        queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop()
                    else {
                        return;
                    };
                    if let Err(e) = worker.read(&run, &mut dst) {
                        first_error
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .get_or_insert(e);
                        return;
                    }
                }
            });
        }
    });
    match first_error.into_inner().expect("error slot") {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Opens the checkpoint's files for positioned reads (with O_DIRECT for
/// [`ReadMethod::Direct`]): the descriptors a source keeps for its life, shared by every read.
pub(crate) fn open_for_reads(path: &Path, method: ReadMethod) -> Result<File, SourceError> {
    let mut open = OpenOptions::new();
    open.read(true);
    if method == ReadMethod::Direct {
        open.custom_flags(libc::O_DIRECT);
    }
    open.open(path).map_err(|e| {
        if e.raw_os_error() == Some(libc::EINVAL) {
            SourceError::Unsupported(format!(
                "{} is on a filesystem without O_DIRECT; use the pread or mmap read backend",
                path.display()
            ))
        } else {
            SourceError::Io { file: path.to_owned(), source: e }
        }
    })
}

/// Per-thread state: the source's open files and a bounce buffer.
struct Worker<'a> {
    paths: &'a [&'a Path],
    maps: Option<&'a [std::sync::Arc<MappedFile>]>,
    files: &'a [File],
    options: ReadOptions,
    bounce: Vec<u8>,
}

impl<'a> Worker<'a> {
    fn new(
        paths: &'a [&'a Path],
        maps: Option<&'a [std::sync::Arc<MappedFile>]>,
        files: &'a [File],
        options: ReadOptions,
    ) -> Self {
        Worker { paths, maps, files, options, bounce: Vec::new() }
    }

    fn io(&self, file: usize, source: std::io::Error) -> SourceError {
        SourceError::Io { file: self.paths[file].to_owned(), source }
    }

    fn file(&self, index: usize) -> Result<&'a File, SourceError> {
        self.files.get(index).ok_or_else(|| {
            SourceError::Unsupported(format!(
                "{} is not open for reads (a mapped source copies out of its mapping)",
                self.paths[index].display()
            ))
        })
    }

    fn read(&mut self, run: &Run, dst: &mut [&mut [u8]]) -> Result<(), SourceError> {
        match self.options.method {
            ReadMethod::Pread => self.read_vectored(run, dst),
            ReadMethod::Direct => self.read_direct(run, dst),
            ReadMethod::Mmap => self.copy_mapped(run, dst),
        }
    }

    /// Positioned reads of each piece in turn (the descriptor is shared: no seek).
    fn read_vectored(&mut self, run: &Run, dst: &mut [&mut [u8]]) -> Result<(), SourceError> {
        let index = run.file;
        let file = self.file(index)?;
        let result = (|| {
            let mut at = run.offset;
            for d in dst.iter_mut() {
                file.read_exact_at(d, at).map_err(|e| {
                    if e.kind() == std::io::ErrorKind::UnexpectedEof {
                        std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "file ended before the end of a tensor read",
                        )
                    } else {
                        e
                    }
                })?;
                at += d.len() as u64;
            }
            Ok(())
        })();
        result.map_err(|e| self.io(index, e))
    }

    /// Reads the aligned cover of the run into an aligned bounce buffer, then scatters.
    fn read_direct(&mut self, run: &Run, dst: &mut [&mut [u8]]) -> Result<(), SourceError> {
        let start = run.offset - run.offset % DIRECT_ALIGN as u64;
        let head = (run.offset - start) as usize;
        let cover = (head + run.len).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        if self.bounce.len() < cover + DIRECT_ALIGN {
            self.bounce = vec![0u8; cover + DIRECT_ALIGN];
        }
        let index = run.file;
        let align = self.bounce.as_ptr().align_offset(DIRECT_ALIGN);
        let mut bounce = std::mem::take(&mut self.bounce);
        let buf = &mut bounce[align..align + cover];
        let file = self.file(index)?;
        let mut got = 0usize;
        let result = loop {
            if got >= head + run.len {
                break Ok(());
            }
            match file.read_at(&mut buf[got..], start + got as u64) {
                Ok(0) => {
                    break Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "file ended before the end of a tensor read",
                    ));
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        if result.is_ok() {
            let mut at = head;
            for d in dst.iter_mut() {
                d.copy_from_slice(&buf[at..at + d.len()]);
                at += d.len();
            }
        }
        self.bounce = bounce;
        result.map_err(|e| self.io(index, e))
    }

    fn copy_mapped(&mut self, run: &Run, dst: &mut [&mut [u8]]) -> Result<(), SourceError> {
        let map = self.maps.and_then(|m| m.get(run.file)).ok_or_else(|| {
            SourceError::Unsupported("the mmap read path needs a mapped source".into())
        })?;
        let mut at = run.offset as usize;
        for d in dst.iter_mut() {
            d.copy_from_slice(&map.as_bytes()[at..at + d.len()]);
            at += d.len();
        }
        Ok(())
    }
}
