//! Tensor slices of a checkpoint and the identity of the files that hold them.

use std::path::PathBuf;

use crate::Dtype;

/// Index of a file within one checkpoint (a checkpoint may span several shards).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CheckpointFileId(pub u32);

/// What makes a file the same file: recorded when a checkpoint is opened and compared again
/// before every read batch. Any difference means the bytes may have changed under us.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileIdentity {
    /// Device number of the filesystem holding the file.
    pub device: u64,
    /// Inode number.
    pub inode: u64,
    /// Size in bytes.
    pub size: u64,
    /// Modification time in nanoseconds since the Unix epoch.
    pub mtime_ns: i128,
    /// Status-change time in nanoseconds since the Unix epoch: no user can set it, so a file
    /// rewritten in place with its modification time restored is still seen as changed.
    pub ctime_ns: i128,
}

/// One tensor's immutable place in a checkpoint: its bytes are `len` bytes at `offset` of `path`.
///
/// Invariant (checked by whoever builds it): `len == shape.product() * dtype.size_bytes()` and
/// the range lies inside the file.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorSlice {
    /// The tensor's name in the checkpoint (`transformer_blocks.0.attn.to_q.weight`).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape, outermost dimension first.
    pub shape: Vec<u64>,
    /// Which file of the checkpoint holds it.
    pub file: CheckpointFileId,
    /// Path of that file, as opened.
    pub path: PathBuf,
    /// Absolute byte offset of the first element in the file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl TensorSlice {
    /// Number of elements the shape describes, or `None` on overflow.
    pub fn element_count(&self) -> Option<u64> {
        self.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }

    /// Whether `len` equals elements x element size.
    pub fn is_consistent(&self) -> bool {
        self.element_count()
            .and_then(|n| n.checked_mul(self.dtype.size_bytes()))
            .is_some_and(|bytes| bytes == self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consistency_is_shape_times_dtype() {
        let mut s = TensorSlice {
            name: "w".into(),
            dtype: Dtype::BF16,
            shape: vec![3, 4],
            file: CheckpointFileId(0),
            path: "m.safetensors".into(),
            offset: 8,
            len: 24,
        };
        assert!(s.is_consistent());
        s.len = 23;
        assert!(!s.is_consistent());
        s.shape = vec![u64::MAX, 2];
        assert!(!s.is_consistent());
    }
}
