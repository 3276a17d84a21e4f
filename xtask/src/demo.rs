//! The demo: what ddo decides for a Diffusers pipeline on this machine.

use ddo_core::{GIB, GrowthKind, GrowthRequest, StreamId, WeightSource};
use ddo_policy::{Environment, Request, format_presets, resolve};
use ddo_session::{SessionSpec, Weights};
use ddo_source::{Checkpoint, CheckpointSource, MmapChoice, ReadOptions};

/// Resolves the plan of a text-encoder + transformer + VAE pipeline under this process's `DDO_*`
/// environment and prints each component's profile with a host-memory observation.
pub(crate) fn run(args: &[String]) -> Result<(), String> {
    if !args.is_empty() {
        return Err(format!(
            "demo takes no arguments (got {args:?}); set DDO_* variables to change the plan"
        ));
    }
    crate::python::ensure_env()?;
    crate::python::build_and_install_wheel()?;
    let py = crate::python::python().to_string_lossy().into_owned();
    crate::run(&py, &["crates/ddo-py/examples/demo.py"])?;
    println!("\n{}", format_presets());
    for component in ["text_encoder", "transformer", "vae"] {
        let request =
            Request { component, environment: Environment::from_process(), ..Request::default() };
        let plan = resolve(&request).map_err(|e| format!("{component}: {e}"))?;
        print!("{}", ddo_session::plan_snapshot(&plan, Some("plan")).format_profile());
    }
    let request = GrowthRequest { kind: GrowthKind::Retained, bytes: GIB, registered_bytes: 0 };
    match ddo_compose::host_admission(None).admit(&request).into_result() {
        Ok(headroom) => println!(
            "host admission: 1 GiB of retained storage would be granted ({:.2} GiB left after it)",
            headroom as f64 / GIB as f64
        ),
        Err(refusal) => println!("host admission: {refusal}"),
    }
    stream_checkpoint()
}

/// Streams a generated Flux-shaped checkpoint through a component session with a small arena,
/// on the GPU when a CUDA driver exists and on the host backend otherwise, checks the bytes of
/// every unit against the checkpoint under its lease, and prints the profile.
fn stream_checkpoint() -> Result<(), String> {
    let dir = std::path::Path::new("target/demo");
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let path = dir.join("flux-shaped.safetensors");
    let (blocks, width) = (19usize, 512usize);
    write_checkpoint(&path, blocks, width)?;
    let device = if ddo_compose::cuda_driver_present() { "cuda:0" } else { "cpu" };
    let plan = ddo_session::resolve(
        "transformer",
        &[
            ("backend", "vmm"),
            ("execution_device", device),
            ("vmm_resident_weight_budget_gb", "0.046875"),
            ("auto_vram_headroom_gb", "0.00390625"),
            ("prefetch_depth", "3"),
        ],
    )
    .map_err(|e| e.to_string())?;
    // SAFETY: the demo does not modify its checkpoint while it is mapped.
    let mmap = unsafe { MmapChoice::auto() };
    let weights = Weights::Checkpoint { path: path.clone(), mmap };
    let session =
        ddo_compose::open(SessionSpec { plan, weights, tree: None }).map_err(|e| e.to_string())?;
    let reference = CheckpointSource::new(
        std::sync::Arc::new(Checkpoint::open(&path).map_err(|e| e.to_string())?),
        ReadOptions::pread(),
    )
    .map_err(|e| e.to_string())?;
    let check = |name: &str| -> Result<(), String> {
        let i = reference.slices().iter().position(|s| s.name == name).ok_or("no such tensor")?;
        let mut want = vec![0u8; reference.slices()[i].len as usize];
        reference.read(i, &mut want).map_err(|e| e.to_string())?;
        let got = session.read_tensor(name).map_err(|e| e.to_string())?;
        if got != want {
            return Err(format!("{name}: device bytes differ from the checkpoint"));
        }
        Ok(())
    };
    let names: Vec<String> = reference.slices().iter().map(|s| s.name.clone()).collect();
    // The legacy default stream on CUDA; any value on the host backend (synchronous).
    let stream = StreamId(0);
    for _ in 0..3 {
        session.begin_pass(stream).map_err(|e| e.to_string())?;
        for unit in session.units().map_err(|e| e.to_string())? {
            let lease = (!unit.pinned)
                .then(|| session.acquire(unit.id, stream))
                .transpose()
                .map_err(|e| e.to_string())?;
            let prefix = format!("{}.", unit.name);
            for name in names.iter().filter(|n| unit.pinned != n.starts_with("transformer_blocks."))
            {
                if unit.pinned || name.starts_with(&prefix) {
                    check(name)?;
                }
            }
            if let Some(lease) = lease {
                session.release(lease, stream).map_err(|e| e.to_string())?;
            }
        }
        session.end_pass(stream).map_err(|e| e.to_string())?;
    }
    let m = session.metrics(Some("demo"));
    m.validate().map_err(|e| e.to_string())?;
    println!(
        "\nStreamed a Flux-shaped checkpoint ({blocks} blocks, {:.1} MiB) through a 48 MiB arena on {device}, 3 passes, every unit's bytes checked:",
        m.setup.total_bytes.unwrap_or(0) as f64 / (1 << 20) as f64,
    );
    print!("{}", m.format_profile());
    session.close().map_err(|e| e.to_string())
}

/// Writes `blocks` Flux-like blocks of BF16 weights plus input/output projections.
fn write_checkpoint(path: &std::path::Path, blocks: usize, width: usize) -> Result<(), String> {
    let mut tensors: Vec<(String, Vec<usize>)> = vec![
        ("x_embedder.weight".into(), vec![width, 64]),
        ("proj_out.weight".into(), vec![64, width]),
    ];
    for b in 0..blocks {
        for (part, shape) in [
            ("attn.to_qkv.weight", vec![3 * width, width]),
            ("attn.to_out.weight", vec![width, width]),
            ("ff.net.0.proj.weight", vec![4 * width, width]),
            ("ff.net.2.weight", vec![width, 4 * width]),
            ("norm1.linear.weight", vec![6 * width, width]),
        ] {
            tensors.push((format!("transformer_blocks.{b}.{part}"), shape));
        }
    }
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for (name, shape) in &tensors {
        let len = shape.iter().product::<usize>() as u64 * 2;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut json = serde_json::to_vec(&header).map_err(|e| e.to_string())?;
    while !(json.len() + 8).is_multiple_of(256) {
        json.push(b' ');
    }
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    let mut x = 0x9e37_79b9u32;
    bytes.extend((0..offset).map(|_| {
        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (x >> 24) as u8
    }));
    std::fs::write(path, bytes).map_err(|e| format!("writing {}: {e}", path.display()))
}
