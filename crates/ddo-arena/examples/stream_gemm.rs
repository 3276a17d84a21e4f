//! Streams a generated multi-GiB safetensors checkpoint through the arena on a CUDA GPU with a
//! small budget, running a cuBLAS GEMM chain on every unit while the next units upload, and
//! prints the metrics profile. With `--bench` it also measures, side by side in one run: the
//! pinned copy ceiling, the registered-mmap copy, streaming with no compute, the overlap of
//! streaming with compute, and the host cost per acquire + release pair.
//!
//! ```sh
//! cargo run --release -p ddo-arena --example stream_gemm -- [--size-gib 8] [--width 4096]
//!     [--budget-gib 1.5] [--passes 3] [--dir DIR] [--bench]
//! ```
//!
//! Needs a CUDA driver and cuBLAS (`libcublas.so` on the library path).

use std::error::Error;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaContext;
use ddo_arena::{Arena, ArenaStats, Budget, UnitSpec};
use ddo_core::{
    DeviceRange, GIB, HostRegion, HostSlice, Platform, Residency, StreamId, UnitId, WeightSource,
};
use ddo_metrics::{DynamicOffloadMetrics, ExecutionSection, RuntimeSection, SetupSection};
use ddo_platform::cuda::CudaDevice;
use ddo_source::{Checkpoint, CheckpointSource, Registrar};

struct Args {
    size_gib: f64,
    width: usize,
    budget_gib: f64,
    passes: usize,
    dir: PathBuf,
    bench: bool,
}

#[path = "common/gemm.rs"]
mod gemm;

fn args() -> Result<Args, String> {
    let mut a = Args {
        size_gib: 8.0,
        width: 4096,
        budget_gib: 1.5,
        passes: 3,
        dir: std::env::temp_dir(),
        bench: false,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().cloned().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--size-gib" => {
                a.size_gib = value()?.parse().map_err(|_| "--size-gib takes a number")?
            }
            "--width" => a.width = value()?.parse().map_err(|_| "--width takes a number")?,
            "--budget-gib" => {
                a.budget_gib = value()?.parse().map_err(|_| "--budget-gib takes a number")?
            }
            "--passes" => a.passes = value()?.parse().map_err(|_| "--passes takes a count")?,
            "--dir" => a.dir = PathBuf::from(value()?),
            "--bench" => a.bench = true,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("stream_gemm: {e}");
        std::process::exit(1);
    }
}

/// A plain device buffer made of one reservation and one backing.
fn device_buffer(r: &dyn Residency, len: u64) -> Result<DeviceRange, Box<dyn Error>> {
    let g = r.granularity()?;
    let len = len.div_ceil(g) * g;
    let res = r.reserve(len)?;
    let b = r.create_backing(len)?;
    r.map(res.range, b)?;
    Ok(res.range)
}

/// bf16 values of magnitude about 2^-6 with random signs and mantissas: never zero, no overflow
/// along a chain of GEMMs of width 4096.
fn bf16_pattern(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(747_796_405).wrapping_add(2_891_336_453);
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let v: u16 = 0x3C80 | ((x >> 9) as u16 & 0x7F) | (((x >> 20) as u16 & 1) << 15);
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Writes `blocks` blocks of four [width, width] BF16 weights.
fn write_checkpoint(path: &Path, blocks: usize, width: usize) -> Result<(), Box<dyn Error>> {
    let tensor = (width * width * 2) as u64;
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for b in 0..blocks {
        for part in ["attn.to_q", "attn.to_k", "ff.up", "ff.down"] {
            header.insert(
                format!("blocks.{b}.{part}.weight"),
                serde_json::json!({"dtype": "BF16", "shape": [width, width], "data_offsets": [offset, offset + tensor]}),
            );
            offset += tensor;
        }
    }
    let mut json = serde_json::to_vec(&header)?;
    // Keep the data section 256-byte aligned: 8 bytes of length + header.
    while !(json.len() + 8).is_multiple_of(256) {
        json.push(b' ');
    }
    let mut w = BufWriter::with_capacity(16 << 20, std::fs::File::create(path)?);
    w.write_all(&(json.len() as u64).to_le_bytes())?;
    w.write_all(&json)?;
    let pattern = bf16_pattern(tensor as usize, 11);
    for _ in 0..blocks * 4 {
        w.write_all(&pattern)?;
    }
    w.into_inner()?.sync_all()?;
    Ok(())
}

struct Gemm {
    blas: CudaBlas,
    width: usize,
    tokens: usize,
    x: [u64; 2],
}

impl Gemm {
    /// Y = W X for every weight of `unit`, ping-ponging between two activation buffers.
    fn unit(&self, arena: &Arena, unit: UnitId) -> Result<(), Box<dyn Error>> {
        for (i, tensor) in arena.layout().units[unit.0 as usize].tensors.iter().enumerate() {
            let (_, range) = arena.tensor_range(tensor.slice).ok_or("tensor without a range")?;
            let (src, dst) = (self.x[i % 2], self.x[(i + 1) % 2]);
            // SAFETY: the weight is inside a unit the caller holds a lease on, the activations
            // were allocated for width x tokens bf16 elements; the handle's stream is the
            // consumer stream.
            unsafe { gemm::bf16(&self.blas, self.width, self.tokens, range.start.0, src, dst) }?;
        }
        Ok(())
    }
}

/// One pass over every unit; returns seconds until its work completed.
fn pass(
    platform: &Platform,
    arena: &Arena,
    stream: StreamId,
    gemm: Option<&Gemm>,
) -> Result<f64, Box<dyn Error>> {
    let t = Instant::now();
    arena.begin_pass();
    for u in 0..arena.layout().units.len() as u32 {
        let lease = arena.acquire(UnitId(u), stream)?;
        if let Some(g) = gemm {
            g.unit(arena, UnitId(u))?;
        }
        arena.release(lease, stream)?;
    }
    platform.fences.wait(platform.fences.record(stream)?)?;
    Ok(t.elapsed().as_secs_f64())
}

fn copy_gbs(
    platform: &Platform,
    src: HostSlice,
    dst: DeviceRange,
    stream: StreamId,
) -> Result<f64, Box<dyn Error>> {
    let mut best = 0.0f64;
    for _ in 0..5 {
        let t = Instant::now();
        platform.residency.copy_to_device(src.clone(), dst, stream)?;
        platform.fences.wait(platform.fences.record(stream)?)?;
        best = best.max(dst.len as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(best)
}

fn run() -> Result<(), Box<dyn Error>> {
    let a = args()?;
    let tensor = (a.width * a.width * 2) as u64;
    let blocks = ((a.size_gib * GIB as f64) as u64 / (4 * tensor)).max(2) as usize;
    let path = a.dir.join("ddo-stream-gemm.safetensors");
    let t = Instant::now();
    write_checkpoint(&path, blocks, a.width)?;
    eprintln!(
        "checkpoint: {blocks} blocks, {:.2} GiB, written in {:.1} s",
        (blocks as u64 * 4 * tensor) as f64 / GIB as f64,
        t.elapsed().as_secs_f64()
    );

    let (platform, device): (Platform, Arc<CudaDevice>) = ddo_platform::cuda_platform(0)?;
    let checkpoint = Arc::new(Checkpoint::open(&path)?);
    // SAFETY: this program does not modify the checkpoint while it is mapped.
    let source = Arc::new(unsafe { CheckpointSource::with_mmap(checkpoint.clone(), 8) }?);
    let file_len = checkpoint.files()[0].identity.size;
    let registrar = Registrar::new(
        file_len.div_ceil(64 << 20) * (64 << 20),
        platform.residency.clone(),
        platform.admission.clone(),
    );
    let t = Instant::now();
    let mapping: Arc<dyn HostRegion> = source.mapping(0).ok_or("no mapping")?.clone();
    let _registered = registrar.register(HostSlice::whole(mapping.clone()), true)?;
    let register_seconds = t.elapsed().as_secs_f64();

    let ctx = CudaContext::new(0)?;
    let compute = ctx.new_stream()?;
    let blas = CudaBlas::new(compute.clone())?;
    // SAFETY: a live stream of the primary context, alive until the end of this function.
    let stream = unsafe { device.adopt_stream(compute.cu_stream() as u64) };
    let units = UnitSpec::by_block(source.slices());
    let budget =
        Budget { total: (a.budget_gib * GIB as f64) as u64, headroom: 0, prefetch_depth: 2 };
    let arena = Arena::new(&platform, source.clone() as Arc<dyn WeightSource>, &units, budget)?;

    let make_gemm = |tokens: usize| -> Result<Gemm, Box<dyn Error>> {
        let bytes = (a.width * tokens * 2) as u64;
        let x0 = device_buffer(&*platform.residency, bytes)?;
        let x1 = device_buffer(&*platform.residency, bytes)?;
        let init =
            HostSlice::whole(Arc::new(ddo_core::HostBytes::from(bf16_pattern(bytes as usize, 5))));
        platform.residency.copy_to_device(
            init,
            DeviceRange { start: x0.start, len: bytes },
            stream,
        )?;
        Ok(Gemm {
            blas: CudaBlas::new(compute.clone())?,
            width: a.width,
            tokens,
            x: [x0.start.0, x1.start.0],
        })
    };

    if !a.bench {
        let gemm = make_gemm(4096)?;
        for p in 0..a.passes {
            let s = pass(&platform, &arena, stream, Some(&gemm))?;
            eprintln!("pass {p}: {s:.4} s");
        }
        print!("{}", profile(&arena, register_seconds));
        drop(blas);
        return Ok(());
    }

    // Copy ceilings: one large pinned copy, one large copy from the registered mapping.
    let big = GIB;
    let dst = device_buffer(&*platform.residency, big)?;
    let pinned =
        HostSlice::whole(Arc::new(ddo_core::HostBytes::from(bf16_pattern(big as usize, 3))));
    let pinned_reg = platform.residency.register_host(pinned.clone(), false)?;
    let pinned_gbs = copy_gbs(&platform, pinned.clone(), dst, stream)?;
    let mmap_slice = HostSlice::new(mapping.clone(), 4096, big as usize)
        .ok_or("checkpoint smaller than 1 GiB")?;
    let mmap_gbs = copy_gbs(&platform, mmap_slice, dst, stream)?;
    platform.residency.unregister_host(&pinned_reg)?;

    // Streaming with no compute.
    let streamed = arena.plan().streamed_bytes as f64;
    let mut copy_alone = f64::MAX;
    for _ in 0..3 {
        copy_alone = copy_alone.min(pass(&platform, &arena, stream, None)?);
    }
    let streaming_stats = arena.stats();

    // Compute alone: the same units all resident.
    let resident_budget =
        Budget { total: arena.layout().reserved + (1 << 30), headroom: 0, prefetch_depth: 2 };
    let resident =
        Arena::new(&platform, source.clone() as Arc<dyn WeightSource>, &units, resident_budget)?;
    let probe = make_gemm(4096)?;
    pass(&platform, &resident, stream, Some(&probe))?;
    let probe_time = pass(&platform, &resident, stream, Some(&probe))?;
    let tokens =
        (((4096.0 * copy_alone / probe_time) / 256.0).round() as usize * 256).clamp(256, 65536);
    let gemm = make_gemm(tokens)?;
    let before = resident.stats();
    let mut compute_alone = f64::MAX;
    for _ in 0..3 {
        compute_alone = compute_alone.min(pass(&platform, &resident, stream, Some(&gemm))?);
    }
    let resident_stats = resident.stats();
    let resident_pair_us = (resident_stats.acquire_seconds - before.acquire_seconds
        + resident_stats.release_seconds
        - before.release_seconds)
        * 1e6
        / (resident_stats.acquires - before.acquires).max(1) as f64;

    // Streaming overlapped with compute, with the arena above and with one more slot.
    let mut overlapped = f64::MAX;
    for _ in 0..3 {
        overlapped = overlapped.min(pass(&platform, &arena, stream, Some(&gemm))?);
    }
    let deeper_budget = Budget { prefetch_depth: 3, ..budget };
    let deeper =
        Arena::new(&platform, source.clone() as Arc<dyn WeightSource>, &units, deeper_budget)?;
    let mut deeper_copy = f64::MAX;
    for _ in 0..3 {
        deeper_copy = deeper_copy.min(pass(&platform, &deeper, stream, None)?);
    }
    let mut deeper_overlapped = f64::MAX;
    for _ in 0..3 {
        deeper_overlapped = deeper_overlapped.min(pass(&platform, &deeper, stream, Some(&gemm))?);
    }
    let floor = compute_alone.max(copy_alone);

    println!("\n| measure (H200, one run) | value | against | ratio | target |");
    println!("|---|---|---|---|---|");
    println!("| pinned host->device copy, 1 GiB | {pinned_gbs:.1} GB/s | | | |");
    println!(
        "| registered-mmap copy, 1 GiB | {mmap_gbs:.1} GB/s | pinned {pinned_gbs:.1} GB/s | {:.3} | >= 0.95 |",
        mmap_gbs / pinned_gbs
    );
    println!(
        "| stream {:.2} GiB through {} slots, no compute | {:.1} GB/s ({copy_alone:.4} s/pass) | pinned {pinned_gbs:.1} GB/s | {:.3} | >= 0.95 |",
        streamed / GIB as f64,
        arena.plan().slots,
        streamed / copy_alone / 1e9,
        streamed / copy_alone / 1e9 / pinned_gbs
    );
    println!(
        "| streamed step with a {}x{}x{} GEMM per weight | {overlapped:.4} s | max(compute {compute_alone:.4}, copy {copy_alone:.4}) | {:.3} | <= 1.03 |",
        a.width,
        a.width,
        tokens,
        overlapped / floor
    );
    println!(
        "| same, {} slots ({} resident units) | {deeper_overlapped:.4} s | max(compute {compute_alone:.4}, copy {deeper_copy:.4}) | {:.3} | <= 1.03 |",
        deeper.plan().slots,
        deeper.plan().resident.iter().filter(|r| **r).count(),
        deeper_overlapped / compute_alone.max(deeper_copy)
    );
    println!(
        "| host cost per acquire+release, streamed (prefetch included) | {:.1} us | | | <= 20 |",
        streaming_stats.host_us_per_pair()
    );
    println!("| host cost per acquire+release, resident | {resident_pair_us:.1} us | | | <= 20 |");
    println!(
        "| arena device memory (budget {:.2} GiB) | {:.2} GiB | model {:.2} GiB | {:.3} | |",
        a.budget_gib,
        arena.plan().device_bytes() as f64 / GIB as f64,
        arena.layout().payload() as f64 / GIB as f64,
        arena.plan().device_bytes() as f64 / arena.layout().payload() as f64
    );
    println!(
        "| registering the {:.2} GiB mapping | {register_seconds:.3} s | | | |",
        file_len as f64 / GIB as f64
    );
    print!("\n{}", profile(&arena, register_seconds));
    drop(deeper);
    drop(resident);
    Ok(())
}

fn profile(arena: &Arena, register_seconds: f64) -> String {
    let plan = arena.plan();
    let mut m = DynamicOffloadMetrics::new(ExecutionSection {
        route: "vmm_fast_runtime".into(),
        component: Some("stream_gemm".into()),
        backend: Some("vmm".into()),
        ..ExecutionSection::default()
    });
    m.setup = SetupSection {
        unit_count: Some(arena.layout().units.len() as u64),
        resident_units: Some(plan.resident.iter().filter(|r| **r).count() as u64),
        streamed_units: Some(plan.streamed_units() as u64),
        execution_slots: Some(u64::from(plan.slots)),
        slot_bytes: Some(plan.slot_len),
        gpu_budget_bytes: Some(plan.budget.total),
        headroom_bytes: Some(plan.budget.headroom),
        streamed_bytes_per_pass: Some(plan.streamed_bytes),
        total_bytes: Some(arena.layout().payload()),
        setup_seconds: Some(register_seconds),
        ..SetupSection::default()
    };
    m.runtime = runtime_section(&arena.stats());
    m.format_profile()
}

/// The arena's counters as the runtime section of the metrics (the arena reports plain
/// counters; whoever reports metrics maps them, as the session does for its routes).
fn runtime_section(s: &ArenaStats) -> RuntimeSection {
    RuntimeSection {
        passes: Some(s.passes),
        uploads: Some(s.uploads),
        upload_bytes: Some(s.upload_bytes),
        upload_copies: Some(s.upload_copies),
        device_conversions: Some(s.device_conversions),
        device_decodes: Some(s.device_decodes),
        encoded_upload_bytes: Some(s.encoded_upload_bytes),
        decoded_bytes: Some(s.decoded_bytes),
        decode_seconds: Some(s.decode_seconds),
        upload_seconds: Some(s.upload_seconds),
        wait_seconds: Some(s.wait_seconds),
        prefetch_hits: Some(s.prefetch_hits),
        prefetch_misses: Some(s.prefetch_misses),
        prefetch_cancels: Some(s.prefetch_cancels),
        evictions: Some(s.evictions),
        reclaim_cycles: Some(s.reclaim_cycles),
        resident_bytes: Some(s.resident_bytes),
        slot_bytes: Some(s.slot_bytes),
        peak_bytes: Some(s.peak_bytes),
        unsafe_retained_bytes: Some(s.unsafe_retained_bytes),
        ..RuntimeSection::default()
    }
}
