//! [`CheckpointSource`]: a checkpoint as a [`WeightSource`].

use std::path::Path;
use std::sync::Arc;

use ddo_core::{
    CheckpointFileId, HostRegion, HostSlice, ReadRequest, SourceError, TensorSlice, WeightSource,
};

use crate::Checkpoint;
use crate::mapping::MappedFile;
use crate::plan::{carve, plan};
use crate::read::{ReadMethod, ReadOptions, execute};

/// Whether checkpoint files may be memory-mapped: a promise made once, by whoever owns the
/// files, and carried to the code that maps them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MmapChoice {
    allowed: bool,
}

impl MmapChoice {
    /// Mapping allowed.
    ///
    /// # Safety
    ///
    /// The checkpoint's files must not be modified or truncated while any source built with
    /// this choice (or any slice of its mappings) lives; see [`MappedFile::map`].
    pub unsafe fn auto() -> MmapChoice {
        MmapChoice { allowed: true }
    }

    /// Never map: read the files instead (the safe default).
    pub fn never() -> MmapChoice {
        MmapChoice { allowed: false }
    }

    /// Whether mapping is allowed.
    pub fn is_allowed(self) -> bool {
        self.allowed
    }
}

/// A checkpoint whose bytes are read through one of the read paths.
///
/// Every read batch first checks that no file changed since the checkpoint was opened; a changed
/// file fails the batch with [`SourceError::CheckpointChanged`].
#[derive(Debug, Clone)]
pub struct CheckpointSource {
    checkpoint: Arc<Checkpoint>,
    maps: Option<Vec<Arc<MappedFile>>>,
    /// Every file, open for positioned reads for the source's life (none when mapped): reads
    /// never open files, and read the files whose identity was checked at open.
    files: Arc<[std::fs::File]>,
    options: ReadOptions,
}

impl CheckpointSource {
    /// A source reading with `options` (pread or O_DIRECT; the safe default). Asking for
    /// [`ReadMethod::Mmap`] here is an error: mapping is [`CheckpointSource::with_mmap`]'s
    /// promise to make.
    pub fn new(checkpoint: Arc<Checkpoint>, options: ReadOptions) -> Result<Self, SourceError> {
        if options.method == ReadMethod::Mmap {
            return Err(SourceError::Unsupported(
                "the mmap read path needs CheckpointSource::with_mmap".into(),
            ));
        }
        let mut files = Vec::with_capacity(checkpoint.files().len());
        for f in checkpoint.files() {
            let file = crate::read::open_for_reads(&f.path, options.method)?;
            let same = file.metadata().is_ok_and(|m| {
                use std::os::unix::fs::MetadataExt;
                m.dev() == f.identity.device && m.ino() == f.identity.inode
            });
            if !same {
                return Err(SourceError::CheckpointChanged {
                    file: f.path.clone(),
                    what: "the file was replaced".into(),
                });
            }
            files.push(file);
        }
        checkpoint.check_unchanged()?;
        Ok(CheckpointSource { checkpoint, maps: None, files: files.into(), options })
    }

    /// A source that maps every file: [`WeightSource::host_bytes`] returns slices of the mappings
    /// (zero copy) and reads copy out of them.
    ///
    /// # Safety
    ///
    /// The checkpoint's files must not be modified or truncated while the source or any slice of
    /// its mappings lives (see [`MappedFile::map`]).
    pub unsafe fn with_mmap(
        checkpoint: Arc<Checkpoint>,
        workers: usize,
    ) -> Result<Self, SourceError> {
        checkpoint.check_unchanged()?;
        // Mapped from the descriptors the checkpoint was read from: the files its identities
        // describe, whatever the paths name by now (a link repointed since).
        let maps = checkpoint
            .files()
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let file = checkpoint.opened(i).expect("one descriptor per file");
                // SAFETY: forwarded from this function's contract.
                unsafe { MappedFile::shared_open(file, &f.path) }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let options = ReadOptions { method: ReadMethod::Mmap, workers, ..ReadOptions::default() };
        Ok(CheckpointSource { checkpoint, maps: Some(maps), files: Arc::from([]), options })
    }

    /// A mapped source ([`CheckpointSource::with_mmap`]) when `choice` allows mapping, `None`
    /// otherwise (the caller reads instead).
    pub fn mapped(
        checkpoint: Arc<Checkpoint>,
        workers: usize,
        choice: MmapChoice,
    ) -> Result<Option<Self>, SourceError> {
        if !choice.allowed {
            return Ok(None);
        }
        // SAFETY: `choice` carries the caller's promise, made through `MmapChoice::auto`.
        unsafe { Self::with_mmap(checkpoint, workers) }.map(Some)
    }

    /// The checkpoint.
    pub fn checkpoint(&self) -> &Arc<Checkpoint> {
        &self.checkpoint
    }

    /// The read options.
    pub fn options(&self) -> ReadOptions {
        self.options
    }

    /// A mapping read past its file's end (the file shrank under it) is an error.
    fn check_mappings(&self) -> Result<(), SourceError> {
        for (i, m) in self.maps.iter().flatten().enumerate() {
            if m.faulted() {
                return Err(SourceError::CheckpointChanged {
                    file: self.checkpoint.files()[i].path.clone(),
                    what: "it shrank while mapped (a read went past its end)".into(),
                });
            }
        }
        Ok(())
    }

    /// The mapping of file `index`, for sources built with [`CheckpointSource::with_mmap`].
    pub fn mapping(&self, index: usize) -> Option<&Arc<MappedFile>> {
        self.maps.as_ref()?.get(index)
    }
}

impl WeightSource for CheckpointSource {
    fn slices(&self) -> &[TensorSlice] {
        self.checkpoint.slices()
    }

    fn check_unchanged(&self) -> Result<(), SourceError> {
        self.checkpoint.check_unchanged()?;
        self.check_mappings()
    }

    fn check_in_use(&self) -> Result<(), SourceError> {
        self.checkpoint.check_open()?;
        self.check_mappings()
    }

    fn read(&self, slice: usize, dst: &mut [u8]) -> Result<(), SourceError> {
        let s = self
            .slices()
            .get(slice)
            .ok_or(SourceError::NoSuchTensor { index: slice, count: self.slices().len() })?;
        if s.len != dst.len() as u64 {
            return Err(SourceError::LengthMismatch {
                tensor: s.name.clone(),
                expected: s.len,
                got: dst.len() as u64,
            });
        }
        self.read_batch(&[ReadRequest { slice, dst_offset: 0 }], dst)
    }

    fn host_bytes(&self, slice: usize) -> Option<HostSlice> {
        let s = self.slices().get(slice)?;
        self.host_range(s.file, s.offset, s.len)
    }

    fn host_range(&self, file: CheckpointFileId, offset: u64, len: u64) -> Option<HostSlice> {
        let map = self.maps.as_ref()?.get(file.0 as usize)?.clone();
        let region: Arc<dyn HostRegion> = map;
        HostSlice::new(region, usize::try_from(offset).ok()?, usize::try_from(len).ok()?)
    }

    fn read_batch(&self, requests: &[ReadRequest], dst: &mut [u8]) -> Result<(), SourceError> {
        self.check_in_use()?;
        let runs = plan(self.slices(), requests, dst.len(), self.options.chunk_bytes)?;
        let dsts = carve(&runs, dst);
        let paths: Vec<&Path> = self.checkpoint.files().iter().map(|f| f.path.as_path()).collect();
        execute(&paths, self.maps.as_deref(), &self.files, self.options, runs, dsts)?;
        // A file that changed during the reads (a mapping read past a truncated end) is noticed
        // before the bytes are used.
        self.check_in_use()
    }
}
