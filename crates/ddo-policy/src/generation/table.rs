//! The plan as a table a user reads before anything runs.

use std::fmt::Write;

use super::GenerationPlan;
use super::choose::gib;

pub(super) fn format(plan: &GenerationPlan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "ddo plan on {} ({} of the card shared by the phases)",
        plan.device,
        gib(plan.card_bytes)
    );
    let _ = writeln!(
        out,
        "| component | phase | route | weights live | budget | streamed/pass | copies/pass | encoding |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|");
    for c in &plan.components {
        let copies = match c.copy_seconds_per_pass {
            Some(s) => format!("{:.3} s", s),
            None => "-".into(),
        };
        let budget = if c.route == "none" { "-".into() } else { gib(c.budget_bytes) };
        let tier = serde_json::to_value(c.host_tier)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            c.name,
            c.phase,
            c.route,
            tier,
            budget,
            gib(c.streamed_bytes_per_pass),
            copies,
            c.encoding
        );
    }
    let _ = writeln!(out, "why:");
    for c in &plan.components {
        for r in &c.reasons {
            let _ = writeln!(out, "  {}: {r}", c.name);
        }
    }
    for n in &plan.notes {
        let _ = writeln!(out, "note: {n}");
    }
    out
}
