//! An encoded file mapped by an [`EncodedSource`](crate::EncodedSource): the open file is kept,
//! so a change in place (a write or a truncation, not a replacement by rename) is noticed.
//!
//! Its own module so that the source that holds one and the encoded files that make one do not
//! import each other.

use std::fs::{File, Metadata};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Arc;

use ddo_core::SourceError;

use crate::mapping::MappedFile;

/// An encoded file's mapping, with the open file and the status it had when mapped.
pub(crate) struct MappedEncodings {
    file: File,
    path: PathBuf,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    map: Arc<MappedFile>,
}

impl MappedEncodings {
    /// The mapping `map` of the open `file` at `path`, whose status was `meta` when mapped.
    pub(crate) fn new(
        file: File,
        path: PathBuf,
        meta: &Metadata,
        map: Arc<MappedFile>,
    ) -> MappedEncodings {
        MappedEncodings {
            file,
            path,
            size: meta.len(),
            mtime_ns: mtime_ns(meta),
            ctime_ns: ctime_ns(meta),
            map,
        }
    }

    /// Refuses when the open file's size or times changed, or its mapping read past its end.
    pub(crate) fn check_unchanged(&self) -> Result<(), SourceError> {
        let changed =
            |what: String| SourceError::CheckpointChanged { file: self.path.clone(), what };
        let m = self.file.metadata().map_err(|e| changed(format!("it cannot be read: {e}")))?;
        if m.len() != self.size || mtime_ns(&m) != self.mtime_ns || ctime_ns(&m) != self.ctime_ns {
            return Err(changed("the encoded file was written while mapped".into()));
        }
        if self.map.faulted() {
            return Err(changed("the encoded file shrank while mapped".into()));
        }
        Ok(())
    }
}

/// A file's modification time in nanoseconds.
pub(crate) fn mtime_ns(m: &Metadata) -> i128 {
    i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec())
}

/// A file's status-change time in nanoseconds.
pub(crate) fn ctime_ns(m: &Metadata) -> i128 {
    i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec())
}
