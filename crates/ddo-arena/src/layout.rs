//! Layout: each unit's tensors packed into one contiguous device range, so a unit uploads in a
//! few large copies. Tensors adjacent in the checkpoint stay adjacent (one copy covers them, and
//! the bytes of a small gap between them, up to [`MAX_BRIDGED_GAP`]); every tensor starts at
//! least 16-byte aligned, and extents start congruent to their file offset modulo 256 so
//! file-aligned tensors stay 256-byte aligned on the device. A tensor of
//! [`ALIGNED_TENSOR_BYTES`] or more (a layer's weight matrix) always starts 256-byte aligned, as
//! PyTorch's own allocations are: a copy of its own if the checkpoint does not place it so.

use std::collections::HashMap;

use ddo_core::{CheckpointFileId, Dtype, FileRange, TensorSlice, UnitId};

use crate::ArenaError;

/// Device alignment every tensor keeps.
pub const MIN_TENSOR_ALIGN: u64 = 16;
/// Alignment extents are placed at (modulo their file offset).
pub const EXTENT_ALIGN: u64 = 256;
/// Tensors of this many bytes or more start [`EXTENT_ALIGN`]-aligned on the device whatever their
/// file offset. Matrix kernels pick slower variants for operands aligned to less (measured on
/// an H100: an SD3-shaped step took 1.037x as long with its weights at 16- and 32-byte
/// alignment as at PyTorch's own), and such a tensor is large enough that a copy of its own
/// runs near link speed.
pub const ALIGNED_TENSOR_BYTES: u64 = 64 << 10;
/// The largest run of bytes between two of a unit's tensors in one file that a copy carries
/// along rather than splitting in two (tensors stored between them: a quantized checkpoint's
/// biases converted elsewhere, another unit's tensor). A copy's fixed cost on the link is worth
/// a few hundred KiB, so bridging such a gap is never slower, and it halves the copies of a
/// unit whose weights alternate with tensors served from elsewhere.
pub const MAX_BRIDGED_GAP: u64 = 128 << 10;
/// The stored bytes of a unit's tensors converted or decoded on the device go through the
/// staging buffers in rounds of at most this much (or of its largest such tensor): each
/// round's kernels run while the next round's bytes cross the link, and the two buffers take a
/// round each, not a whole unit each, from the weight budget.
pub const STAGING_ROUND: u64 = 64 << 20;

/// What the caller asks for: the tensors of one unit, in any order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitSpec {
    /// A readable name (`transformer_blocks.3`).
    pub name: String,
    /// Indices into the source's slices.
    pub tensors: Vec<usize>,
    /// Keep resident whatever the budget (small leftovers).
    pub pinned: bool,
}

impl UnitSpec {
    /// The units of a checkpoint by the unit rule ([`crate::ModuleTree::assign`]) applied to the
    /// tree its tensor names imply: one unit per block of the outermost repeated lists, in
    /// order, after one pinned unit of everything else.
    pub fn by_block(slices: &[TensorSlice]) -> Vec<UnitSpec> {
        crate::ModuleTree::from_tensor_names(slices.iter().map(|s| s.name.as_str()))
            .assign(&crate::UnitRule::default())
            .unit_specs(slices)
    }
}

/// Where one tensor lives inside its unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorPlacement {
    /// Index in the source's slices.
    pub slice: usize,
    /// Offset inside the unit's range.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// One copy: `len` contiguous checkpoint bytes landing at `offset` of the unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// File.
    pub file: CheckpointFileId,
    /// Absolute offset in the file.
    pub file_offset: u64,
    /// Bytes.
    pub len: u64,
    /// Offset inside the unit's range, or inside the arena's staging buffer when `staged`.
    pub offset: u64,
    /// Lands in the staging buffer (stored bytes of tensors converted on the device).
    pub staged: bool,
    /// The staging round it belongs to (0 when not staged).
    pub round: u32,
}

/// What a kernel makes of a tensor's staged bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceWork {
    /// Converts the stored `from` elements into `to` elements ([`ddo_core::Transforms::convert`]).
    Convert {
        /// The stored dtype.
        from: Dtype,
        /// The dtype the tensor is served in.
        to: Dtype,
    },
    /// Decodes the source's entropy-coded form of a bf16 or fp16 tensor into its elements
    /// ([`ddo_core::Transforms::decode`]).
    Decode,
}

/// A tensor converted or decoded on the device after upload: its stored bytes land at
/// `staging` of one of the arena's two staging buffers (by staged extents, in the unit's staging
/// `round`) and a kernel writes the tensor's elements where its [`TensorPlacement`] says. Two
/// buffers serve every round: copies fill one while the kernels of the round before read the
/// other, on their own stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceConversion {
    /// Index in the source's slices.
    pub slice: usize,
    /// Offset of the stored bytes inside the staging buffer.
    pub staging: u64,
    /// Stored bytes (the encoding's, for a decoded tensor).
    pub staged_len: u64,
    /// What the kernel does.
    pub work: DeviceWork,
    /// Bytes the kernel writes (the tensor as served).
    pub served_len: u64,
    /// The unit's staging round that carries its stored bytes.
    pub round: u32,
}

/// One unit's layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitLayout {
    /// Id (its index).
    pub id: UnitId,
    /// Name.
    pub name: String,
    /// Offset of its range inside the arena's reservation (granularity-aligned).
    pub offset: u64,
    /// Mapped length (a multiple of the granularity).
    pub len: u64,
    /// Payload bytes.
    pub payload: u64,
    /// Tensors.
    pub tensors: Vec<TensorPlacement>,
    /// Copies that upload it.
    pub extents: Vec<Extent>,
    /// Tensors converted on the device after the copies.
    pub conversions: Vec<DeviceConversion>,
    /// Bytes of the staging buffer its largest round of stored bytes takes.
    pub staging_len: u64,
    /// Always resident.
    pub pinned: bool,
}

impl UnitLayout {
    /// Bytes its copies carry over the link (stored bytes, before any device conversion).
    pub fn link_bytes(&self) -> u64 {
        self.extents.iter().map(|e| e.len).sum()
    }

    /// Tensors decoded on the device, their encoded bytes and their decoded bytes.
    pub fn decoded(&self) -> (u64, u64, u64) {
        self.conversions
            .iter()
            .filter(|c| c.work == DeviceWork::Decode)
            .fold((0, 0, 0), |(n, enc, dec), c| (n + 1, enc + c.staged_len, dec + c.served_len))
    }

    /// Where each tensor's stored bytes land: `(slice, staged round, offset, len)`, in the
    /// staging buffer of that round for a tensor converted on the device, else in the unit.
    pub fn stored(&self) -> impl Iterator<Item = (usize, Option<u32>, u64, u64)> + '_ {
        self.tensors.iter().map(|t| match self.conversions.iter().find(|c| c.slice == t.slice) {
            Some(c) => (t.slice, Some(c.round), c.staging, c.staged_len),
            None => (t.slice, None, t.offset, t.len),
        })
    }

    /// Staging rounds its upload takes (0 without device conversions).
    pub fn rounds(&self) -> u32 {
        self.conversions.iter().map(|c| c.round + 1).max().unwrap_or(0)
    }
}

/// The arena's layout: every unit at a fixed offset of one reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Units in id order.
    pub units: Vec<UnitLayout>,
    /// Bytes of the reservation.
    pub reserved: u64,
    /// Mapping granularity used.
    pub granularity: u64,
    /// Bytes mapped for the two staging buffers (a multiple of the granularity; 0 without device
    /// conversions), at `staging_offset` for the arena's life.
    pub staging_len: u64,
    /// Bytes of one staging buffer (the second starts this far after the first).
    pub staging_buffer: u64,
    /// Offset of the staging buffer inside the reservation (after every unit).
    pub staging_offset: u64,
}

/// The largest layout the arena plans (4 EiB): every sum of sizes below it fits in `u64` with
/// room for the planner's products.
pub const MAX_LAYOUT: u64 = 1 << 62;

fn too_large(unit: &str) -> ArenaError {
    ArenaError::InvalidUnits(format!(
        "unit {unit:?}: the tensors' sizes exceed what an arena can lay out ({} bytes)",
        MAX_LAYOUT
    ))
}

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

impl Layout {
    /// The smallest budget an arena of this layout plans under: its pinned units, two slots
    /// of its largest other unit and the staging buffers (everything, when no unit streams).
    pub fn budget_floor(&self) -> u64 {
        let pinned: u64 = self.units.iter().filter(|u| u.pinned).map(|u| u.len).sum();
        let largest = self.units.iter().filter(|u| !u.pinned).map(|u| u.len).max().unwrap_or(0);
        let streamed = self.units.iter().filter(|u| !u.pinned).count();
        let slots = if streamed > 2 {
            2 * largest
        } else {
            self.units.iter().filter(|u| !u.pinned).map(|u| u.len).sum()
        };
        pinned + slots + self.staging_len
    }

    /// Lays out `units` over `slices` with the device's mapping `granularity`. Every tensor must
    /// belong to at most one unit; empty units are refused.
    pub fn build(
        slices: &[TensorSlice],
        units: &[UnitSpec],
        granularity: u64,
    ) -> Result<Layout, ArenaError> {
        Self::build_staged(slices, units, granularity, &HashMap::new(), &HashMap::new())
    }

    /// As [`Layout::build`], with the tensors of `conversions` (slice -> dtype) converted on the
    /// device: each unit holds their stored bytes (staging) and, after its other tensors, their
    /// converted elements.
    pub fn build_converting(
        slices: &[TensorSlice],
        units: &[UnitSpec],
        granularity: u64,
        conversions: &HashMap<usize, Dtype>,
    ) -> Result<Layout, ArenaError> {
        Self::build_staged(slices, units, granularity, conversions, &HashMap::new())
    }

    /// As [`Layout::build_converting`], with the bf16 tensors of `encodings` (slice -> where the
    /// source holds its encoding) uploaded encoded into the staging buffer and decoded on the
    /// device. A tensor in both maps is converted (its encoding unused).
    pub fn build_staged(
        slices: &[TensorSlice],
        units: &[UnitSpec],
        granularity: u64,
        conversions: &HashMap<usize, Dtype>,
        encodings: &HashMap<usize, FileRange>,
    ) -> Result<Layout, ArenaError> {
        // The bytes each tensor uploads: its own, or its encoding's.
        let stored = |t: usize| -> (CheckpointFileId, u64, u64, Option<DeviceWork>) {
            let s = &slices[t];
            if let Some(&to) = conversions.get(&t) {
                return (s.file, s.offset, s.len, Some(DeviceWork::Convert { from: s.dtype, to }));
            }
            match encodings.get(&t) {
                Some(r) if matches!(s.dtype, Dtype::BF16 | Dtype::F16) => {
                    (r.file, r.offset, r.len, Some(DeviceWork::Decode))
                }
                _ => (s.file, s.offset, s.len, None),
            }
        };
        // A round holds STAGING_ROUND bytes, or the largest staged tensor with its alignment.
        let round_cap = units
            .iter()
            .flat_map(|u| &u.tensors)
            .filter_map(|&t| slices.get(t).map(|_| stored(t)))
            .filter(|s| s.3.is_some())
            .map(|s| s.2.saturating_add(EXTENT_ALIGN))
            .fold(STAGING_ROUND, u64::max);
        // Where the decoded tensors' own bytes lie in the checkpoint, every unit's: their
        // encodings carry them, so no copy bridges over those bytes (the link would carry the
        // tensor twice, a unit would hold them beside its decoded elements, and the host no
        // longer registers or holds them, so a copy reaching into them would read memory the
        // device cannot take as one registered range).
        let mut decoded: Vec<(CheckpointFileId, u64, u64)> = encodings
            .keys()
            .filter(|&&t| t < slices.len() && stored(t).3 == Some(DeviceWork::Decode))
            .map(|&t| (slices[t].file, slices[t].offset, slices[t].offset + slices[t].len))
            .collect();
        decoded.sort_unstable();
        let carries_decoded = |file: CheckpointFileId, start: u64, end: u64| {
            let i = decoded.partition_point(|&(f, _, b)| (f, b) <= (file, start));
            decoded.get(i).is_some_and(|&(f, a, _)| f == file && a < end)
        };
        let mut owner = vec![None::<usize>; slices.len()];
        let mut out = Vec::with_capacity(units.len());
        let mut offset = 0u64;
        let mut staging = 0u64;
        for (u, spec) in units.iter().enumerate() {
            if spec.tensors.is_empty() {
                return Err(ArenaError::InvalidUnits(format!(
                    "unit {:?} has no tensors",
                    spec.name
                )));
            }
            let mut tensors: Vec<usize> = spec.tensors.clone();
            for &t in &tensors {
                let slot = owner.get_mut(t).ok_or_else(|| {
                    ArenaError::InvalidUnits(format!(
                        "unit {:?} names tensor {t}; the source has {}",
                        spec.name,
                        slices.len()
                    ))
                })?;
                if let Some(other) = slot.replace(u) {
                    return Err(ArenaError::InvalidUnits(format!(
                        "tensor {:?} is in both unit {:?} and unit {:?}",
                        slices[t].name, units[other].name, spec.name
                    )));
                }
            }
            tensors.sort_by_key(|&t| {
                let (file, offset, _, _) = stored(t);
                (file, offset)
            });
            let mut placements = Vec::with_capacity(tensors.len());
            let mut extents: Vec<Extent> = Vec::new();
            // The unit's bytes, and the staging buffer's for tensors converted on the device.
            let (mut cursor, mut staged_cursor) = (0u64, 0u64);
            let (mut round, mut unit_staging) = (0u32, 0u64);
            let mut converted = Vec::new();
            for &t in &tensors {
                let (file, file_offset, len, work) = stored(t);
                let staged = work.is_some();
                // A staged tensor that would overfill its round starts the next one.
                if staged
                    && staged_cursor > 0
                    && align_up(staged_cursor, EXTENT_ALIGN).saturating_add(EXTENT_ALIGN + len)
                        > round_cap
                {
                    round += 1;
                    staged_cursor = 0;
                }
                let tensor_round = if staged { round } else { 0 };
                let cur = if staged { &mut staged_cursor } else { &mut cursor };
                // Sizes beyond the limit would wrap in the sums below.
                if len > MAX_LAYOUT
                    || file_offset > MAX_LAYOUT
                    || slices[t].len > MAX_LAYOUT
                    || *cur > MAX_LAYOUT
                {
                    return Err(too_large(&spec.name));
                }
                // Bytes between the last extent's end and this tensor, when one copy can span
                // them: same file and destination, a gap of at most MAX_BRIDGED_GAP holding no
                // decoded tensor's bytes, and the tensor still aligned where it lands.
                let align = if !staged && len >= ALIGNED_TENSOR_BYTES {
                    EXTENT_ALIGN
                } else {
                    MIN_TENSOR_ALIGN
                };
                let bridge = extents.last().and_then(|e| {
                    let gap = file_offset.checked_sub(e.file_offset + e.len)?;
                    (e.staged == staged
                        && e.round == tensor_round
                        && e.file == file
                        && gap <= MAX_BRIDGED_GAP
                        && (e.offset + e.len + gap).is_multiple_of(align)
                        && !carries_decoded(file, e.file_offset + e.len, file_offset))
                    .then_some(gap)
                });
                let at = if let Some(gap) = bridge {
                    let e = extents.last_mut().expect("extent");
                    let at = e.offset + e.len + gap;
                    e.len += gap + len;
                    at
                } else {
                    let start = if file_offset.is_multiple_of(MIN_TENSOR_ALIGN)
                        && align == MIN_TENSOR_ALIGN
                    {
                        let base = align_up(*cur, EXTENT_ALIGN);
                        base + file_offset % EXTENT_ALIGN
                    } else {
                        align_up(*cur, EXTENT_ALIGN)
                    };
                    extents.push(Extent {
                        file,
                        file_offset,
                        len,
                        offset: start,
                        staged,
                        round: tensor_round,
                    });
                    start
                };
                *cur = at + len;
                if staged {
                    unit_staging = unit_staging.max(staged_cursor);
                }
                match work {
                    Some(work) => {
                        let served_len = match work {
                            DeviceWork::Convert { from, to } => {
                                len / from.size_bytes().max(1) * to.size_bytes()
                            }
                            DeviceWork::Decode => slices[t].len,
                        };
                        converted.push(DeviceConversion {
                            slice: t,
                            staging: at,
                            staged_len: len,
                            work,
                            served_len,
                            round,
                        })
                    }
                    None => placements.push(TensorPlacement { slice: t, offset: at, len }),
                }
            }
            // Converted and decoded elements after the unit's own bytes.
            for c in &converted {
                let offset = align_up(cursor, EXTENT_ALIGN);
                let len = c.served_len;
                placements.push(TensorPlacement { slice: c.slice, offset, len });
                cursor = offset + len;
                if cursor > MAX_LAYOUT {
                    return Err(too_large(&spec.name));
                }
            }
            staging = staging.max(unit_staging);
            let len = align_up(cursor.max(1), granularity);
            out.push(UnitLayout {
                id: UnitId(u as u32),
                name: spec.name.clone(),
                offset,
                len,
                payload: placements.iter().map(|p| p.len).sum(),
                tensors: placements,
                extents,
                conversions: converted,
                staging_len: unit_staging,
                pinned: spec.pinned,
            });
            offset += len;
            if offset > MAX_LAYOUT {
                return Err(too_large(&spec.name));
            }
        }
        if out.is_empty() {
            return Err(ArenaError::InvalidUnits("no units".into()));
        }
        // Two buffers: one round fills while the other's conversions run.
        let staging_buffer = align_up(staging, EXTENT_ALIGN);
        let staging_len = if staging > 0 { align_up(2 * staging_buffer, granularity) } else { 0 };
        Ok(Layout {
            units: out,
            reserved: offset + staging_len,
            granularity,
            staging_len,
            staging_buffer,
            staging_offset: offset,
        })
    }

    /// Places the units in the reservation: a streamed unit's range spans a whole slot (so the
    /// slot's backing maps there without touching its neighbour), a resident one its own length.
    pub fn place(&mut self, slot_len: u64, streamed: &[bool]) {
        let mut offset = 0;
        for (u, &s) in self.units.iter_mut().zip(streamed) {
            u.offset = offset;
            // Bounded by the plan (placed sizes stay below MAX_LAYOUT); saturating regardless.
            offset = offset.saturating_add(if s { slot_len.max(u.len) } else { u.len });
        }
        self.staging_offset = offset;
        self.reserved = offset.saturating_add(self.staging_len);
    }

    /// Payload bytes of all units (their tensors as served).
    pub fn payload(&self) -> u64 {
        self.units.iter().map(|u| u.payload).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(name: &str, offset: u64, len: u64) -> TensorSlice {
        TensorSlice {
            name: name.into(),
            dtype: Dtype::U8,
            shape: vec![len],
            file: CheckpointFileId(0),
            path: "m".into(),
            offset,
            len,
        }
    }

    #[test]
    fn weight_matrices_start_256_byte_aligned_whatever_their_file_offset() {
        // A safetensors run as a checkpoint stores it: bias, weight, bias, weight, packed from
        // an offset that is a multiple of 16 but not of 256.
        let w = ALIGNED_TENSOR_BYTES;
        let slices = [
            s("b1", 96, 48),
            s("w1", 144, w),
            s("b2", 144 + w, 48),
            s("w2", 192 + w, w + 32),
            s("n", 224 + 2 * w, 32),
        ];
        let layout = Layout::build(
            &slices,
            &[UnitSpec { name: "u".into(), tensors: vec![0, 1, 2, 3, 4], pinned: false }],
            65536,
        )
        .unwrap();
        let u = &layout.units[0];
        let at = |i: usize| u.tensors.iter().find(|t| t.slice == i).unwrap().offset;
        assert!(at(1).is_multiple_of(EXTENT_ALIGN) && at(3).is_multiple_of(EXTENT_ALIGN), "{u:?}");
        // Small tensors ride along with their neighbours: one copy per weight matrix.
        assert_eq!(u.extents.len(), 3, "{:?}", u.extents);
        assert_eq!(at(2), at(1) + w, "b2 follows w1 in its copy");
        assert_eq!(at(4), at(3) + w + 32, "n follows w2 in its copy");
        for t in &u.tensors {
            assert!(t.offset.is_multiple_of(MIN_TENSOR_ALIGN), "{t:?}");
        }
    }

    #[test]
    fn adjacent_tensors_share_one_extent_and_stay_aligned() {
        // data starts at 96: offsets 96, 96+4096, then a gap, then an odd-sized tensor.
        let far = 96 + 4096 + 1000 + MAX_BRIDGED_GAP + 16;
        let slices =
            [s("a", 96, 4096), s("b", 96 + 4096, 1000), s("c", far, 33), s("d", far + 33, 64)];
        let layout = Layout::build(
            &slices,
            &[UnitSpec { name: "u".into(), tensors: vec![3, 2, 1, 0], pinned: false }],
            65536,
        )
        .unwrap();
        let u = &layout.units[0];
        assert_eq!(u.extents.len(), 3, "{:?}", u.extents);
        assert_eq!(u.extents[0].len, 5096);
        assert_eq!(u.extents[0].offset % 256, 96, "{:?}", u.extents);
        for t in &u.tensors {
            assert!(t.offset.is_multiple_of(MIN_TENSOR_ALIGN), "{t:?}");
        }
        assert_eq!(u.len, 65536);
        assert_eq!(u.payload, 4096 + 1000 + 33 + 64);
    }

    #[test]
    fn a_small_gap_between_tensors_travels_in_their_copy() {
        // A quantized file: weights alternate with biases served from elsewhere (here: another
        // unit's), 48 KiB between weights; then a gap too wide to carry, and a misaligned one.
        let w = 1 << 20;
        let bias = 48 << 10;
        let slices = [
            s("w0", 64, w),
            s("b0", 64 + w, bias),
            s("w1", 64 + w + bias, w),
            s("w2", 64 + 2 * w + bias + MAX_BRIDGED_GAP + 64, w),
            s("w3", 64 + 3 * w + bias + MAX_BRIDGED_GAP + 64 + 8, w),
        ];
        let units = [
            UnitSpec { name: "u".into(), tensors: vec![0, 2, 3, 4], pinned: false },
            UnitSpec { name: "v".into(), tensors: vec![1], pinned: false },
        ];
        let layout = Layout::build(&slices, &units, 65536).unwrap();
        let u = &layout.units[0];
        let [one, two, three] = u.extents[..] else { panic!("{:?}", u.extents) };
        assert_eq!(
            (one.file_offset, one.len),
            (64, 2 * w + bias),
            "w0, the gap and w1 in one copy"
        );
        assert_eq!((two.file_offset, two.len), (slices[3].offset, w));
        assert_eq!(three.file_offset, slices[4].offset, "8 bytes away would misalign w3");
        let at = |i: usize| u.tensors.iter().find(|t| t.slice == i).unwrap().offset;
        assert_eq!(at(2) - at(0), w + bias, "w1 lands where the copy puts it");
        for t in &u.tensors {
            assert!(t.offset.is_multiple_of(MIN_TENSOR_ALIGN), "{t:?}");
        }
        assert_eq!(u.payload, 4 * w, "the gap is carried, not served");
        assert_eq!(u.link_bytes(), 4 * w + bias, "and counted as link bytes");
    }

    #[test]
    fn no_copy_carries_the_bytes_of_a_tensor_decoded_from_its_encoding() {
        // A block's small biases around a 64 KiB weight held encoded: the biases' copies stop
        // at the weight, whose encoding alone crosses the link; another unit's tensor between
        // them is still bridged.
        let w = 64 << 10;
        let mut slices = [
            s("b0", 64, 512),
            s("w", 64 + 512, w),
            s("b1", 64 + 512 + w, 512),
            s("other", 64 + 1024 + w, 4096),
            s("b2", 64 + 1024 + w + 4096, 512),
            s("w.enc", 0, 40 << 10),
        ];
        slices[1].dtype = Dtype::BF16;
        slices[5].file = CheckpointFileId(1);
        let encodings = HashMap::from([(
            1,
            FileRange { file: CheckpointFileId(1), offset: 0, len: slices[5].len },
        )]);
        let units = [
            UnitSpec { name: "u".into(), tensors: vec![0, 1, 2, 4], pinned: false },
            UnitSpec { name: "v".into(), tensors: vec![3, 5], pinned: false },
        ];
        let layout =
            Layout::build_staged(&slices, &units, 65536, &HashMap::new(), &encodings).unwrap();
        let u = &layout.units[0];
        let [b0, rest, enc] = u.extents[..] else { panic!("{:?}", u.extents) };
        assert_eq!((b0.file_offset, b0.len, b0.staged), (64, 512, false));
        assert_eq!((rest.file_offset, rest.len), (slices[2].offset, 512 + 4096 + 512));
        assert_eq!((enc.file, enc.len, enc.staged), (CheckpointFileId(1), 40 << 10, true));
        assert_eq!(u.link_bytes(), (40 << 10) + 3 * 512 + 4096, "the weight crosses once");
        assert_eq!(u.decoded(), (1, 40 << 10, w));
    }

    #[test]
    fn a_tensor_converted_on_the_device_stages_its_stored_bytes_and_places_its_elements_after() {
        let mut slices = [s("a", 96, 4096), s("b", 96 + 4096, 1000)];
        slices[0].dtype = Dtype::BF16;
        let units = [UnitSpec { name: "u".into(), tensors: vec![0, 1], pinned: false }];
        let conversions = HashMap::from([(0, Dtype::F32)]);
        let layout = Layout::build_converting(&slices, &units, 65536, &conversions).unwrap();
        let u = &layout.units[0];
        assert_eq!(u.link_bytes(), 5096);
        let [staged, own] = u.extents[..] else { panic!("{:?}", u.extents) };
        assert!(staged.staged && !own.staged, "{:?}", u.extents);
        assert_eq!((staged.len, own.len), (4096, 1000));
        let [c] = u.conversions[..] else { panic!("{:?}", u.conversions) };
        assert_eq!(
            (c.slice, c.staged_len, c.work, c.served_len),
            (0, 4096, DeviceWork::Convert { from: Dtype::BF16, to: Dtype::F32 }, 8192)
        );
        assert_eq!(c.staging, staged.offset);
        let a = u.tensors.iter().find(|t| t.slice == 0).unwrap();
        let b = u.tensors.iter().find(|t| t.slice == 1).unwrap();
        assert_eq!(a.len, 8192, "served as F32");
        assert!(a.offset >= b.offset + b.len && a.offset.is_multiple_of(EXTENT_ALIGN), "{a:?}");
        assert_eq!(u.payload, 8192 + 1000);
        assert_eq!(u.len, 65536, "the stored bytes are not in the unit");
        assert_eq!((u.staging_len, layout.staging_buffer), (staged.offset + 4096, 4352));
        assert_eq!(
            (layout.staging_offset, layout.staging_len),
            (65536, 65536),
            "both in a granule"
        );
        assert_eq!(layout.reserved, 2 * 65536);
        let stored: Vec<_> = u.stored().collect();
        assert!(stored.contains(&(0, Some(0), c.staging, 4096)));
        assert!(stored.contains(&(1, None, b.offset, 1000)));
    }

    #[test]
    fn blocks_are_found_by_structure() {
        let slices = [
            s("proj_in.weight", 0, 8),
            s("blocks.1.w", 8, 8),
            s("blocks.0.w", 16, 8),
            s("blocks.10.w", 24, 8),
            s("blocks.0.b", 32, 8),
            s("norm_out.weight", 40, 8),
        ];
        let units = UnitSpec::by_block(&slices);
        let names: Vec<&str> = units.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["resident", "blocks.0", "blocks.1", "blocks.10"]);
        assert_eq!(units[0].tensors, vec![0, 5]);
        assert!(units[0].pinned);
        assert_eq!(units[1].tensors, vec![2, 4]);
    }

    #[test]
    fn sizes_that_would_wrap_are_refused() {
        let huge = [s("a", 0, u64::MAX - 8), s("b", 0, 3 << 60), s("c", 3 << 60, 3 << 60)];
        let one = |t: Vec<usize>| vec![UnitSpec { name: "u".into(), tensors: t, pinned: false }];
        let err = Layout::build(&huge, &one(vec![0]), 65536).unwrap_err().to_string();
        assert!(err.contains("exceed what an arena can lay out"), "{err}");
        let two = vec![
            UnitSpec { name: "u".into(), tensors: vec![1], pinned: false },
            UnitSpec { name: "v".into(), tensors: vec![2], pinned: false },
        ];
        let err = Layout::build(&huge, &two, 65536).unwrap_err().to_string();
        assert!(err.contains("exceed"), "{err}");
    }

    #[test]
    fn no_copy_reaches_into_the_bytes_of_another_units_decoded_tensor() {
        // Unit a's two tensors sit either side of unit b's small tensor, which b decodes from an
        // encoding held in file 1: a's copy must not bridge over b's bytes (the host does not
        // register them).
        let mut slices = vec![s("a.0", 0, 4096), s("b.0", 4096, 8192), s("a.1", 12288, 4096)];
        slices[1].dtype = Dtype::BF16;
        let encodings = HashMap::from([(
            1usize,
            FileRange { file: CheckpointFileId(1), offset: 0, len: 3000 },
        )]);
        let unit =
            |name: &str, t: Vec<usize>| UnitSpec { name: name.into(), tensors: t, pinned: false };
        let units = [unit("a", vec![0, 2]), unit("b", vec![1])];
        let layout =
            Layout::build_staged(&slices, &units, 4096, &HashMap::new(), &encodings).unwrap();
        let a = &layout.units[0];
        assert_eq!(a.extents.len(), 2, "{:?}", a.extents);
        for e in &a.extents {
            assert!(e.file_offset + e.len <= 4096 || e.file_offset >= 12288, "{e:?}");
        }
        // Without the encoding the gap is bridged: one copy.
        let plain = Layout::build(&slices, &units, 4096).unwrap();
        assert_eq!(plain.units[0].extents.len(), 1, "{:?}", plain.units[0].extents);
    }

    #[test]
    fn bad_specs() {
        let slices = [s("a", 0, 8)];
        let one = |t: Vec<usize>| UnitSpec { name: "u".into(), tensors: t, pinned: false };
        assert!(
            Layout::build(&slices, &[one(vec![])], 4096)
                .unwrap_err()
                .to_string()
                .contains("has no tensors")
        );
        assert!(
            Layout::build(&slices, &[one(vec![3])], 4096)
                .unwrap_err()
                .to_string()
                .contains("names tensor 3")
        );
        assert!(
            Layout::build(&slices, &[one(vec![0]), one(vec![0])], 4096)
                .unwrap_err()
                .to_string()
                .contains("is in both")
        );
    }
}
