//! The demo: what ddo decides for a Diffusers pipeline on this machine.

use ddo_core::{AdmissionProbe, GIB, GrowthKind, GrowthRequest};
use ddo_metrics::{DynamicOffloadMetrics, GroupOffloadSetup, HostMemorySection, RouteSection};
use ddo_platform::LinuxAdmissionProbe;
use ddo_policy::{Environment, OffloadType, Placement, Request, Route, format_presets, resolve};

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
    let probe = LinuxAdmissionProbe::system();
    let observation = probe.observe();
    for component in ["text_encoder", "transformer", "vae"] {
        let request =
            Request { component, environment: Environment::from_process(), ..Request::default() };
        let plan = resolve(&request).map_err(|e| format!("{component}: {e}"))?;
        let mut metrics = DynamicOffloadMetrics::new(RouteSection {
            name: plan.route.name().into(),
            component: Some(plan.component.clone()),
            backend: Some(plan.backend.as_str().into()),
            requested_preset: Some(plan.requested_preset.as_str().into()),
            effective_preset: Some(plan.effective_preset.as_str().into()),
            execution_mode: Some(plan.execution_mode.as_str().into()),
        });
        metrics.configuration = plan.configuration();
        match plan.route {
            Route::DiffusersGroupOffload(g) => {
                metrics.setup.group_offload = Some(GroupOffloadSetup {
                    offload_type: g.offload_type.as_str().into(),
                    use_stream: g.use_stream,
                    record_stream: g.record_stream,
                    low_cpu_mem_usage: g.low_cpu_mem_usage,
                    num_blocks_per_group: (g.offload_type == OffloadType::BlockLevel)
                        .then_some(g.num_blocks_per_group),
                })
            }
            Route::None { placement } => {
                metrics.setup.placement = Some(
                    match placement {
                        Placement::Resident => "resident",
                        Placement::Unmanaged => "unmanaged",
                    }
                    .into(),
                )
            }
            _ => {}
        }
        metrics.host_memory = Some(HostMemorySection {
            observation: observation.clone(),
            phase: Some("plan".into()),
        });
        print!("{}", metrics.format_profile());
    }
    let request = GrowthRequest { kind: GrowthKind::Retained, bytes: GIB, registered_bytes: 0 };
    match probe.admit(&request).into_result() {
        Ok(headroom) => println!(
            "host admission: 1 GiB of retained storage would be granted ({:.2} GiB left after it)",
            headroom as f64 / GIB as f64
        ),
        Err(refusal) => println!("host admission: {refusal}"),
    }
    stream_checkpoint()
}

/// Streams a generated Flux-shaped checkpoint through a small arena, on the GPU when a CUDA
/// driver exists and on the host backend otherwise, checks the bytes every unit delivers, and
/// prints the profile.
fn stream_checkpoint() -> Result<(), String> {
    use std::sync::Arc;

    use ddo_arena::{Arena, Budget, UnitSpec};
    use ddo_core::{Platform, UnitId, WeightSource};
    use ddo_metrics::SetupSection;
    use ddo_source::{Checkpoint, CheckpointSource};

    let dir = std::path::Path::new("target/demo");
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let path = dir.join("flux-shaped.safetensors");
    let (blocks, width) = (19usize, 512usize);
    write_checkpoint(&path, blocks, width)?;
    let (platform, _keep): (Platform, Box<dyn std::any::Any>) = match ddo_platform::cuda_platform(0)
    {
        Ok((p, d)) => (p, Box::new(d)),
        Err(e) => {
            println!("\nGPU: {e}; streaming on the host backend");
            let d = Arc::new(ddo_platform::host::HostDevice::new());
            (ddo_platform::host_platform(d.clone()), Box::new(d))
        }
    };
    let checkpoint = Arc::new(Checkpoint::open(&path).map_err(|e| e.to_string())?);
    // SAFETY: the demo does not modify its checkpoint while it is mapped.
    let source: Arc<dyn WeightSource> =
        Arc::new(unsafe { CheckpointSource::with_mmap(checkpoint, 4) }.map_err(|e| e.to_string())?);
    let units = UnitSpec::by_block(source.slices());
    let budget = Budget { total: 48 << 20, headroom: 4 << 20, prefetch_depth: 3 };
    let arena = Arena::new(&platform, source.clone(), &units, budget).map_err(|e| e.to_string())?;
    let stream = platform.residency.create_stream().map_err(|e| e.to_string())?;
    for _ in 0..3 {
        arena.begin_pass();
        for u in 0..arena.layout().units.len() as u32 {
            let lease = arena.acquire(UnitId(u), stream).map_err(|e| e.to_string())?;
            for t in &arena.layout().units[u as usize].tensors {
                let (_, range) = arena.tensor_range(t.slice).ok_or("tensor without a range")?;
                let mut got = vec![0u8; range.len as usize];
                platform.residency.read_back(range, &mut got).map_err(|e| e.to_string())?;
                let mut want = vec![0u8; range.len as usize];
                source.read(t.slice, &mut want).map_err(|e| e.to_string())?;
                if got != want {
                    return Err(format!("unit {u}: device bytes differ from the checkpoint"));
                }
            }
            arena.release(lease, stream).map_err(|e| e.to_string())?;
        }
    }
    let plan = arena.plan();
    let mut m = DynamicOffloadMetrics::new(RouteSection {
        name: "vmm_fast_runtime".into(),
        component: Some("transformer".into()),
        backend: Some(format!("vmm ({})", platform.name)),
        ..RouteSection::default()
    });
    m.setup = SetupSection {
        unit_count: Some(arena.layout().units.len() as u64),
        total_bytes: Some(arena.layout().payload()),
        resident_units: Some(plan.resident.iter().filter(|r| **r).count() as u64),
        streamed_units: Some(plan.streamed_units() as u64),
        execution_slots: Some(u64::from(plan.slots)),
        slot_bytes: Some(plan.slot_len),
        gpu_budget_bytes: Some(budget.total),
        headroom_bytes: Some(budget.headroom),
        streamed_bytes_per_pass: Some(plan.streamed_bytes),
        ..SetupSection::default()
    };
    m.runtime = arena.stats().runtime_section();
    m.validate().map_err(|e| e.to_string())?;
    println!(
        "\nStreamed a Flux-shaped checkpoint ({blocks} blocks, {:.1} MiB) through a {} MiB arena, 3 passes, every unit's bytes checked:",
        arena.layout().payload() as f64 / (1 << 20) as f64,
        budget.total >> 20
    );
    print!("{}", m.format_profile());
    arena.close().map_err(|e| e.to_string())
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
