//! Tensors uploaded entropy-coded and decoded on the device: every lease sees the checkpoint's
//! bytes, the link carries the encodings, and a lost encoding is an error, never other bytes.
//! The host backend always, CUDA under `cargo xtask test-gpu`.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::*;
use ddo_arena::{Arena, ArenaError, Budget, DeviceWork, Layout, UnitSpec};
use ddo_core::{
    CheckpointFileId, FileRange, HostBytes, HostSlice, Platform, ReadRequest, SourceError,
    TensorSlice, UnitId, WeightSource,
};

fn host_env() -> Platform {
    let (platform, device) = host();
    std::mem::forget(device); // the platform holds it; the fixture's handle is not needed
    platform
}

fn cuda_env() -> Platform {
    ddo_platform::cuda_platform(0).expect("a CUDA device (run with cargo xtask test-gpu)").0
}

macro_rules! backend_tests {
    ($($name:ident),* $(,)?) => {
        mod host_backend {
            $( #[test] fn $name() { super::$name(&super::host_env()) } )*
        }
        mod cuda_backend {
            $(
                #[test]
                #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
                fn $name() { super::$name(&super::cuda_env()) }
            )*
        }
    };
}

backend_tests!(
    every_lease_sees_the_checkpoint_bytes_of_encoded_tensors,
    a_unit_past_a_staging_round_decodes_round_by_round,
    a_lost_encoding_is_an_error_not_other_bytes,
);

/// A source holding the encodings of chosen bf16 tensors, one after another (256-aligned) in
/// one host buffer addressed as the file after the checkpoint's.
struct Encoded {
    inner: Arc<dyn WeightSource>,
    file: CheckpointFileId,
    bytes: HostSlice,
    ranges: HashMap<usize, FileRange>,
    /// Serve the encodings (a source that lost them answers `None`).
    holds: bool,
}

impl Encoded {
    fn new(inner: Arc<dyn WeightSource>, encode: impl Fn(&TensorSlice) -> bool) -> Encoded {
        let file = CheckpointFileId(inner.slices().iter().map(|s| s.file.0).max().unwrap() + 1);
        let (mut bytes, mut ranges) = (Vec::new(), HashMap::new());
        for (i, s) in inner.slices().iter().enumerate() {
            if !encode(s) {
                continue;
            }
            let mut raw = vec![0u8; s.len as usize];
            inner.read(i, &mut raw).unwrap();
            let enc = ddo_codec::encode_bf16(&raw, 2).unwrap().to_bytes();
            bytes.resize(bytes.len().div_ceil(256) * 256, 0);
            ranges.insert(i, FileRange { file, offset: bytes.len() as u64, len: enc.len() as u64 });
            bytes.extend_from_slice(&enc);
        }
        let bytes = HostSlice::whole(Arc::new(HostBytes::from(bytes)));
        Encoded { inner, file, bytes, ranges, holds: true }
    }
}

impl WeightSource for Encoded {
    fn slices(&self) -> &[TensorSlice] {
        self.inner.slices()
    }
    fn check_unchanged(&self) -> Result<(), SourceError> {
        self.inner.check_unchanged()
    }
    fn read(&self, slice: usize, dst: &mut [u8]) -> Result<(), SourceError> {
        self.inner.read(slice, dst)
    }
    fn host_bytes(&self, slice: usize) -> Option<HostSlice> {
        self.inner.host_bytes(slice)
    }
    fn host_pieces(
        &self,
        file: CheckpointFileId,
        offset: u64,
        len: u64,
    ) -> Option<Vec<(u64, HostSlice)>> {
        if file != self.file {
            return self.inner.host_pieces(file, offset, len);
        }
        let piece = self.bytes.slice(offset as usize, len as usize)?;
        self.holds.then(|| vec![(0, piece)])
    }
    fn read_batch(&self, requests: &[ReadRequest], dst: &mut [u8]) -> Result<(), SourceError> {
        self.inner.read_batch(requests, dst)
    }
    fn encoding(&self, slice: usize) -> Option<FileRange> {
        self.ranges.get(&slice).copied()
    }
}

const WIDTH: usize = 128;

/// The matrices of a checkpoint of `blocks` blocks encoded, the rest served as they are.
fn encoded_arena(
    platform: &Platform,
    blocks: usize,
    width: usize,
    holds: bool,
) -> (tempfile::TempDir, Arc<Encoded>, Arena) {
    let dir = scratch();
    let mut source = Encoded::new(checkpoint(dir.path(), blocks, width), |s| s.shape.len() == 2);
    source.holds = holds;
    let source = Arc::new(source);
    let units = UnitSpec::by_block(source.slices());
    // Room for the leftovers, two block slots and the two staging buffers.
    let g = platform.residency.granularity().unwrap();
    let layout =
        Layout::build_staged(source.slices(), &units, g, &HashMap::new(), &source.ranges).unwrap();
    let total = layout.units[0].len + 2 * layout.units[1].len + layout.staging_len;
    let budget = Budget { total, headroom: 0, prefetch_depth: 1 };
    let arena = Arena::new(platform, source.clone(), &units, budget).unwrap();
    (dir, source, arena)
}

fn every_lease_sees_the_checkpoint_bytes_of_encoded_tensors(platform: &Platform) {
    let (_dir, source, arena) = encoded_arena(platform, 6, WIDTH, true);
    assert!(arena.plan().streamed_units() >= 4, "{:?}", arena.plan());
    // The block's encodings lie back to back in the source: one copy carries them.
    let block = &arena.layout().units[1];
    assert_eq!(block.extents.iter().filter(|e| e.staged).count(), 1, "{:?}", block.extents);
    leases_see_the_checkpoint_bytes(platform, &source, arena);
}

fn a_unit_past_a_staging_round_decodes_round_by_round(platform: &Platform) {
    // A block's three encodings (43 + 14 + 14 MiB) exceed one round of 64 MiB.
    let (_dir, source, arena) = encoded_arena(platform, 2, 2688, true);
    let layout = arena.layout();
    let block = &layout.units[1];
    assert_eq!(block.rounds(), 2, "{:?}", block.conversions);
    assert!(layout.staging_buffer <= ddo_arena::STAGING_ROUND, "{}", layout.staging_buffer);
    let staged: u64 = block.conversions.iter().map(|c| c.staged_len).sum();
    assert!(layout.staging_buffer < staged, "a buffer holds a round, not the unit");
    // A round's stored bytes lie inside the buffer, apart from each other.
    for round in 0..block.rounds() {
        let mut spans: Vec<(u64, u64)> = block
            .conversions
            .iter()
            .filter(|c| c.round == round)
            .map(|c| (c.staging, c.staging + c.staged_len))
            .collect();
        spans.sort_unstable();
        assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "{spans:?}");
        assert!(spans.last().unwrap().1 <= layout.staging_buffer);
    }
    leases_see_the_checkpoint_bytes(platform, &source, arena);
}

fn leases_see_the_checkpoint_bytes(platform: &Platform, source: &Encoded, arena: Arena) {
    assert!(platform.residency.decodes(), "the host backend and CUDA decode");
    let layout = arena.layout();
    // Every matrix is decoded: its encoding lands in staging, its elements in the unit.
    let block = &layout.units[1];
    let decoded: Vec<_> =
        block.conversions.iter().filter(|c| c.work == DeviceWork::Decode).collect();
    assert_eq!(decoded.len(), 3, "{block:?}");
    for c in &decoded {
        assert_eq!(c.staged_len, source.encoding(c.slice).unwrap().len);
        assert_eq!(c.served_len, source.slices()[c.slice].len);
    }
    let stream = platform.residency.create_stream().unwrap();
    for _ in 0..3 {
        arena.begin_pass();
        for u in 0..layout.units.len() as u32 {
            let lease = arena.acquire(UnitId(u), stream).unwrap();
            for t in &layout.units[u as usize].tensors {
                let (_, range) = arena.tensor_range(t.slice).unwrap();
                let mut got = vec![0u8; range.len as usize];
                platform.residency.read_back(range, &mut got).unwrap();
                let s = &source.slices()[t.slice];
                assert!(got == pattern(&s.name, s.len as usize), "pass unit {u} tensor {}", s.name);
            }
            arena.release(lease, stream).unwrap();
        }
    }
    let stats = arena.stats();
    let (n, enc, dec) = layout
        .units
        .iter()
        .filter(|u| arena.plan().slot_of[u.id.0 as usize].is_some())
        .fold((0, 0, 0), |(n, e, d), u| {
            let (a, b, c) = u.decoded();
            (n + a, e + b, d + c)
        });
    assert!(stats.device_decodes >= 3 * n, "{stats:?}");
    assert!(stats.encoded_upload_bytes >= 3 * enc && stats.decoded_bytes >= 3 * dec, "{stats:?}");
    assert!(stats.upload_bytes >= stats.encoded_upload_bytes, "{stats:?}");
    let (bytes, seconds) = platform.residency.decode_totals(stream);
    assert_eq!((bytes, seconds), (0, 0.0), "decodes run on the arena's own stream");
    assert!(stats.decode_seconds > 0.0, "{stats:?}");
    arena.close().unwrap();
    // The arena's stream is released with its totals: the closed arena keeps what it measured.
    let closed = arena.stats().decode_seconds;
    assert!(closed >= stats.decode_seconds, "{closed} after close, {stats:?} before");
}

fn a_lost_encoding_is_an_error_not_other_bytes(platform: &Platform) {
    // Building the arena does not need the encodings; uploading does.
    let (_dir, _source, arena) = encoded_arena(platform, 6, WIDTH, false);
    let stream = platform.residency.create_stream().unwrap();
    arena.begin_pass();
    let streamed = (0..arena.layout().units.len() as u32)
        .find(|&u| arena.plan().slot_of[u as usize].is_some())
        .unwrap();
    let mut refused = false;
    for u in 0..=streamed {
        match arena.acquire(UnitId(u), stream) {
            Ok(lease) => arena.release(lease, stream).unwrap(),
            Err(ArenaError::Source(SourceError::InvalidBatch(m))) => {
                assert!(m.contains("encoding of tensor"), "{m}");
                refused = true;
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(refused, "an upload without its encoding must fail");
    arena.abandon_pass();
    arena.close().unwrap();
}
