//! The text listing of presets.

use std::fmt::Write;

use crate::{Backend, Preset, resolve_backend};

/// Lists every preset and its values, the way hosts print it for `--help`-style output:
///
/// ```text
/// DDO presets
///   auto -> one_shot_fast (backend linear), vmm_fast (backend vmm)
/// low_ram_safe: mode=linear_runtime vae=leaf_offload_without_stream
///   AUTO_BUDGET_POLICY=off
///   ...
/// ```
///
/// Presets are sorted by name, their keys too.
pub fn format_presets() -> String {
    let mut out = String::from("DDO presets\n");
    let linear = resolve_backend(Backend::Linear, Preset::Auto).map(|p| p.as_str()).unwrap_or("?");
    let vmm = resolve_backend(Backend::Vmm, Preset::Auto).map(|p| p.as_str()).unwrap_or("?");
    let _ = writeln!(out, "  auto -> {linear} (backend linear), {vmm} (backend vmm)");
    let mut presets: Vec<Preset> =
        Preset::ALL.iter().copied().filter(|p| *p != Preset::Auto).collect();
    presets.sort_by_key(|p| p.as_str());
    for p in presets {
        let backend = if p.is_native() { "vmm" } else { "linear" };
        let vae = serde_json::to_value(p.vae_default()).ok();
        let vae = vae.as_ref().and_then(|v| v.as_str()).unwrap_or("?");
        let _ = writeln!(out, "{p}: backend={backend} mode={} vae={vae}", p.execution_mode());
        let mut values: Vec<_> = p.values().to_vec();
        values.sort();
        if values.is_empty() {
            out.push_str("  <no preset values>\n");
        }
        for (k, v) in values {
            let _ = writeln!(out, "  DDO_{k}={v}");
        }
    }
    out
}
