//! Streams a generated safetensors checkpoint through a component session on a CUDA GPU, with
//! a cuBLAS GEMM on every weight of every unit while the next units upload, and checks that the
//! result equals the same chain run with every unit resident, bit for bit. Prints step times
//! against the copy floor and the session's profile.
//!
//! ```sh
//! cargo run --release -p ddo-session --example session_gemm -- [--size-gib 4] [--width 4096]
//!     [--tokens 4096] [--budget-gib 1.5] [--passes 8] [--dir DIR]
//! ```
//!
//! Needs a CUDA driver and cuBLAS (`libcublas.so` on the library path).

use std::error::Error;
use std::path::PathBuf;
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
    passes: usize,
    dir: PathBuf,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        size_gib: 4.0,
        width: 4096,
        tokens: 4096,
        budget_gib: 1.5,
        passes: 8,
        dir: std::env::temp_dir(),
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
            "--passes" => a.passes = number(value()?)? as usize,
            "--dir" => a.dir = PathBuf::from(value()?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("session_gemm: {e}");
        std::process::exit(1);
    }
}

/// The GEMM chain of one pass: `x <- W x` for every weight of every unit, in order.
struct Chain {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
    width: u64,
    tokens: u64,
    x: [CudaSlice<u16>; 2],
}

impl Chain {
    /// One pass: begin, acquire each streamed unit (the resident ones are leased for the pass),
    /// a GEMM per weight, release, end; waits until its work completed. Returns the index of the
    /// buffer holding the output.
    fn pass(&self, session: &ComponentSession, stream: StreamId) -> Result<usize, Box<dyn Error>> {
        let resident = session.begin_pass(stream)?;
        let mut current = 0;
        for unit in session.units()?.into_iter().filter(|u| !u.pinned) {
            let lease = if resident.contains(&unit.id) {
                session.reached(unit.id)?;
                None
            } else {
                Some(session.acquire(unit.id, stream)?)
            };
            let found =
                session.assignment().units.iter().find(|u| u.path == unit.name).ok_or("unit")?;
            for &p in &found.parameters {
                let weight = session.tensor(&session.assignment().parameters[p].names[0])?;
                self.gemm(weight.address, current)?;
                current = 1 - current;
            }
            if let Some(lease) = lease {
                session.release(lease, stream)?;
            }
        }
        session.end_pass(stream)?;
        self.stream.synchronize()?;
        Ok(current)
    }

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

fn run() -> Result<(), Box<dyn Error>> {
    let a = args()?;
    let tensor = a.width * a.width * 2;
    let per_block = 4;
    let blocks = ((a.size_gib * (1u64 << 30) as f64) as u64 / (per_block * tensor)).max(2);
    let path = a.dir.join("ddo-session-gemm.safetensors");
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
    let gib = (blocks * per_block * tensor) as f64 / (1u64 << 30) as f64;
    eprintln!("checkpoint: {blocks} blocks of {per_block} x {}^2 bf16, {gib:.2} GiB", a.width);

    let ctx = CudaContext::new(0)?;
    let compute = ctx.new_stream()?;
    // The composition root opens the device once; every session runs on its target, and its
    // CUDA handle adopts the compute stream.
    let machine = ddo_compose::Machine::for_plan(&ddo_session::resolve(
        "transformer",
        &[("backend", "vmm"), ("execution_device", "cuda:0")],
    )?)?;
    let open = |budget_gib: f64| -> Result<ComponentSession, Box<dyn Error>> {
        let budget = budget_gib.to_string();
        let plan = ddo_session::resolve(
            "transformer",
            &[
                ("backend", "vmm"),
                ("execution_device", "cuda:0"),
                ("vmm_resident_weight_budget_gb", &budget),
            ],
        )?;
        // SAFETY: this program does not modify its checkpoint while it is mapped.
        let mmap = unsafe { MmapChoice::auto() };
        let spec = SessionSpec {
            plan,
            weights: Weights::Checkpoint { path: path.clone(), mmap },
            tree: None,
        };
        Ok(ComponentSession::open(spec, machine.target())?)
    };
    let elements = (a.width * a.tokens) as usize;
    let init: Vec<u16> = (0..elements).map(|i| 0x3c00 + (i % 97) as u16).collect();
    let chain = Chain {
        blas: CudaBlas::new(compute.clone())?,
        stream: compute.clone(),
        width: a.width,
        tokens: a.tokens,
        x: [compute.clone_htod(&init)?, compute.alloc_zeros::<u16>(elements)?],
    };
    let mut chain = chain;
    let reset = |chain: &mut Chain| -> Result<(), Box<dyn Error>> {
        compute.memcpy_htod(&init, &mut chain.x[0])?;
        compute.synchronize()?;
        Ok(())
    };

    // The output of one pass from the initial activations, and the steady step: passes run back
    // to back (nothing between them, as a sampler's steps), timed as one span after a warm pass.
    let mut measure = |session: &ComponentSession| -> Result<(Vec<u16>, f64), Box<dyn Error>> {
        let cuda = machine.cuda().ok_or("no CUDA device")?.clone();
        // SAFETY: `compute` is a live stream of the primary context, alive until the end of run().
        let stream = unsafe { cuda.adopt_stream(compute.cu_stream() as u64) };
        reset(&mut chain)?;
        let out = chain.pass(session, stream)?;
        let output = compute.clone_dtoh(&chain.x[out])?;
        let timed = a.passes.max(2) - 1;
        let t = Instant::now();
        for _ in 0..timed {
            chain.pass(session, stream)?;
        }
        Ok((output, t.elapsed().as_secs_f64() / timed as f64))
    };
    // Everything resident: the reference output and the compute-only step.
    let resident = open(gib + 1.0)?;
    let (reference, compute_step) = measure(&resident)?;
    resident.close()?;

    let streamed = open(a.budget_gib)?;
    let (first, step) = measure(&streamed)?;
    let (again, _) = measure(&streamed)?;
    let identical = first == reference && again == reference;
    let m = streamed.metrics(Some("session_gemm"));
    let bytes = m.setup.streamed_bytes_per_pass.unwrap_or(0) as f64;
    let link = m.setup.link_bytes_per_second.unwrap_or(f64::NAN);
    let floor = compute_step.max(bytes / link);
    println!("| measure | value |");
    println!("|---|---|");
    println!("| link (pinned 64 MiB copy) | {:.1} GB/s |", link / 1e9);
    println!("| compute-only step (all resident) | {compute_step:.4} s |");
    println!("| streamed GiB per pass | {:.2} |", bytes / (1u64 << 30) as f64);
    println!("| floor max(compute, streamed / link) | {floor:.4} s |");
    println!(
        "| streamed step ({} GiB budget) | {step:.4} s = {:.3} x floor |",
        a.budget_gib,
        step / floor
    );
    println!("| output equals the resident run bit for bit | {identical} |");
    print!("{}", m.format_profile());
    streamed.close()?;
    if identical { Ok(()) } else { Err("streamed output differs from the resident run".into()) }
}
