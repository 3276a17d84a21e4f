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
    println!("{}", format_presets());
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
    println!(
        "\nThis demo resolves plans only. Offloading a Diffusers model end to end arrives with the Python package (issue 5)."
    );
    Ok(())
}
