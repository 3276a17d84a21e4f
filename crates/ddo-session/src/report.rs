//! The metrics snapshot of a session, assembled in one place from a view of the session
//! ([`SessionView`]): the report reads plain values and knows nothing of the session's state.

use ddo_arena::ArenaStats;
use ddo_metrics::{
    DynamicOffloadMetrics, ExecutionSection, GroupOffloadSetup, HostMemorySection, RuntimeSection,
    SetupSection,
};
use ddo_policy::{OffloadType, Placement, Plan, Route};
use ddo_source::{ConversionReport, EncodingReport, PackReport, RetainedReport};

/// The snapshot a plan alone gives: route, configuration, what a route applied by the host
/// (Diffusers' hooks, none) is set to do, the plan's warnings, and the host-memory observation
/// labelled `phase`. Routes the host applies add what they observed to `setup` and `runtime`.
pub fn plan_snapshot(plan: &Plan, phase: Option<&str>) -> DynamicOffloadMetrics {
    let mut m = DynamicOffloadMetrics::new(ExecutionSection {
        route: plan.route.name().to_owned(),
        component: Some(plan.component.clone()),
        backend: Some(plan.backend.as_str().to_owned()),
        requested_preset: Some(plan.requested_preset.as_str().to_owned()),
        effective_preset: Some(plan.effective_preset.as_str().to_owned()),
        execution_mode: Some(plan.execution_mode.as_str().to_owned()),
    });
    m.configuration = plan.configuration();
    match plan.route {
        Route::DiffusersGroupOffload(g) => {
            m.setup.group_offload = Some(GroupOffloadSetup {
                offload_type: g.offload_type.as_str().into(),
                use_stream: g.use_stream,
                record_stream: g.record_stream,
                low_cpu_mem_usage: g.low_cpu_mem_usage,
                num_blocks_per_group: (g.offload_type == OffloadType::BlockLevel)
                    .then_some(g.num_blocks_per_group),
            })
        }
        Route::None { placement } => {
            m.setup.placement = Some(
                match placement {
                    Placement::Resident => "resident",
                    Placement::Unmanaged => "unmanaged",
                }
                .into(),
            )
        }
        _ => {}
    }
    m.setup.warnings = (!plan.warnings.is_empty()).then(|| plan.warnings.clone());
    m.host_memory = phase.map(observe);
    m
}

fn observe(phase: &str) -> HostMemorySection {
    HostMemorySection {
        observation: ddo_core::AdmissionProbe::observe(&ddo_platform::LinuxAdmissionProbe::system()),
        phase: Some(phase.to_owned()),
    }
}

/// What the snapshot reads of a session.
pub(crate) struct SessionView<'a> {
    /// Modules of the module tree, when one was given.
    pub(crate) module_count: Option<u64>,
    /// The measured host-to-device link, bytes per second.
    pub(crate) link: Option<f64>,
    /// The device's PyTorch name.
    pub(crate) execution_device: String,
    /// Warnings for the host to show.
    pub(crate) warnings: &'a [String],
    /// The current attach; `None` while unloaded.
    pub(crate) attached: Option<AttachedView<'a>>,
}

/// Seconds the attach's stages took, and the bytes read in.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SetupStages {
    /// Opening the source: headers, host tier, retained windows or staging, conversions and
    /// encodings at load.
    pub(crate) source_seconds: f64,
    /// Bytes of file mappings read in before registration (a cold file arrives here).
    pub(crate) read_in_bytes: u64,
    /// Seconds the read-in of those bytes took (overlapping registration).
    pub(crate) read_in_seconds: f64,
    /// Seconds registration took, waits for the read-in included.
    pub(crate) registration_seconds: f64,
    /// Seconds the resident units took to upload.
    pub(crate) resident_seconds: f64,
}

/// What the snapshot reads of one attach.
pub(crate) struct AttachedView<'a> {
    pub(crate) stats: ddo_arena::ArenaStats,
    pub(crate) plan: &'a ddo_arena::ResidencyPlan,
    pub(crate) unit_count: u64,
    pub(crate) registered: u64,
    pub(crate) unregistered: u64,
    pub(crate) unregistered_reason: Option<&'a str>,
    pub(crate) retained: Option<&'a RetainedReport>,
    pub(crate) packed: PackReport,
    pub(crate) conversion: Option<ConversionReport>,
    pub(crate) device_conversions: u64,
    pub(crate) host_short: bool,
    pub(crate) staging_short: bool,
    pub(crate) not_packed: Option<&'a str>,
    pub(crate) host_kind: &'static str,
    pub(crate) read_workers: Option<u64>,
    /// The staging pool's counters and whether it reads with O_DIRECT.
    pub(crate) staging: Option<(ddo_source::StagingStats, bool)>,
    pub(crate) staging_note: Option<&'a str>,
    pub(crate) tier_reason: Option<&'a str>,
    pub(crate) encoding_note: Option<&'a str>,
    pub(crate) encoding: Option<&'a EncodingReport>,
    pub(crate) setup_seconds: f64,
    pub(crate) stages: SetupStages,
    pub(crate) peer: Option<ddo_arena::PeerStoreReport>,
    /// Per unit: held by the peer weight store.
    pub(crate) peer_stored: Vec<bool>,
    pub(crate) peer_note: Option<&'a str>,
    pub(crate) peer_link: Option<f64>,
    pub(crate) total_bytes: u64,
    pub(crate) tensor_count: u64,
}

/// The snapshot of a session: `m` (its plan's, [`plan_snapshot`]) with what `session` shows.
pub(crate) fn snapshot(
    mut m: DynamicOffloadMetrics,
    session: &SessionView<'_>,
) -> DynamicOffloadMetrics {
    let mut setup = SetupSection {
        module_count: session.module_count,
        link_bytes_per_second: session.link,
        execution_device: Some(session.execution_device.clone()),
        warnings: (!session.warnings.is_empty()).then(|| session.warnings.to_vec()),
        ..SetupSection::default()
    };
    let mut fill = |a: Option<&AttachedView<'_>>| {
        let Some(a) = a else {
            setup.host_source = Some("unloaded".into());
            return;
        };
        let streamed_bytes = a.plan.streamed_bytes;
        setup.tensor_count = Some(a.tensor_count);
        setup.total_bytes = Some(a.total_bytes);
        setup.setup_seconds = Some(a.setup_seconds);
        let st = a.stages;
        setup.source_seconds = Some(st.source_seconds);
        setup.read_in_bytes = (st.read_in_bytes > 0).then_some(st.read_in_bytes);
        setup.read_in_seconds = (st.read_in_bytes > 0).then_some(st.read_in_seconds);
        setup.registration_seconds = Some(st.registration_seconds);
        setup.resident_upload_seconds = Some(st.resident_seconds);
        setup.unit_count = Some(a.unit_count);
        setup.resident_units = Some(a.plan.resident.iter().filter(|r| **r).count() as u64);
        setup.streamed_units = Some(a.plan.streamed_units() as u64);
        setup.unit_tiers = Some(unit_tiers(a));
        setup.execution_slots = Some(u64::from(a.plan.slots));
        setup.slot_bytes = Some(a.plan.slot_len);
        setup.gpu_budget_bytes = Some(a.plan.budget.total);
        setup.headroom_bytes = Some(a.plan.budget.headroom);
        setup.streamed_bytes_per_pass = Some(streamed_bytes);
        setup.expected_copy_floor_seconds = session.link.map(|l| streamed_bytes as f64 / l);
        setup.registered_bytes = Some(a.registered);
        setup.unregistered_bytes = Some(a.unregistered);
        setup.unregistered_reason = a.unregistered_reason.map(str::to_owned);
        setup.retained_bytes = a.retained.map(|r| r.retained_bytes);
        setup.unretained_bytes = a.retained.map(|r| r.unretained_bytes);
        setup.packed_bytes = a.host_kind.starts_with("host_tensors").then_some(a.packed.bytes);
        setup.host_source = Some(a.host_kind.to_owned());
        setup.host_tier_reason = a.tier_reason.map(str::to_owned);
        setup.read_workers = a.read_workers;
        let on_device = a.device_conversions;
        if let Some(c) = a.conversion {
            setup.converted_tensors = Some(c.tensors);
            setup.conversion_source_bytes = Some(c.source_bytes);
            setup.converted_bytes = Some(c.bytes);
            setup.conversion_seconds = Some(c.seconds);
        }
        setup.conversion = match (a.conversion.is_some(), on_device > 0) {
            (true, true) => Some("host+device".into()),
            (true, false) => Some("host".into()),
            (false, true) => Some("device".into()),
            (false, false) => None,
        };
        if on_device > 0 {
            setup.device_converted_tensors = Some(on_device);
            *setup.converted_tensors.get_or_insert(0) += on_device;
        }
        if a.staging_short {
            setup.warnings.get_or_insert_with(Vec::new).push(
                "the GPU budget has no room for the staging buffers of conversion on the device: tensors were widened at load on the host (raise the budget, or set dtype_conversion)".into(),
            );
        }
        if a.host_short {
            setup.warnings.get_or_insert_with(Vec::new).push(
                "the host could not hold the checkpoint converted to the module's dtypes: its tensors stream as stored and are converted on the device after each upload".into(),
            );
        }
        setup.weight_encoding = a.encoding_note.map(str::to_owned);
        if let Some(e) = a.encoding {
            setup.encoded_tensors = Some(e.tensors);
            setup.encoding_source_bytes = Some(e.source_bytes);
            setup.encoded_bytes = Some(e.encoded_bytes);
            setup.encoding_seconds = Some(e.seconds);
            setup.encoded_file = e.file.as_ref().map(|f| f.display().to_string());
        }
        if let Some(p) = a.peer {
            setup.peer_store_device = Some(p.device.to_string());
            setup.peer_store_units = Some(u64::from(p.units));
            setup.peer_store_bytes = Some(p.bytes);
            setup.peer_store_host_units = Some(u64::from(p.host_units));
            setup.peer_link_bytes_per_second = a.peer_link;
        }
        if let Some(note) = a.peer_note {
            setup.warnings.get_or_insert_with(Vec::new).push(note.to_owned());
        }
        if let Some(note) = a.staging_note {
            setup.warnings.get_or_insert_with(Vec::new).push(note.to_owned());
        }
        if let Some(reason) = a.not_packed {
            setup.warnings.get_or_insert_with(Vec::new).push(reason.to_owned());
        }
        let mut runtime = runtime_section(&a.stats);
        runtime.passes = Some(a.stats.passes);
        if a.peer.is_some() {
            runtime.peer_uploads = Some(a.stats.peer_uploads);
            runtime.peer_upload_bytes = Some(a.stats.peer_upload_bytes);
        }
        // Only routes that read the disk into staging have disk counters (absent otherwise).
        if let Some((staging, direct)) = a.staging {
            setup.staging_bytes = Some(staging.bytes);
            setup.staging_buffers = Some(staging.buffers);
            setup.staging_read = Some(if direct { "direct" } else { "pread" }.into());
            runtime.disk_bytes = Some(staging.disk_bytes);
            runtime.disk_bytes_per_pass = Some(staging.disk_bytes / a.stats.passes.max(1));
            runtime.disk_read_seconds = Some(staging.disk_seconds);
            runtime.disk_bytes_per_second = (staging.disk_seconds > 0.0)
                .then(|| staging.disk_bytes as f64 / staging.disk_seconds);
            runtime.read_stall_seconds = Some(staging.stall_seconds);
            runtime.disk_reads_on_demand = Some(staging.on_demand + staging.gave_up);
        }
        m.runtime = runtime;
    };
    fill(session.attached.as_ref());
    m.setup = setup;
    m
}

/// The runtime section of a native route's metrics: the arena's counters every arena has (the
/// peer store's and the disk's are added where the route has them).
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

/// Where each unit's weights come from, as ranges of unit ids (`session.units()` order) per
/// tier: `device` (resident), `peer` (streamed from the peer weight store), and the host tier
/// that feeds the rest (`mapping`, `retained`, `disk`...), e.g. `device=0-3,5 mapping=4,6-9`.
fn unit_tiers(a: &AttachedView<'_>) -> String {
    let tier = |i: usize| -> &str {
        if a.plan.resident[i] {
            "device"
        } else if a.peer_stored.get(i).copied().unwrap_or(false) {
            "peer"
        } else {
            a.host_kind
        }
    };
    let mut tiers: Vec<(&str, Vec<(usize, usize)>)> = Vec::new();
    for i in 0..a.plan.resident.len() {
        let t = tier(i);
        let at = match tiers.iter().position(|(name, _)| *name == t) {
            Some(at) => at,
            None => {
                tiers.push((t, Vec::new()));
                tiers.len() - 1
            }
        };
        let runs = &mut tiers[at].1;
        match runs.last_mut() {
            Some(run) if run.1 + 1 == i => run.1 = i,
            _ => runs.push((i, i)),
        }
    }
    tiers
        .iter()
        .map(|(name, runs)| {
            let runs: Vec<String> = runs
                .iter()
                .map(|&(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") })
                .collect();
            format!("{name}={}", runs.join(","))
        })
        .collect::<Vec<_>>()
        .join(" ")
}
