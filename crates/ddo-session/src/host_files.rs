//! Host tensors that live in a private mapping of a file (a checkpoint a framework loaded
//! lazily) are served from a shared read-only mapping of the same file instead, when no page
//! of theirs was written: the bytes are the same, and a shared file mapping page-locks at full
//! speed, where page-locking the private one would make the kernel copy every page.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

use ddo_core::{HostRegion, HostSlice};
use ddo_platform::linux::maps;
use ddo_source::{HostTensor, MappedFile, MmapChoice};

use crate::SessionError;

/// Storages and tensors after redirection.
pub(crate) struct Redirected {
    pub(crate) storages: Vec<HostSlice>,
    pub(crate) tensors: Vec<HostTensor>,
    /// Files now mapped (their identity is checked before uploads).
    pub(crate) paths: Vec<PathBuf>,
    /// Storages left in a private file mapping (written pages, or mapping not allowed).
    pub(crate) private_in_place: HashSet<usize>,
}

/// A shared mapping of `path` if it is the file the private mapping maps (same device and
/// inode, checked on the open file); `None` when it is not, cannot be opened, or mapping is not
/// allowed: the storage is then served in place.
fn map_same_file(
    path: &std::path::Path,
    file: Option<(u64, u64)>,
    mmap: MmapChoice,
) -> Option<MappedFile> {
    use std::os::unix::fs::MetadataExt;
    let map = MappedFile::map_with(path, mmap).ok()??;
    let meta = std::fs::metadata(path).ok()?;
    (Some((meta.dev(), meta.ino())) == file).then_some(map)
}

fn address(s: &HostSlice) -> u64 {
    s.as_bytes().as_ptr() as u64
}

/// Redirects every storage inside an unwritten private file mapping to a shared mapping of the
/// file (one per file, appended after the storages); tensors follow their storage.
pub(crate) fn redirect(
    storages: &[HostSlice],
    tensors: &[HostTensor],
    mmap: MmapChoice,
) -> Result<Redirected, SessionError> {
    let mut out = Redirected {
        storages: storages.to_vec(),
        tensors: tensors.to_vec(),
        paths: Vec::new(),
        private_in_place: HashSet::new(),
    };
    let Ok(process) = maps::process_maps() else { return Ok(out) };
    // Storage -> (file index, offset of the storage in the file).
    let mut moved: HashMap<usize, (usize, u64)> = HashMap::new();
    let mut files: HashMap<PathBuf, usize> = HashMap::new();
    for (i, s) in storages.iter().enumerate() {
        let (start, len) = (address(s), s.len() as u64);
        let Some(m) = maps::private_file_mapping(&process, start, len) else {
            // Partly in a private file mapping (a split mapping): never page-lock it.
            if maps::touches_private_file_mapping(&process, start, len) {
                out.private_in_place.insert(i);
            }
            continue;
        };
        let path = m.path.clone().expect("file mapping");
        let at = m.file_offset + (start - m.start);
        if !mmap.is_allowed() || !maps::private_pages_unwritten(start, len) {
            out.private_in_place.insert(i);
            continue;
        }
        let file = match files.get(&path) {
            Some(&f) => f,
            None => match map_same_file(&path, m.file, mmap) {
                Some(map) => {
                    let f = out.storages.len();
                    out.storages.push(HostSlice::whole(Arc::new(map) as Arc<dyn HostRegion>));
                    out.paths.push(path.clone());
                    files.insert(path, f);
                    f
                }
                None => {
                    out.private_in_place.insert(i);
                    continue;
                }
            },
        };
        if at + len > out.storages[file].len() as u64 {
            // The file is shorter than the mapping says: leave the storage where it is.
            out.private_in_place.insert(i);
            continue;
        }
        moved.insert(i, (file, at));
    }
    for t in &mut out.tensors {
        if let Some(&(file, at)) = moved.get(&t.storage) {
            t.storage = file;
            t.offset += at;
        }
    }
    Ok(out)
}
