//! The disk route (`vmm_runtime`, preset `nvme_baseline`) against the disk's own speed: streams a
//! generated checkpoint from disk through registered staging into a component session, with a
//! cuBLAS GEMM on every weight of every unit, and prints in one run:
//! - the disk's plain sequential O_DIRECT read speed (one thread, 64 MiB requests),
//! - the route's disk GB/s (bytes read per pass / step) and its ratio to the plain speed,
//! - the step against max(compute step, disk bytes per pass / plain disk speed),
//! - the peak host RSS of the disk route's phase against its staging ceiling,
//! - whether the output equals the all-resident run bit for bit.
//!
//! ```sh
//! cargo run --release -p ddo-session --example disk_gemm -- [--size-gib 8] [--width 4096]
//!     [--tokens 4096] [--budget-gib 1.5] [--staging-gib 0.625] [--passes 4] [--dir DIR]
//!     [--device cuda|cpu]
//! ```
//!
//! With a CUDA driver and cuBLAS it runs on `cuda:0`; without (or with `--device cpu`) it runs on
//! the host backend, where the "GEMM" is a checksum of each weight read from the arena (a smoke
//! test of the same path; the host backend's device memory is host memory, so its RSS includes
//! the GPU budget).

use std::error::Error;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use ddo_core::StreamId;
use ddo_session::{ComponentSession, SessionSpec, Weights, testing};
use ddo_source::MmapChoice;

#[path = "../../ddo-arena/examples/common/gemm.rs"]
mod gemm;

struct Args {
    size_gib: f64,
    width: u64,
    tokens: u64,
    budget_gib: f64,
    staging_gib: f64,
    passes: usize,
    dir: PathBuf,
    cuda: bool,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        size_gib: 8.0,
        width: 4096,
        tokens: 4096,
        budget_gib: 1.5,
        staging_gib: 0.625,
        passes: 4,
        dir: std::env::temp_dir(),
        cuda: ddo_platform::cuda::driver_present(),
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().cloned().ok_or(format!("{flag} needs a value"));
        let number = |v: String| v.parse::<f64>().map_err(|_| format!("{flag} takes a number"));
        match flag.as_str() {
            "--size-gib" => a.size_gib = number(value()?)?,
            "--width" => a.width = number(value()?)? as u64,
            "--tokens" => a.tokens = number(value()?)? as u64,
            "--budget-gib" => a.budget_gib = number(value()?)?,
            "--staging-gib" => a.staging_gib = number(value()?)?,
            "--passes" => a.passes = number(value()?)? as usize,
            "--dir" => a.dir = PathBuf::from(value()?),
            "--device" => match value()?.as_str() {
                "cuda" => a.cuda = true,
                "cpu" => a.cuda = false,
                other => return Err(format!("--device takes cuda or cpu, not {other}")),
            },
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("disk_gemm: {e}");
        std::process::exit(1);
    }
}

/// The GEMM chain of one pass on CUDA: `x <- W x` for every weight of every unit, in order.
struct Chain {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
    width: u64,
    tokens: u64,
    x: [CudaSlice<u16>; 2],
    init: Vec<u16>,
}

/// What one pass computes with each weight: a GEMM on CUDA, a checksum on the host backend.
enum Compute {
    Cuda(Chain),
    Host,
}

impl Compute {
    /// One pass (begin, acquire each streamed unit, compute with every weight, release, end),
    /// waited for; returns a digest of its output.
    fn pass(
        &mut self,
        session: &ComponentSession,
        stream: StreamId,
    ) -> Result<u64, Box<dyn Error>> {
        session.begin_pass(stream)?;
        let mut current = 0;
        let mut digest = 0u64;
        for unit in session.units()?.into_iter().filter(|u| !u.pinned) {
            let lease = session.acquire(unit.id, stream)?;
            let found =
                session.assignment().units.iter().find(|u| u.path == unit.name).ok_or("unit")?;
            for &p in &found.parameters {
                let name = &session.assignment().parameters[p].names[0];
                match self {
                    Compute::Cuda(chain) => {
                        let weight = session.tensor(name)?;
                        chain.gemm(weight.address, current)?;
                        current = 1 - current;
                    }
                    Compute::Host => {
                        let bytes = session.read_tensor(name)?;
                        let sum = bytes.iter().map(|&b| u64::from(b)).sum::<u64>();
                        digest = digest.rotate_left(7) ^ sum;
                    }
                }
            }
            session.release(lease, stream)?;
        }
        session.end_pass(stream)?;
        if let Compute::Cuda(chain) = self {
            chain.stream.synchronize()?;
            let out = chain.stream.clone_dtoh(&chain.x[current])?;
            digest = out.iter().fold(0u64, |h, &v| h.rotate_left(5) ^ u64::from(v));
        }
        Ok(digest)
    }

    /// Back to the initial activations.
    fn reset(&mut self) -> Result<(), Box<dyn Error>> {
        if let Compute::Cuda(chain) = self {
            let init = chain.init.clone();
            chain.stream.memcpy_htod(&init, &mut chain.x[0])?;
            chain.stream.synchronize()?;
        }
        Ok(())
    }

    /// The stream the session's work is ordered by.
    fn stream(&self, machine: &ddo_compose::Machine) -> Result<StreamId, Box<dyn Error>> {
        match self {
            Compute::Cuda(chain) => {
                let cuda = machine.cuda().ok_or("no CUDA device")?.clone();
                // SAFETY: the chain's stream is a live stream of the primary context, alive
                // until the end of run().
                Ok(unsafe { cuda.adopt_stream(chain.stream.cu_stream() as u64) })
            }
            Compute::Host => Ok(StreamId(0)),
        }
    }
}

impl Chain {
    fn gemm(&self, weight: u64, src: usize) -> Result<(), Box<dyn Error>> {
        let (x, _a) = self.x[src].device_ptr(&self.stream);
        let (y, _b) = self.x[1 - src].device_ptr(&self.stream);
        let (w, t) = (self.width as usize, self.tokens as usize);
        // SAFETY: the weight lies in a unit this pass holds a lease on (width x width bf16),
        // the activations were allocated for width x tokens bf16 of the primary context; the
        // handle runs on the stream the lease names.
        unsafe { gemm::bf16(&self.blas, w, t, weight, x, y) }?;
        Ok(())
    }
}

/// The plain sequential read speed of `path`, bytes per second, and how it was read: O_DIRECT
/// in 64 MiB requests from one thread where the file system allows, else buffered reads.
fn plain_read(path: &Path) -> Result<(f64, &'static str), Box<dyn Error>> {
    const REQUEST: usize = 64 << 20;
    const ALIGN: usize = 4096;
    let (mut file, how) =
        match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
            Ok(f) => (f, "O_DIRECT"),
            Err(_) => (std::fs::File::open(path)?, "buffered (no O_DIRECT here)"),
        };
    let mut buf = vec![0u8; REQUEST + ALIGN];
    let at = buf.as_ptr().align_offset(ALIGN);
    let t = Instant::now();
    let mut total = 0u64;
    loop {
        match file.read(&mut buf[at..at + REQUEST])? {
            0 => break,
            n => total += n as u64,
        }
    }
    Ok((total as f64 / t.elapsed().as_secs_f64(), how))
}

/// A `/proc/self/status` field in bytes (`VmHWM`: the peak resident set since the last reset).
fn status(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib * 1024)
}

fn run() -> Result<(), Box<dyn Error>> {
    let a = args()?;
    let device = if a.cuda { "cuda:0" } else { "cpu" };
    let tensor = a.width * a.width * 2;
    let per_block = 4;
    let blocks = ((a.size_gib * (1u64 << 30) as f64) as u64 / (per_block * tensor)).max(2);
    let path = a.dir.join("ddo-disk-gemm.safetensors");
    let mut tensors = vec![("embed.weight".to_owned(), vec![a.width, 8])];
    for b in 0..blocks {
        for w in 0..per_block {
            tensors.push((format!("blocks.{b}.w{w}.weight"), vec![a.width, a.width]));
        }
    }
    // Small positive bf16 values (about 1/64): the chain stays finite.
    testing::write_with(&path, &tensors, |t, i| {
        if i % 2 == 0 { ((i / 2 * 7 + t as u64) % 256) as u8 } else { 0x3c }
    })?;
    std::fs::File::open(&path)?.sync_all()?;
    let gib = (blocks * per_block * tensor) as f64 / (1u64 << 30) as f64;
    eprintln!(
        "checkpoint: {blocks} blocks of {per_block} x {}^2 bf16, {gib:.2} GiB, on {device}",
        a.width
    );

    let mut compute = if a.cuda {
        let ctx = CudaContext::new(0)?;
        let stream = ctx.new_stream()?;
        let elements = (a.width * a.tokens) as usize;
        let init: Vec<u16> = (0..elements).map(|i| 0x3c00 + (i % 97) as u16).collect();
        Compute::Cuda(Chain {
            blas: CudaBlas::new(stream.clone())?,
            width: a.width,
            tokens: a.tokens,
            x: [stream.clone_htod(&init)?, stream.alloc_zeros::<u16>(elements)?],
            init,
            stream,
        })
    } else {
        Compute::Host
    };
    // The composition root opens the device once; every session runs on its target.
    let machine = ddo_compose::Machine::for_plan(&ddo_session::resolve(
        "transformer",
        &[("backend", "vmm"), ("execution_device", device)],
    )?)?;
    let open = |args: &[(&str, &str)]| -> Result<ComponentSession, Box<dyn Error>> {
        let mut all = vec![("backend", "vmm"), ("execution_device", device)];
        all.extend_from_slice(args);
        let plan = ddo_session::resolve("transformer", &all)?;
        // SAFETY: this program does not modify its checkpoint while it is open.
        let mmap = unsafe { MmapChoice::auto() };
        let spec = SessionSpec {
            plan,
            weights: Weights::Checkpoint { path: path.clone(), mmap },
            tree: None,
        };
        Ok(ComponentSession::open(spec, machine.target())?)
    };
    // A warm pass, then the steady step: passes back to back, timed as one span.
    let mut measure = |session: &ComponentSession| -> Result<(u64, f64), Box<dyn Error>> {
        let stream = compute.stream(&machine)?;
        compute.reset()?;
        let digest = compute.pass(session, stream)?;
        let timed = a.passes.max(2) - 1;
        let t = Instant::now();
        for _ in 0..timed {
            compute.reset()?;
            compute.pass(session, stream)?;
        }
        Ok((digest, t.elapsed().as_secs_f64() / timed as f64))
    };

    let (disk_speed, how) = plain_read(&path)?;
    // The disk route first, with the peak RSS reset (clear_refs 5) so it is this phase's.
    let reset_peak = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let (budget, staging) = (a.budget_gib.to_string(), a.staging_gib.to_string());
    let disk = open(&[
        ("preset", "nvme_baseline"),
        ("vmm_resident_weight_budget_gb", &budget),
        ("vmm_staging_buffer_gb", &staging),
    ])?;
    let (disk_digest, step) = measure(&disk)?;
    let rss = status("VmHWM:").filter(|_| reset_peak);
    // Without shared memory: the host backend's device memory is shared (memfd) pages, counted
    // once per address range a slot is mapped at.
    let private = status("RssAnon:").zip(status("RssFile:")).map(|(a, f)| a + f);
    let m = disk.metrics(Some("disk_gemm"));
    disk.close()?;

    // Everything resident (the mapping): the reference output and the compute-only step.
    let resident_budget = (gib + 1.0).to_string();
    let resident = open(&[("vmm_resident_weight_budget_gb", &resident_budget)])?;
    let (reference, compute_step) = measure(&resident)?;
    resident.close()?;

    let per_pass = m.runtime.disk_bytes_per_pass.unwrap_or(0) as f64;
    let route_speed = per_pass / step;
    let floor = compute_step.max(per_pass / disk_speed);
    let ceiling = m.setup.staging_bytes.unwrap_or(0) as f64;
    let g = |b: f64| b / (1u64 << 30) as f64;
    println!("| measure | value |");
    println!("|---|---|");
    println!("| device | {device} |");
    println!(
        "| disk, plain sequential read ({how}, 64 MiB requests) | {:.2} GB/s |",
        disk_speed / 1e9
    );
    println!("| disk GiB read per pass | {:.2} |", g(per_pass));
    println!(
        "| route's disk speed (bytes per pass / step) | {:.2} GB/s = {:.3} x plain |",
        route_speed / 1e9,
        route_speed / disk_speed
    );
    if let Some(busy) = m.runtime.disk_bytes_per_second {
        println!("| route's disk speed while reading | {:.2} GB/s |", busy / 1e9);
    }
    println!(
        "| uploads waiting for reads | {:.4} s per pass |",
        m.runtime.read_stall_seconds.unwrap_or(0.0) / m.runtime.passes.unwrap_or(1).max(1) as f64
    );
    println!("| compute-only step (all resident) | {compute_step:.4} s |");
    println!("| floor max(compute, disk bytes / plain disk speed) | {floor:.4} s |");
    println!(
        "| disk route step ({} GiB GPU budget) | {step:.4} s = {:.3} x floor |",
        a.budget_gib,
        step / floor
    );
    println!(
        "| staging ({} buffers) | {:.3} GiB |",
        m.setup.staging_buffers.unwrap_or(0),
        g(ceiling)
    );
    match rss {
        Some(rss) => println!(
            "| peak host RSS of the disk route's phase | {:.3} GiB ({:.2} x the model) |",
            g(rss as f64),
            rss as f64 / (gib * (1u64 << 30) as f64)
        ),
        None => println!("| peak host RSS of the disk route's phase | not measurable here |"),
    }
    if let (false, Some(private)) = (a.cuda, private) {
        println!(
            "| host RSS at the phase's end without the host backend's device memory | {:.3} GiB |",
            g(private as f64)
        );
    }
    let identical = disk_digest == reference;
    println!("| output equals the resident run bit for bit | {identical} |");
    print!("{}", m.format_profile());
    std::fs::remove_file(&path)?;
    if identical {
        Ok(())
    } else {
        Err("the disk route's output differs from the resident run".into())
    }
}
