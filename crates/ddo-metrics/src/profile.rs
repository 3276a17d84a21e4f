//! The text profile.

use std::fmt::Write;

use ddo_core::GIB;

use crate::DynamicOffloadMetrics;

/// One `  name=key=value key=value` line; empty lines are not printed.
struct Line {
    name: &'static str,
    fields: Vec<String>,
}

impl Line {
    fn new(name: &'static str) -> Self {
        Line { name, fields: Vec::new() }
    }

    fn text(mut self, key: &str, value: Option<impl AsRef<str>>) -> Self {
        if let Some(v) = value {
            self.fields.push(format!("{key}={}", v.as_ref()));
        }
        self
    }

    fn count(self, key: &str, value: Option<u64>) -> Self {
        self.text(key, value.map(|v| v.to_string()))
    }

    fn gib(self, key: &str, bytes: Option<u64>) -> Self {
        self.text(key, bytes.map(|b| format!("{:.4}", b as f64 / GIB as f64)))
    }

    fn seconds(self, key: &str, value: Option<f64>) -> Self {
        self.text(key, value.map(|s| format!("{s:.6}")))
    }

    fn flag(self, key: &str, value: Option<bool>) -> Self {
        self.text(key, value.map(|b| if b { "1" } else { "0" }))
    }

    fn render(self, out: &mut String, suffix: &str) {
        if !self.fields.is_empty() {
            let _ = writeln!(out, "  {}={}{suffix}", self.name, self.fields.join(" "));
        }
    }
}

/// Renders the profile: two fixed lines (`DDO profile`, schema and route), then one line per
/// group of present values, in a fixed order. A line whose values are all absent is left out,
/// so the text never shows a counter the route does not have. Sizes are GiB with four decimals.
pub fn format_profile(m: &DynamicOffloadMetrics) -> String {
    let mut out = String::from("DDO profile\n");
    let _ = write!(out, "  schema={} route={}", m.schema_version, m.route);
    let r = m.execution.clone().unwrap_or_default();
    if !r.route.is_empty() && r.route != m.route {
        let _ = write!(out, " runtime={}", r.route);
    }
    if let Some(c) = &r.component {
        let _ = write!(out, " component={c}");
    }
    out.push('\n');
    if let (Some(req), Some(eff)) = (&r.requested_preset, &r.effective_preset) {
        let _ = write!(out, "  preset={req} -> {eff}");
        if let Some(b) = &r.backend {
            let _ = write!(out, " backend={b}");
        }
        if let Some(mode) = &r.execution_mode {
            let _ = write!(out, " mode={mode}");
        }
        out.push('\n');
    }

    let s = &m.setup;
    Line::new("setup")
        .count("modules", s.module_count)
        .count("tensors", s.tensor_count)
        .gib("total_gib", s.total_bytes)
        .seconds("seconds", s.setup_seconds)
        .count("source_bound_tensors", s.source_bound_tensors)
        .text("device", s.execution_device.as_ref())
        .render(&mut out, "");
    Line::new("setup_stages")
        .seconds("source_seconds", s.source_seconds)
        .gib("read_in_gib", s.read_in_bytes)
        .seconds("read_in_seconds", s.read_in_seconds)
        .seconds("registration_seconds", s.registration_seconds)
        .seconds("resident_seconds", s.resident_upload_seconds)
        .render(&mut out, "");
    Line::new("plan")
        .count("units", s.unit_count)
        .count("resident_units", s.resident_units)
        .count("streamed_units", s.streamed_units)
        .count("slots", s.execution_slots)
        .gib("slot_gib", s.slot_bytes)
        .gib("budget_gib", s.gpu_budget_bytes)
        .gib("headroom_gib", s.headroom_bytes)
        .gib("streamed_gib_per_pass", s.streamed_bytes_per_pass)
        .text("link_gb_per_s", s.link_bytes_per_second.map(|b| format!("{:.1}", b / 1e9)))
        .seconds("copy_floor_seconds", s.expected_copy_floor_seconds)
        .render(&mut out, "");
    Line::new("tiers").text("units", s.unit_tiers.as_ref()).render(&mut out, "");
    capacity_profile_line(m, &mut out);
    auto_budget_line(m, &mut out);
    if let Some(g) = &s.group_offload {
        Line::new("group_offload")
            .text("offload_type", Some(&g.offload_type))
            .flag("use_stream", Some(g.use_stream))
            .flag("record_stream", Some(g.record_stream))
            .flag("low_cpu_mem_usage", Some(g.low_cpu_mem_usage))
            .count("num_blocks_per_group", g.num_blocks_per_group.map(u64::from))
            .render(&mut out, " (delegated to Diffusers hooks)");
    }
    Line::new("placement").text("module", s.placement.as_ref()).render(&mut out, "");
    Line::new("host_weights")
        .text("source", s.host_source.as_ref())
        .gib("pinned_gib", s.pinned_bytes)
        .gib("registered_gib", s.registered_bytes)
        .gib("unregistered_gib", s.unregistered_bytes)
        .gib("retained_gib", s.retained_bytes)
        .gib("unretained_gib", s.unretained_bytes)
        .gib("packed_gib", s.packed_bytes)
        .count("read_workers", s.read_workers)
        .gib("staging_gib", s.staging_bytes)
        .count("staging_buffers", s.staging_buffers)
        .text("staging_read", s.staging_read.as_ref())
        .render(&mut out, "");
    Line::new("peer_store")
        .text("device", s.peer_store_device.as_ref())
        .count("units", s.peer_store_units)
        .gib("gib", s.peer_store_bytes)
        .count("host_units", s.peer_store_host_units)
        .text("link_gb_per_s", s.peer_link_bytes_per_second.map(|b| format!("{:.1}", b / 1e9)))
        .render(&mut out, "");
    Line::new("conversion")
        .text("at", s.conversion.as_ref())
        .count("tensors", s.converted_tensors)
        .count("on_device", s.device_converted_tensors)
        .gib("from_gib", s.conversion_source_bytes)
        .gib("gib", s.converted_bytes)
        .seconds("seconds", s.conversion_seconds)
        .render(&mut out, "");
    let ratio = match (s.encoded_bytes, s.encoding_source_bytes) {
        (Some(e), Some(d)) if d > 0 => Some(format!("{:.3}", e as f64 / d as f64)),
        _ => None,
    };
    Line::new("encoding")
        .text("mode", s.weight_encoding.as_ref())
        .count("tensors", s.encoded_tensors)
        .gib("from_gib", s.encoding_source_bytes)
        .gib("gib", s.encoded_bytes)
        .text("ratio", ratio)
        .seconds("seconds", s.encoding_seconds.filter(|t| *t > 0.0))
        .text("file", s.encoded_file.as_ref().filter(|f| !f.is_empty()))
        .render(&mut out, "");
    if let Some(reason) = &s.host_tier_reason {
        let _ = writeln!(out, "  host_tier: {reason}");
    }
    if let Some(reason) = &s.unregistered_reason {
        let _ = writeln!(out, "  unregistered: {reason}");
    }
    for w in s.warnings.iter().flatten() {
        let _ = writeln!(out, "  warning: {w}");
    }

    let rt = &m.runtime;
    Line::new("runtime")
        .count("passes", rt.passes)
        .count("uploads", rt.uploads)
        .gib("upload_gib", rt.upload_bytes)
        .count("copies", rt.upload_copies)
        .count("conversions", rt.device_conversions.filter(|c| *c > 0))
        .count("decodes", rt.device_decodes.filter(|c| *c > 0))
        .gib(
            "saved_gib_per_pass",
            match (rt.decoded_bytes, rt.encoded_upload_bytes, rt.passes) {
                (Some(d), Some(e), Some(p)) if d > 0 && p > 0 => Some(d.saturating_sub(e) / p),
                _ => None,
            },
        )
        .seconds("decode_seconds", rt.decode_seconds.filter(|t| *t > 0.0))
        .text(
            "decode_gb_per_second",
            match (rt.decoded_bytes, rt.decode_seconds) {
                (Some(b), Some(t)) if t > 0.0 => Some(format!("{:.2}", b as f64 / t / 1e9)),
                _ => None,
            },
        )
        .seconds("upload_seconds", rt.upload_seconds)
        .seconds("wait_seconds", rt.wait_seconds)
        .render(&mut out, "");
    Line::new("prefetch")
        .count("hits", rt.prefetch_hits)
        .count("misses", rt.prefetch_misses)
        .count("cancels", rt.prefetch_cancels)
        .render(&mut out, "");
    Line::new("arena")
        .gib("resident_gib", rt.resident_bytes)
        .gib("slot_gib", rt.slot_bytes)
        .gib("peak_gib", rt.peak_bytes)
        .count("evictions", rt.evictions)
        .count("reclaim_cycles", rt.reclaim_cycles)
        .render(&mut out, "");
    Line::new("disk")
        .gib("gib_per_pass", rt.disk_bytes_per_pass)
        .gib("gib", rt.disk_bytes)
        .text("gb_per_second", rt.disk_bytes_per_second.map(|b| format!("{:.2}", b / 1e9)))
        .seconds("read_seconds", rt.disk_read_seconds)
        .seconds("stall_seconds", rt.read_stall_seconds)
        .count("on_demand", rt.disk_reads_on_demand)
        .render(&mut out, "");
    Line::new("peer")
        .count("uploads", rt.peer_uploads)
        .gib("gib", rt.peer_upload_bytes)
        .render(&mut out, "");
    Line::new("unsafe_retained")
        .gib("gib", rt.unsafe_retained_bytes.filter(|b| *b > 0))
        .render(&mut out, " (ownership kept after a release that could not be proven safe)");
    phase_lines(m, &mut out);

    if let Some(h) = &m.host_memory {
        let o = &h.observation;
        let memlock = match (o.rlimits_observed, o.rlimit_memlock_bytes) {
            (true, None) => Some("unlimited".to_owned()),
            (_, Some(b)) => Some(format!("{:.4}", b as f64 / GIB as f64)),
            (false, None) => None,
        };
        let cgroup_headroom =
            o.cgroups.iter().filter_map(|c| c.limit().map(|l| l.saturating_sub(c.current))).min();
        Line::new("host_memory")
            .text("phase", h.phase.as_ref())
            .gib("rss_gib", o.rss_bytes)
            .gib("peak_rss_gib", o.peak_rss_bytes)
            .gib("available_gib", o.mem_available_bytes)
            .gib("cgroup_headroom_gib", cgroup_headroom)
            .text("memlock_gib", memlock)
            .render(&mut out, "");
    }
    out
}

fn opt_text(value: &str) -> Option<&str> {
    (!value.is_empty()).then_some(value)
}

/// The capacity profile a component attached with.
fn capacity_profile_line(m: &DynamicOffloadMetrics, out: &mut String) {
    if let Some(p) = &m.setup.capacity_profile {
        Line::new("capacity_profile")
            .text("name", Some(&p.name))
            .text("status", Some(&p.status))
            .text("setting", p.setting.as_ref())
            .text("budget_gib", p.budget_gb.map(|g| format!("{g:.4}")))
            .text("recommended_gib", p.recommended_budget_gb.map(|g| format!("{g:.4}")))
            .gib("peak_gib", p.peak_bytes)
            .gib("free_margin_gib", p.free_margin_bytes)
            .render(out, "");
    }
}

/// What the automatic GPU budget did.
fn auto_budget_line(m: &DynamicOffloadMetrics, out: &mut String) {
    if let Some(a) = &m.setup.auto_budget {
        Line::new("auto_budget")
            .text("policy", Some(&a.policy))
            .gib("headroom_gib", Some(a.headroom_bytes))
            .text("replans", Some(a.replans.to_string()))
            .gib("budget_gib", a.budget_bytes)
            .gib("free_gib", a.free_bytes)
            .text("decision", a.decision.as_ref())
            .render(out, "");
    }
}

/// The execution timer's snapshot and the phase helpers' sections.
fn phase_lines(m: &DynamicOffloadMetrics, out: &mut String) {
    let rt = &m.runtime;
    if let Some(t) = &rt.execution_timing {
        Line::new("execution_timing")
            .text("status", Some(&t.status))
            .text("clock", Some(&t.clock))
            .text("scope", Some(&t.scope))
            .count("steps", Some(t.step_count))
            .flag("failed", t.failed.then_some(true))
            .render(out, "");
        Line::new("execution_phase")
            .seconds("seconds", t.phase_seconds)
            .seconds("tail_seconds", t.tail_seconds)
            .seconds("steady_state_seconds_per_step", t.steady_state_seconds_per_step)
            .render(out, "");
        if let Some(w) = t.diagnostic_step_wait.as_ref().filter(|w| w.enabled) {
            Line::new("diagnostic_step_wait")
                .count("calls", Some(w.calls))
                .seconds("host_seconds", Some(w.host_seconds))
                .render(out, " (synchronizing diagnostic, not benchmark-eligible)");
        }
    }
    if let Some(h) = &rt.host_cache_release {
        Line::new("host_cache_release")
            .text("phase", opt_text(&h.phase))
            .text("status", Some(&h.status))
            .text("device", h.device.as_ref())
            .count("before_bytes", h.allocator_bytes_before)
            .count("after_bytes", h.allocator_bytes_after)
            .text("reason", h.reason.as_ref())
            .render(out, " (PyTorch's pinned host cache)");
    }
    if let Some(i) = &rt.idle_cache_release {
        Line::new("idle_cache_release")
            .text("phase", opt_text(&i.phase))
            .text("status", Some(&i.status))
            .text("device", i.device.as_ref())
            .count("components", i.sessions)
            .count("unloaded", i.unloaded_sessions)
            .count("slots", i.slots_released)
            .gib("released_gib", i.bytes_released)
            .flag("cublas_cleared", i.cublas_workspaces_cleared)
            .render(out, " (idle execution slots)");
    }
    if let Some(d) = &rt.auxiliary_detachment {
        Line::new("auxiliary_detachment")
            .text("status", Some(&d.status))
            .count("copied_bytes", d.copied_bytes)
            .count("copied_owners", d.copied_tensor_owners)
            .count("dropped_references", d.dropped_references)
            .count("loader_mapping_bytes_before", d.loader_mapping_bytes_before)
            .count("loader_mapping_bytes_after", d.loader_mapping_bytes_after)
            .text("reason", d.reason.as_ref())
            .render(out, " (CPU ownership only; commit recovery not proven)");
    }
}
