//! The peer weight store: streamed units held in another GPU's memory.

use ddo_arena::Arena;
use ddo_core::{ByteSize, GrowthKind, GrowthRequest};

use super::state::HostReport;
use super::{ComponentSession, ExecutionDevice, gib};

impl ComponentSession {
    /// Places the streamed units in `vmm_peer_store_device`'s memory when it is set, up to
    /// `vmm_peer_store_gb`; a refusal (no peer access, no memory there) leaves them streaming
    /// from host memory and says why in `host`.
    pub(super) fn fill_peer_store(&self, arena: &Arena, host: &mut HostReport) {
        let s = &self.plan.settings;
        host.peer = None;
        if s.vmm_peer_store_device.is_empty() {
            return;
        }
        let peer = match ExecutionDevice::parse(&s.vmm_peer_store_device) {
            Ok(ExecutionDevice::Cuda(n)) => n,
            _ => {
                host.peer_note = Some(format!(
                    "vmm_peer_store_device = {:?} names no GPU: the units stream from host memory",
                    s.vmm_peer_store_device
                ));
                return;
            }
        };
        let limit = gib("vmm_peer_store_gb", s.vmm_peer_store_gb).unwrap_or(0);
        if self.target.device == ExecutionDevice::Host {
            // The host backend holds a peer's memory in host memory: the host must admit it.
            let plan = arena.plan();
            let mut bytes = 0u64;
            for (u, _) in
                arena.layout().units.iter().zip(&plan.slot_of).filter(|(_, s)| s.is_some())
            {
                if limit > 0 && bytes + u.len > limit {
                    break;
                }
                bytes += u.len;
            }
            let request = GrowthRequest { kind: GrowthKind::Retained, bytes, registered_bytes: 0 };
            if let Err(refusal) = self.target.platform.admission.admit(&request).into_result() {
                host.peer_note = Some(format!(
                    "no peer weight store on cuda:{peer}: the host backend holds it in host memory, and {refusal}; the units stream from host memory"
                ));
                return;
            }
        }
        match arena.fill_peer_store(ddo_core::DeviceOrdinal(peer), limit) {
            Ok(report) => {
                host.peer_note = None;
                host.peer = Some(report);
                // The fill leaves its last units in the slots: start the first pass warm again.
                let _ = arena.prime();
                let own = match self.target.device {
                    ExecutionDevice::Cuda(_) => Some(self.target.platform.residency.device().0),
                    ExecutionDevice::Host => None,
                };
                if own == Some(peer) && report.bytes > 0 {
                    host.peer_note = Some(format!(
                        "the peer weight store is in the computing GPU's own memory ({}), outside the arena's budget: set vmm_peer_store_gb to bound it",
                        ByteSize(report.bytes)
                    ));
                }
                if let (Some(own), Some(measure), None) =
                    (own, self.target.peer_link, host.peer_link)
                    && own != peer
                {
                    host.peer_link =
                        measure(ddo_core::DeviceOrdinal(own), ddo_core::DeviceOrdinal(peer));
                }
            }
            Err(e) => {
                host.peer_note = Some(format!(
                    "no peer weight store on cuda:{peer}: {e}; the units stream from host memory"
                ));
            }
        }
    }
}
