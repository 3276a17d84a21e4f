//! A weight source over tensors already in host memory: a module's own parameters, served in
//! place. Each storage (one allocation that may hold several tensors) is one "file" of the
//! source, so tensors adjacent in a storage upload in one copy; groups of small tensors are
//! packed into one retained buffer so they upload in one copy too, instead of many latency-bound
//! ones.

use ddo_core::{
    CheckpointFileId, Dtype, HostSlice, ReadRequest, SourceError, TensorSlice, WeightSource,
};

use crate::RetainedStore;

/// One tensor in host memory: `len` bytes at `offset` of storage `storage`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostTensor {
    /// Its name (`transformer_blocks.0.attn.to_q.weight`).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape, outermost first.
    pub shape: Vec<u64>,
    /// Index of the storage holding it.
    pub storage: usize,
    /// Byte offset of its first element in the storage.
    pub offset: u64,
}

/// What packing did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PackReport {
    /// Tensors copied into packs.
    pub tensors: u64,
    /// Bytes copied into packs (alignment excluded).
    pub bytes: u64,
    /// Packs created.
    pub packs: u64,
}

/// Alignment of tensors inside a pack.
const PACK_ALIGN: u64 = 256;

/// Serves host tensors in place; see the module documentation.
///
/// Contract: the bytes of every storage stay valid and unchanged for as long as the source (and
/// every [`HostSlice`] it hands out) lives; the [`ddo_core::HostRegion`] behind each storage
/// owns or pins that memory.
pub struct HostTensorSource {
    slices: Vec<TensorSlice>,
    /// Files some storages are mapped from, with their identity at open.
    files_checked: Vec<(std::path::PathBuf, ddo_core::FileIdentity)>,
    /// Host bytes per file id: the storages first, then the packs.
    files: Vec<HostSlice>,
    storages: usize,
    packed: PackReport,
}

impl std::fmt::Debug for HostTensorSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTensorSource")
            .field("tensors", &self.slices.len())
            .field("storages", &self.storages)
            .field("packed", &self.packed)
            .finish_non_exhaustive()
    }
}

impl HostTensorSource {
    /// A source over `tensors` held in `storages`. Every tensor must lie inside its storage and
    /// its length must equal its shape times its element size.
    pub fn new(
        storages: Vec<HostSlice>,
        tensors: Vec<HostTensor>,
    ) -> Result<HostTensorSource, SourceError> {
        let mut slices = Vec::with_capacity(tensors.len());
        for t in tensors {
            let invalid = |reason: String| {
                SourceError::InvalidBatch(format!("host tensor {:?}: {reason}", t.name))
            };
            let storage = storages.get(t.storage).ok_or_else(|| {
                invalid(format!("storage {} of {} does not exist", t.storage, storages.len()))
            })?;
            let len = t
                .shape
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .and_then(|n| n.checked_mul(t.dtype.size_bytes()))
                .ok_or_else(|| invalid(format!("shape {:?} overflows", t.shape)))?;
            let end = t.offset.checked_add(len);
            if end.is_none_or(|end| end > storage.len() as u64) {
                return Err(invalid(format!(
                    "{len} bytes at offset {} leave its storage of {} bytes",
                    t.offset,
                    storage.len()
                )));
            }
            slices.push(TensorSlice {
                path: format!("<host storage {}>", t.storage).into(),
                name: t.name,
                dtype: t.dtype,
                shape: t.shape,
                file: CheckpointFileId(t.storage as u32),
                offset: t.offset,
                len,
            });
        }
        let count = storages.len();
        Ok(HostTensorSource {
            slices,
            files_checked: Vec::new(),
            files: storages,
            storages: count,
            packed: PackReport::default(),
        })
    }

    /// Copies each group of tensors (indices into [`WeightSource::slices`]) into one retained
    /// buffer of `store`, tensors 256-byte aligned, so the group uploads in one copy; the
    /// tensors are served from there afterwards. Groups of fewer than two tensors stay in place.
    /// Refused, with nothing changed, when `store` or the host refuses the bytes.
    pub fn pack(
        &mut self,
        groups: &[Vec<usize>],
        store: &RetainedStore,
    ) -> Result<(), SourceError> {
        let mut placed: Vec<(usize, CheckpointFileId, u64)> = Vec::new();
        let mut files = Vec::new();
        let mut report = PackReport::default();
        for group in groups.iter().filter(|g| g.len() >= 2) {
            let mut requests = Vec::with_capacity(group.len());
            let mut cursor = 0u64;
            for &slice in group {
                let s = self
                    .slices
                    .get(slice)
                    .ok_or(SourceError::NoSuchTensor { index: slice, count: self.slices.len() })?;
                let at = cursor.div_ceil(PACK_ALIGN) * PACK_ALIGN;
                requests.push(ReadRequest { slice, dst_offset: at });
                cursor = at + s.len;
                report.tensors += 1;
                report.bytes += s.len;
            }
            let buffer = store.retain(&*self, &requests, cursor)?;
            let file = CheckpointFileId((self.files.len() + files.len()) as u32);
            files.push(HostSlice::whole(buffer));
            placed.extend(requests.iter().map(|r| (r.slice, file, r.dst_offset)));
            report.packs += 1;
        }
        for (slice, file, offset) in placed {
            let s = &mut self.slices[slice];
            s.file = file;
            s.offset = offset;
            s.path = format!("<host pack {}>", file.0 - self.storages as u32).into();
        }
        self.files.extend(files);
        self.packed = report;
        Ok(())
    }

    /// Records that storages are mappings of the file at `path`: every upload first checks the
    /// file's identity (a changed file is an error, never other bytes).
    pub fn watch_file(&mut self, path: &std::path::Path) -> Result<(), SourceError> {
        let identity = crate::file_identity(path)
            .map_err(|source| SourceError::Io { file: path.to_owned(), source })?;
        self.files_checked.push((path.to_owned(), identity));
        Ok(())
    }

    /// What [`pack`](Self::pack) copied.
    pub fn packed(&self) -> PackReport {
        self.packed
    }

    /// The packs [`pack`](Self::pack) made (their own page-aligned buffers): a host registers
    /// them too, since copies from unregistered memory stall the host thread.
    pub fn packs(&self) -> Vec<HostSlice> {
        self.files[self.storages..].to_vec()
    }

    /// The storages (in place) that still serve at least one tensor: what a host registers for
    /// fast copies (packs are listed by [`packs`](Self::packs)).
    pub fn storages_in_use(&self) -> Vec<(usize, HostSlice)> {
        let mut used = vec![false; self.storages];
        for s in &self.slices {
            if let Some(u) = used.get_mut(s.file.0 as usize) {
                *u = true;
            }
        }
        used.iter()
            .enumerate()
            .filter(|(_, u)| **u)
            .map(|(i, _)| (i, self.files[i].clone()))
            .collect()
    }

    /// Bytes of all tensors.
    pub fn total_bytes(&self) -> u64 {
        self.slices.iter().map(|s| s.len).sum()
    }

    fn bytes_of(&self, file: CheckpointFileId, offset: u64, len: u64) -> Option<HostSlice> {
        let f = self.files.get(file.0 as usize)?;
        f.slice(usize::try_from(offset).ok()?, usize::try_from(len).ok()?)
    }
}

impl WeightSource for HostTensorSource {
    fn slices(&self) -> &[TensorSlice] {
        &self.slices
    }

    fn check_unchanged(&self) -> Result<(), SourceError> {
        for (path, identity) in &self.files_checked {
            let now = crate::file_identity(path)
                .map_err(|source| SourceError::Io { file: path.clone(), source })?;
            if now != *identity {
                return Err(SourceError::CheckpointChanged {
                    file: path.clone(),
                    what: "its identity (device, inode, size, modification or status-change time)"
                        .into(),
                });
            }
        }
        Ok(())
    }

    fn read(&self, slice: usize, dst: &mut [u8]) -> Result<(), SourceError> {
        let bytes = self
            .host_bytes(slice)
            .ok_or(SourceError::NoSuchTensor { index: slice, count: self.slices.len() })?;
        crate::copy_host_bytes(&self.slices[slice].name, &bytes, dst)
    }

    fn host_bytes(&self, slice: usize) -> Option<HostSlice> {
        let s = self.slices.get(slice)?;
        self.bytes_of(s.file, s.offset, s.len)
    }

    fn host_range(&self, file: CheckpointFileId, offset: u64, len: u64) -> Option<HostSlice> {
        self.bytes_of(file, offset, len)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ddo_core::{Admission, AdmissionProbe, GrowthRequest, HostMemoryObservation, HostSlice};

    use super::*;

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

    fn tensor(name: &str, storage: usize, offset: u64, elements: u64) -> HostTensor {
        HostTensor { name: name.into(), dtype: Dtype::U8, shape: vec![elements], storage, offset }
    }

    fn storage(bytes: Vec<u8>) -> HostSlice {
        HostSlice::whole(Arc::new(ddo_core::HostBytes::from(bytes)))
    }

    #[test]
    fn tensors_are_served_in_place_and_adjacent_ones_share_a_range() {
        let a = storage((0..64).collect());
        let source = HostTensorSource::new(
            vec![a.clone()],
            vec![tensor("x", 0, 0, 16), tensor("y", 0, 16, 48)],
        )
        .unwrap();
        let y = source.host_bytes(1).unwrap();
        assert_eq!(y.as_bytes(), &(16..64).collect::<Vec<u8>>()[..]);
        assert_eq!(y.as_bytes().as_ptr(), a.as_bytes()[16..].as_ptr(), "served in place");
        let both = source.host_range(CheckpointFileId(0), 0, 64).unwrap();
        assert_eq!(both.len(), 64);
        assert!(source.host_range(CheckpointFileId(0), 8, 64).is_none());
        assert_eq!(source.storages_in_use().len(), 1);
    }

    #[test]
    fn tensors_outside_their_storage_are_refused() {
        let err = HostTensorSource::new(vec![storage(vec![0; 8])], vec![tensor("x", 0, 4, 8)])
            .unwrap_err();
        assert!(err.to_string().contains("leave its storage of 8 bytes"), "{err}");
        let err = HostTensorSource::new(vec![storage(vec![0; 8])], vec![tensor("x", 1, 0, 1)])
            .unwrap_err();
        assert!(err.to_string().contains("storage 1 of 1"), "{err}");
    }

    #[test]
    fn packing_copies_a_group_into_one_aligned_buffer() {
        let a = storage(vec![1; 10]);
        let b = storage(vec![2; 20]);
        let c = storage(vec![3; 30]);
        let mut source = HostTensorSource::new(
            vec![a, b, c],
            vec![tensor("a", 0, 0, 10), tensor("b", 1, 0, 20), tensor("c", 2, 0, 30)],
        )
        .unwrap();
        let store = RetainedStore::new(1 << 20, Arc::new(Generous));
        source.pack(&[vec![0, 1], vec![2]], &store).unwrap();
        assert_eq!(source.packed(), PackReport { tensors: 2, bytes: 30, packs: 1 });
        let (sa, sb) = (&source.slices()[0], &source.slices()[1]);
        assert_eq!(sa.file, sb.file);
        assert_eq!((sa.offset, sb.offset), (0, 256));
        assert_eq!(source.host_bytes(1).unwrap().as_bytes(), &[2; 20]);
        assert_eq!(source.host_bytes(2).unwrap().as_bytes(), &[3; 30]);
        // Only storage 2 still serves a tensor in place.
        let in_use: Vec<usize> = source.storages_in_use().iter().map(|(i, _)| *i).collect();
        assert_eq!(in_use, vec![2]);
        assert_eq!(source.packs().len(), 1);
        assert_eq!(source.packs()[0].len(), 256 + 20);
        assert_eq!(store.used(), 256 + 20);
    }

    #[test]
    fn a_refused_pack_changes_nothing() {
        let mut source = HostTensorSource::new(
            vec![storage(vec![1; 10]), storage(vec![2; 10])],
            vec![tensor("a", 0, 0, 10), tensor("b", 1, 0, 10)],
        )
        .unwrap();
        let store = RetainedStore::new(64, Arc::new(Generous));
        assert!(source.pack(&[vec![0, 1]], &store).is_err());
        assert_eq!(source.packed(), PackReport::default());
        assert_eq!(source.slices()[1].file, CheckpointFileId(1));
        assert_eq!(source.host_bytes(1).unwrap().as_bytes(), &[2; 10]);
    }
}
