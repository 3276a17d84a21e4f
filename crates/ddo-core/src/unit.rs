//! Execution units (the blocks a model runs one after another) and the slots that hold them.

/// Index of an execution unit within one component's arena, in execution order of the first pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UnitId(pub u32);

/// Index of an execution slot: a device range through which streamed units take turns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotId(pub u32);

/// One tensor of a unit, placed at an aligned offset of the unit's packed device layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitTensor {
    /// Index of the tensor's [`crate::TensorSlice`] in the weight source.
    pub slice: usize,
    /// Byte offset inside the unit's packed range (aligned).
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A group of tensors uploaded and released together: one repeated block of a model (or one
/// leftover group). Its tensors are packed into one contiguous device range of `packed_len` bytes
/// so that it uploads in a few large copies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutionUnit {
    /// The unit's id.
    pub id: UnitId,
    /// A readable name (`transformer_blocks.7`).
    pub name: String,
    /// Its tensors in packed order.
    pub tensors: Vec<UnitTensor>,
    /// Bytes of the packed range, alignment included.
    pub packed_len: u64,
}

impl ExecutionUnit {
    /// Payload bytes (alignment excluded).
    pub fn payload_len(&self) -> u64 {
        self.tensors.iter().map(|t| t.len).sum()
    }
}
