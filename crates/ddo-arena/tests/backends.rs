//! One test body per backend: the host backend always, CUDA under `cargo xtask test-gpu`.

mod common;

use std::sync::Arc;

use common::*;
use ddo_arena::{Arena, ArenaError, Budget, UnitSpec};
use ddo_core::{
    DeviceRange, Dtype, HostBytes, HostSlice, Platform, StreamId, UnitId, WeightSource,
};
use ddo_source::{Registrar, RetainedSource, RetainedStore};

struct Env {
    platform: Platform,
    _keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

fn host_env() -> Env {
    let (platform, device) = host();
    Env { platform, _keep: Some(device) }
}

fn cuda_env() -> Env {
    let (platform, device) =
        ddo_platform::cuda_platform(0).expect("a CUDA device (run with cargo xtask test-gpu)");
    Env { platform, _keep: Some(device) }
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
    every_lease_sees_its_units_bytes,
    addresses_are_stable_across_passes,
    prefetch_hits_after_the_first_pass,
    no_upload_is_wasted_when_slots_do_not_divide_the_units,
    priming_starts_the_first_pass_warm,
    a_retained_source_feeds_the_arena,
    an_order_change_cancels_lookahead,
    reclaim_keeps_addresses_and_uploads_again,
    close_refuses_live_leases,
    everything_resident_when_it_fits,
    device_conversion_gives_the_host_conversions_values,
    a_source_that_changes_under_an_upload_leaves_the_arena_usable,
    a_registered_range_dropped_without_unregistering_keeps_its_memory,
    retiring_completed_copies_gives_back_copies_no_fence_covers,
);

const WIDTH: usize = 128; // a block is 4 * 128*128*2 + ... ~ 200 KiB

fn arena(
    env: &Env,
    blocks: usize,
    budget: u64,
    depth: u32,
) -> (tempfile::TempDir, Arc<dyn WeightSource>, Arena) {
    let dir = scratch();
    let source = checkpoint(dir.path(), blocks, WIDTH);
    let units = UnitSpec::by_block(source.slices());
    let arena = Arena::new(
        &env.platform,
        source.clone(),
        &units,
        Budget { total: budget, headroom: 0, prefetch_depth: depth },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    (dir, source, arena)
}

fn slot_budget(env: &Env, slots: u64) -> u64 {
    // resident unit + `slots` block-sized slots.
    let g = env.platform.residency.granularity().unwrap();
    let block = (5 * WIDTH * WIDTH * 2 + WIDTH * 2) as u64;
    let unit = block.div_ceil(g) * g;
    let resident = ((WIDTH * 16 + WIDTH) as u64 * 2).div_ceil(g) * g;
    resident + slots * unit
}

fn check_unit(env: &Env, arena: &Arena, source: &Arc<dyn WeightSource>, unit: UnitId) {
    let layout = &arena.layout().units[unit.0 as usize];
    for t in &layout.tensors {
        let (_, range) = arena.tensor_range(t.slice).unwrap();
        let mut got = vec![0u8; range.len as usize];
        env.platform.residency.read_back(range, &mut got).unwrap();
        let s = &source.slices()[t.slice];
        assert_eq!(got, pattern(&s.name, s.len as usize), "unit {} tensor {}", layout.name, s.name);
    }
}

fn pass(env: &Env, arena: &Arena, source: &Arc<dyn WeightSource>, stream: StreamId, order: &[u32]) {
    arena.begin_pass();
    for &u in order {
        let lease = arena.acquire(UnitId(u), stream).unwrap_or_else(|e| panic!("acquire {u}: {e}"));
        check_unit(env, arena, source, UnitId(u));
        arena.release(lease, stream).unwrap();
    }
}

fn in_order(arena: &Arena) -> Vec<u32> {
    (0..arena.layout().units.len() as u32).collect()
}

fn every_lease_sees_its_units_bytes(env: &Env) {
    let (_d, source, arena) = arena(env, 7, slot_budget(env, 2), 1);
    assert_eq!(arena.plan().slots, 2);
    let stream = env.platform.residency.create_stream().unwrap();
    for _ in 0..3 {
        pass(env, &arena, &source, stream, &in_order(&arena));
    }
    let stats = arena.stats();
    assert!(stats.peak_bytes <= slot_budget(env, 2), "{stats:?}");
    assert_eq!(stats.acquires, 3 * 8);
    arena.close().unwrap();
}

fn addresses_are_stable_across_passes(env: &Env) {
    let (_d, source, arena) = arena(env, 5, slot_budget(env, 2), 1);
    let stream = env.platform.residency.create_stream().unwrap();
    let before: Vec<_> = (0..source.slices().len()).map(|i| arena.tensor_range(i)).collect();
    let mut ranges = Vec::new();
    for _ in 0..2 {
        arena.begin_pass();
        for u in in_order(&arena) {
            let lease = arena.acquire(UnitId(u), stream).unwrap();
            ranges.push((u, lease.range()));
            arena.release(lease, stream).unwrap();
        }
    }
    let (first, second) = ranges.split_at(ranges.len() / 2);
    assert_eq!(first, second);
    let after: Vec<_> = (0..source.slices().len()).map(|i| arena.tensor_range(i)).collect();
    assert_eq!(before, after);
    for (u, r) in first {
        assert_eq!(*r, arena.unit_range(UnitId(*u)).unwrap());
    }
}

fn prefetch_hits_after_the_first_pass(env: &Env) {
    let (_d, source, arena) = arena(env, 9, slot_budget(env, 3), 2);
    assert_eq!(arena.plan().slots, 3);
    let stream = env.platform.residency.create_stream().unwrap();
    pass(env, &arena, &source, stream, &in_order(&arena));
    let first = arena.stats();
    // The first pass predicts the attach order, and the resident unit that runs first already
    // starts the first streamed units: nothing uploads on demand.
    assert_eq!(first.prefetch_misses, 0, "{first:?}");
    assert_eq!(first.prefetch_hits, 9, "{first:?}");
    pass(env, &arena, &source, stream, &in_order(&arena));
    let second = arena.stats();
    assert_eq!(second.prefetch_misses, first.prefetch_misses, "{second:?}");
    assert_eq!(second.prefetch_hits - first.prefetch_hits, 9);
    assert_eq!(second.uploads - first.uploads, 9, "each streamed unit uploads once per pass");
}

fn no_upload_is_wasted_when_slots_do_not_divide_the_units(env: &Env) {
    // 13 and 6 streamed units over 4 slots: prefetch never takes a slot from a unit that runs
    // first (the wrap to the next pass included), so each unit uploads once per pass, ahead.
    for blocks in [13, 6] {
        let (_d, source, arena) = arena(env, blocks, slot_budget(env, 4), 3);
        assert_eq!(arena.plan().slots, 4);
        let stream = env.platform.residency.create_stream().unwrap();
        pass(env, &arena, &source, stream, &in_order(&arena));
        let first = arena.stats();
        for _ in 0..3 {
            pass(env, &arena, &source, stream, &in_order(&arena));
        }
        let s = arena.stats();
        let n = blocks as u64;
        assert_eq!(s.prefetch_misses, 0, "{blocks} blocks: {s:?}");
        assert_eq!(s.prefetch_hits - first.prefetch_hits, 3 * n, "{blocks} blocks: {s:?}");
        // A unit alone in its slot stays there; the plan counts only what is uploaded again.
        let per_pass = arena.plan().streamed_bytes;
        assert_eq!(s.upload_bytes - first.upload_bytes, 3 * per_pass, "{blocks} blocks: {s:?}");
        assert!(s.uploads - first.uploads <= 3 * n, "{blocks} blocks: {s:?}");
        arena.close().unwrap();
    }
}

fn priming_starts_the_first_pass_warm(env: &Env) {
    let (_d, source, arena) = arena(env, 9, slot_budget(env, 3), 2);
    let plan = arena.plan().clone();
    let units = &arena.layout().units;
    let resident: Vec<usize> = (0..units.len()).filter(|&i| plan.resident[i]).collect();
    let first: Vec<usize> =
        (0..units.len()).filter(|&i| !plan.resident[i]).take(plan.slots as usize).collect();
    let expected: u64 = resident.iter().chain(&first).map(|&i| units[i].payload).sum();
    assert_eq!(arena.prime().unwrap(), expected);
    assert_eq!(arena.stats().uploads as usize, resident.len() + first.len());
    // Before any acquisition, their bytes are on the device.
    for &i in resident.iter().chain(&first) {
        check_unit(env, &arena, &source, UnitId(i as u32));
    }
    let stream = env.platform.residency.create_stream().unwrap();
    pass(env, &arena, &source, stream, &in_order(&arena));
    let s = arena.stats();
    assert_eq!((s.prefetch_misses, s.prefetch_hits), (0, 9), "{s:?}");
    arena.close().unwrap();
    assert!(matches!(arena.prime(), Err(ArenaError::Closed)));
}

fn a_retained_source_feeds_the_arena(env: &Env) {
    // Half the checkpoint in retained windows (64 KiB, so a unit's range spans several and
    // uploads in pieces), the rest from the mapping; the windows registered where the host
    // allows.
    let dir = scratch();
    let mapped = checkpoint(dir.path(), 7, WIDTH);
    let total: u64 = mapped.slices().iter().map(|s| s.len).sum();
    let store = RetainedStore::new(total / 2, env.platform.admission.clone());
    let (retained, report) = RetainedSource::retain(mapped, &store, 64 << 10).unwrap();
    assert!(report.retained_bytes > 0 && report.unretained_bytes > 0, "{report:?}");
    let registrar =
        Registrar::new(u64::MAX, env.platform.residency.clone(), env.platform.admission.clone());
    let registered: Vec<_> =
        retained.windows().into_iter().filter_map(|w| registrar.register(w, true).ok()).collect();
    let source: Arc<dyn WeightSource> = Arc::new(retained);
    let units = UnitSpec::by_block(source.slices());
    let arena = Arena::new(
        &env.platform,
        source.clone(),
        &units,
        Budget { total: slot_budget(env, 2), headroom: 0, prefetch_depth: 1 },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let stream = env.platform.residency.create_stream().unwrap();
    for _ in 0..3 {
        pass(env, &arena, &source, stream, &in_order(&arena));
    }
    let split = arena
        .layout()
        .units
        .iter()
        .flat_map(|u| &u.extents)
        .any(|e| source.host_pieces(e.file, e.file_offset, e.len).is_some_and(|p| p.len() > 1));
    assert!(split, "some unit uploads from several windows");
    arena.close().unwrap();
    for r in registered {
        registrar.unregister(r).unwrap();
    }
    assert_eq!(store.used(), report.retained_bytes, "unregistering keeps the stored bytes");
    drop(arena);
    drop(source);
    assert_eq!(store.used(), 0);
}

/// Contract 1 for registrations: host memory registered for DMA stays allocated until it is
/// unregistered, even when the caller drops its range and its last reference to the memory.
fn a_registered_range_dropped_without_unregistering_keeps_its_memory(env: &Env) {
    let registrar =
        Registrar::new(u64::MAX, env.platform.residency.clone(), env.platform.admission.clone());
    let region: Arc<dyn ddo_core::HostRegion> = Arc::new(HostBytes::from(vec![7u8; 1 << 20]));
    let alive = Arc::downgrade(&region);
    let range = registrar.register(HostSlice::whole(region), true).unwrap();
    let charged = range.charged();
    drop(range);
    assert!(alive.upgrade().is_some(), "registered memory was freed while still registered");
    assert_eq!(registrar.charged(), charged, "a dropped range keeps counting its pages");
    // The memory is still usable as a copy source.
    let kept = HostSlice::whole(alive.upgrade().unwrap());
    assert!(kept.as_bytes().iter().all(|&b| b == 7));
}

/// A copy's source is held until the copy is proven complete; asking the device to retire
/// completed copies gives it back even when no fence was recorded after the copy (an upload
/// still being enqueued, waiting for the staging buffer its first copies hold).
fn retiring_completed_copies_gives_back_copies_no_fence_covers(env: &Env) {
    let residency = &env.platform.residency;
    let len = residency.granularity().unwrap();
    let reservation = residency.reserve(len).unwrap();
    let backing = residency.create_backing(len).unwrap();
    let range = DeviceRange { start: reservation.range.start, len };
    residency.map(range, backing).unwrap();
    let stream = residency.create_stream().unwrap();
    let region: Arc<dyn ddo_core::HostRegion> = Arc::new(HostBytes::from(vec![9u8; len as usize]));
    let alive = Arc::downgrade(&region);
    residency.copy_to_device(HostSlice::whole(region), range, stream).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while alive.upgrade().is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "a completed copy's source was never given back"
        );
        residency.retire_completed_copies().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let mut got = vec![0u8; len as usize];
    residency.read_back(range, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 9), "the copy landed");
    residency.unmap(range).unwrap();
    residency.release_backing(backing).unwrap();
    residency.release_reservation(reservation).unwrap();
}

fn an_order_change_cancels_lookahead(env: &Env) {
    let (_d, source, arena) = arena(env, 6, slot_budget(env, 3), 2);
    let stream = env.platform.residency.create_stream().unwrap();
    pass(env, &arena, &source, stream, &in_order(&arena));
    pass(env, &arena, &source, stream, &[0, 1, 2, 5, 3, 4, 6]);
    let stats = arena.stats();
    assert!(stats.order_mismatches >= 1, "{stats:?}");
    assert!(stats.prefetch_cancels >= 1, "{stats:?}");
    // The learned order still works afterwards.
    pass(env, &arena, &source, stream, &in_order(&arena));
    arena.close().unwrap();
}

fn reclaim_keeps_addresses_and_uploads_again(env: &Env) {
    let (_d, source, arena) = arena(env, 4, slot_budget(env, 2), 1);
    let stream = env.platform.residency.create_stream().unwrap();
    pass(env, &arena, &source, stream, &in_order(&arena));
    let ranges: Vec<_> = (0..5).map(|u| arena.unit_range(UnitId(u)).unwrap()).collect();
    if env.platform.name == "cuda" {
        // Reclaim frees only what a host-observed fence proves idle.
        env.platform.fences.wait(env.platform.fences.record(stream).unwrap()).unwrap();
    }
    let report = arena.reclaim_idle().unwrap();
    assert_eq!(report.slots, 2);
    assert_eq!(arena.stats().slot_bytes, 0);
    pass(env, &arena, &source, stream, &in_order(&arena));
    assert_eq!(arena.stats().backing_restores, 2);
    assert_eq!(ranges, (0..5).map(|u| arena.unit_range(UnitId(u)).unwrap()).collect::<Vec<_>>());
    arena.close().unwrap();
}

fn close_refuses_live_leases(env: &Env) {
    let (_d, _source, arena) = arena(env, 3, slot_budget(env, 2), 1);
    let stream = env.platform.residency.create_stream().unwrap();
    let lease = arena.acquire(UnitId(1), stream).unwrap();
    let e = arena.close().unwrap_err();
    assert!(matches!(e, ArenaError::CloseRefused { live_leases: 1, retained: 0 }), "{e}");
    arena.release(lease, stream).unwrap();
    arena.close().unwrap();
    assert!(matches!(arena.acquire(UnitId(1), stream), Err(ArenaError::Closed)));
}

fn everything_resident_when_it_fits(env: &Env) {
    let (_d, source, arena) = arena(env, 3, 64 << 20, 2);
    assert_eq!(arena.plan().slots, 0);
    let stream = env.platform.residency.create_stream().unwrap();
    pass(env, &arena, &source, stream, &in_order(&arena));
    pass(env, &arena, &source, stream, &in_order(&arena));
    assert_eq!(arena.stats().uploads, 4, "each unit uploads once");
}

#[test]
fn a_budget_too_small_says_what_is_needed() {
    let env = host_env();
    let dir = scratch();
    let source = checkpoint(dir.path(), 3, WIDTH);
    let units = UnitSpec::by_block(source.slices());
    let e = Arena::new(
        &env.platform,
        source,
        &units,
        Budget { total: 256 << 10, headroom: 128 << 10, prefetch_depth: 2 },
    )
    .unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with(
            "GPU budget of 256.00 KiB (128.00 KiB after 128.00 KiB of headroom) is too small"
        ),
        "{text}"
    );
    assert!(text.contains("raise the budget to"), "{text}");
}

#[test]
fn the_cuda_adapter_reports_a_missing_driver() {
    if ddo_platform::cuda::driver_present() {
        return; // A GPU machine: the cuda_backend tests cover the adapter.
    }
    let e = ddo_platform::cuda_platform(0).unwrap_err();
    assert!(matches!(e, ddo_core::DeviceError::DriverNotFound));
    assert!(e.to_string().starts_with("no CUDA driver found"));
}

/// Inputs of `from`: every bit pattern of 1- and 2-byte dtypes; for F32 the rounding edges, NaN
/// and infinities, and a spread of other values.
fn conversion_inputs(from: Dtype) -> Vec<u8> {
    match from.size_bytes() {
        1 => (0..=u8::MAX).collect(),
        2 => (0..=u16::MAX).flat_map(u16::to_le_bytes).collect(),
        _ => {
            let edges = [0x3F80_8000u32, 0x3F81_8000, 0x7F7F_FFFF, 0x477F_F000, 0x3300_0000];
            let specials = [0u32, 0x8000_0000, 0x7F80_0000, 0xFF80_0000, 0x7FC0_0001, 1];
            let spread = (0..1u32 << 20).map(|i| i.wrapping_mul(2_654_435_761));
            edges.into_iter().chain(specials).chain(spread).flat_map(u32::to_le_bytes).collect()
        }
    }
}

fn device_conversion_gives_the_host_conversions_values(env: &Env) {
    let r = &env.platform.residency;
    let stream = r.create_stream().unwrap();
    let g = r.granularity().unwrap();
    let floats = [Dtype::F32, Dtype::F16, Dtype::BF16, Dtype::F8E4M3, Dtype::F8E5M2];
    let mut checked = 0;
    for from in floats {
        for to in [Dtype::F32, Dtype::F16, Dtype::BF16] {
            if !ddo_core::convertible(from, to) {
                continue;
            }
            assert!(
                r.converts(from, to),
                "{from:?} -> {to:?}: H200 and the host backend convert every pair"
            );
            let input = conversion_inputs(from);
            let n = (input.len() as u64) / from.size_bytes();
            let out_len = n * to.size_bytes();
            let len = (input.len() as u64 + out_len).div_ceil(g) * g;
            let reservation = r.reserve(len).unwrap();
            let backing = r.create_backing(len).unwrap();
            let whole = DeviceRange { start: reservation.range.start, len };
            r.map(whole, backing).unwrap();
            let src = DeviceRange { start: whole.start, len: input.len() as u64 };
            let dst = DeviceRange { start: whole.start.offset(input.len() as u64), len: out_len };
            let host = HostSlice::whole(Arc::new(HostBytes::from(input.clone())));
            r.copy_to_device(host, src, stream).unwrap();
            r.convert(src, from, dst, to, stream).unwrap();
            env.platform.fences.wait(env.platform.fences.record(stream).unwrap()).unwrap();
            let mut got = vec![0u8; out_len as usize];
            r.read_back(dst, &mut got).unwrap();
            let mut want = vec![0u8; out_len as usize];
            ddo_core::convert(from, to, &input, &mut want);
            let w = to.size_bytes() as usize;
            for (i, (g, e)) in got.chunks(w).zip(want.chunks(w)).enumerate() {
                if g != e {
                    let widen = |b: &[u8]| {
                        let mut f = [0u8; 4];
                        ddo_core::convert(to, Dtype::F32, b, &mut f);
                        f32::from_le_bytes(f)
                    };
                    let nan = if to == Dtype::F32 {
                        f32::from_le_bytes(g.try_into().unwrap()).is_nan()
                            && f32::from_le_bytes(e.try_into().unwrap()).is_nan()
                    } else {
                        widen(g).is_nan() && widen(e).is_nan()
                    };
                    assert!(nan, "{from:?} -> {to:?}: element {i} is {g:?}, the host gives {e:?}");
                }
            }
            // Contract violations are refused, not run.
            assert!(r.convert(src, from, src, to, stream).is_err(), "overlapping ranges");
            assert!(
                r.convert(src, from, dst, Dtype::I32, stream).is_err(),
                "a pair without a kernel"
            );
            r.unmap(whole).unwrap();
            r.release_backing(backing).unwrap();
            r.release_reservation(reservation).unwrap();
            checked += 1;
        }
    }
    assert_eq!(checked, 12);
}

/// A source whose `check_unchanged` fails once, at call number `fail_at`.
struct Flaky {
    inner: Arc<dyn WeightSource>,
    calls: std::sync::atomic::AtomicU32,
    fail_at: u32,
}

impl WeightSource for Flaky {
    fn slices(&self) -> &[ddo_core::TensorSlice] {
        self.inner.slices()
    }
    fn check_unchanged(&self) -> Result<(), ddo_core::SourceError> {
        let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if n == self.fail_at {
            return Err(ddo_core::SourceError::CheckpointChanged {
                file: "m.safetensors".into(),
                what: "it changed during the upload".into(),
            });
        }
        self.inner.check_unchanged()
    }
    fn read(&self, slice: usize, dst: &mut [u8]) -> Result<(), ddo_core::SourceError> {
        self.inner.read(slice, dst)
    }
    fn host_bytes(&self, slice: usize) -> Option<HostSlice> {
        self.inner.host_bytes(slice)
    }
}

fn a_source_that_changes_under_an_upload_leaves_the_arena_usable(env: &Env) {
    let dir = scratch();
    let inner = checkpoint(dir.path(), 6, WIDTH);
    // Uploads check the source before and after their copies: the 9th check is the one after
    // some unit's copies were enqueued.
    let flaky = Arc::new(Flaky { inner: inner.clone(), calls: 0.into(), fail_at: 9 });
    let source: Arc<dyn WeightSource> = flaky.clone();
    let units = UnitSpec::by_block(source.slices());
    let budget = Budget { total: slot_budget(env, 2), headroom: 0, prefetch_depth: 1 };
    let arena = Arena::new(&env.platform, source.clone(), &units, budget).unwrap();
    let stream = env.platform.residency.create_stream().unwrap();
    arena.begin_pass();
    let mut failed = false;
    for u in in_order(&arena) {
        match arena.acquire(UnitId(u), stream) {
            Ok(lease) => arena.release(lease, stream).unwrap(),
            Err(e) => {
                assert!(e.to_string().contains("changed during the upload"), "{e}");
                failed = true;
                break;
            }
        }
    }
    assert!(
        failed,
        "the failing check was reached ({} checks)",
        flaky.calls.load(std::sync::atomic::Ordering::SeqCst)
    );
    // Nothing is left in flight: idle memory can be released, and the next passes see every
    // unit's bytes.
    arena.reclaim_idle().unwrap();
    for _ in 0..2 {
        pass(env, &arena, &source, stream, &in_order(&arena));
    }
    arena.close().unwrap();
}
