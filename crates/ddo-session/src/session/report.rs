//! The session's metrics: the view of the session and its attach the report reads.

use ddo_metrics::DynamicOffloadMetrics;

use super::ComponentSession;
use super::state::Attached;
use crate::report::{AttachedView, SessionView};

impl ComponentSession {
    /// A metrics snapshot; `phase` labels the host-memory observation (`None` skips it).
    pub fn metrics(&self, phase: Option<&str>) -> DynamicOffloadMetrics {
        // The host is observed before the session's lock is taken.
        let plan = crate::report::plan_snapshot(&self.plan, phase);
        let g = self.lock();
        let view = SessionView {
            module_count: self.tree.as_ref().map(|t| t.modules.len() as u64),
            link: self.target.link_bytes_per_second,
            execution_device: self.target.device.torch_name(),
            warnings: &self.warnings,
            attached: g.as_ref().map(attached_view),
        };
        crate::report::snapshot(plan, &view)
    }
}

/// What the report reads of one attach.
fn attached_view(a: &Attached) -> AttachedView<'_> {
    AttachedView {
        stats: a.earlier.then(&a.memory.arena.stats()),
        plan: a.memory.arena.plan(),
        unit_count: a.units.len() as u64,
        registered: a.host.registered,
        unregistered: a.host.unregistered,
        unregistered_reason: a.host.unregistered_reason.as_deref(),
        retained: a.host.retained.as_ref(),
        packed: a.host.packed,
        conversion: a.host.conversion,
        device_conversions: a.host.device_conversions.len() as u64,
        host_short: a.host.host_short,
        staging_short: a.host.staging_short,
        not_packed: a.host.not_packed.as_deref(),
        host_kind: a.host.kind,
        read_workers: a.host.read_workers,
        staging: a.host.staging.as_ref().map(|p| (p.stats(), p.is_direct())),
        staging_note: a.host.staging_note.as_deref(),
        tier_reason: a.host.tier_reason.as_deref(),
        encoding_note: a.host.encoding_note.as_deref(),
        encoding: a.host.encoding.as_ref(),
        setup_seconds: a.setup_seconds,
        stages: a.host.stages,
        peer: a.host.peer,
        peer_stored: a.memory.arena.peer_stored(),
        peer_note: a.host.peer_note.as_deref(),
        peer_link: a.host.peer_link,
        total_bytes: a.total_bytes,
        tensor_count: a.tensor_count,
    }
}
