//! Re-plans between passes: a new GPU budget, and the switch to encoded streaming that
//! `vmm_weight_encoding = auto` decided; both rebuild the arena and keep its counters.

use std::sync::Arc;

use ddo_arena::{Arena, Budget};

use super::ComponentSession;
use super::encoding::AutoEncoding;
use crate::SessionError;

impl ComponentSession {
    /// Plans the arena again under a GPU budget of `total` bytes (the whole arena: resident
    /// units, slots and staging; no headroom inside it), keeping the source and the host
    /// registrations: the old arena is closed first, so the two never hold device memory
    /// together. Later reloads keep this budget. Refused during a pass. Returns `false`, changing
    /// nothing, while views handed out ([`TensorView::owner`](crate::TensorView::owner)) still
    /// hold the arena's memory.
    /// When the new budget cannot be planned the arena is planned again under its old budget and
    /// the error returned; if even that fails the component is left unloaded.
    pub fn set_budget(&self, total: u64) -> Result<bool, SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        Self::between_passes(a, "the budget changes between passes")?;
        let mut attached = g.take().expect("attached");
        let mut memory = match Arc::try_unwrap(attached.memory) {
            Ok(m) => m,
            Err(held) => {
                attached.memory = held;
                *g = Some(attached);
                return Ok(false);
            }
        };
        let old = memory.arena.plan().budget;
        if let Err(e) = memory.arena.close() {
            attached.memory = Arc::new(memory);
            *g = Some(attached);
            return Err(e.into());
        }
        // The attach's counters go on across the new arena.
        attached.earlier = attached.earlier.then(&memory.arena.stats());
        let p = &self.target.platform;
        let specs = self.unit_specs(&*attached.source);
        let conversions = &attached.host.device_conversions;
        let build = |budget: Budget| -> Result<Arena, SessionError> {
            let arena =
                Arena::with_conversions(p, attached.source.clone(), &specs, budget, conversions)
                    .map_err(|e| self.arena_error(e))?;
            arena.prime().and_then(|_| arena.settle_resident())?;
            Ok(arena)
        };
        let wanted = Budget { total, headroom: 0, prefetch_depth: old.prefetch_depth };
        let (arena, result) = match build(wanted) {
            Ok(arena) => (arena, Ok(true)),
            Err(e) => match build(old) {
                Ok(arena) => (arena, Err(e)),
                // Nothing fits any more: the component ends unloaded (dropping the memory
                // unregisters the host ranges).
                Err(_) => return Err(e),
            },
        };
        memory.arena = arena;
        self.fill_peer_store(&memory.arena, &mut attached.host);
        if result.is_ok() {
            *self.budget_override.lock().unwrap_or_else(|p| p.into_inner()) = Some(total);
        }
        let plan = memory.arena.plan();
        for (unit, resident) in attached.units.iter_mut().zip(&plan.resident) {
            unit.resident = *resident;
        }
        attached.memory = Arc::new(memory);
        *g = Some(attached);
        result
    }

    /// Whether `vmm_weight_encoding = auto` timed the passes as transfer-bound and the streamed
    /// units should switch to encoded streaming ([`switch_encoding`](Self::switch_encoding),
    /// between passes).
    pub fn encoding_switch_due(&self) -> bool {
        matches!(
            &*self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()),
            Some(AutoEncoding::Encode { applied: false, .. })
        )
    }

    /// Attaches again with the streamed units' tensors encoded, as `auto` decided: the arena is
    /// rebuilt (new addresses) and its counters go on. `false` (nothing changed, and the
    /// component stays raw) while tensors view its memory. Refused during a pass. When encoding
    /// fails (the host cannot hold the encodings) the component attaches raw again, the reason
    /// goes to the profile and the error is returned.
    pub fn switch_encoding(&self) -> Result<bool, SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        Self::between_passes(a, "the weights switch to encoded streaming between passes")?;
        let decide = |state: AutoEncoding| {
            *self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()) = Some(state);
        };
        let why = match &*self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(AutoEncoding::Encode { applied: false, why }) => why.clone(),
            _ => return Ok(false),
        };
        let earlier = {
            let mut attached = g.take().expect("attached");
            let memory = match Arc::try_unwrap(attached.memory) {
                Ok(m) => m,
                Err(held) => {
                    attached.memory = held;
                    *g = Some(attached);
                    decide(AutoEncoding::Raw {
                        why: format!("{why}, but tensors kept from the module view the arena"),
                    });
                    return Ok(false);
                }
            };
            let earlier = attached.earlier.then(&memory.arena.stats());
            memory.close()?;
            earlier
            // The raw attach's source and its mapping go here, before the checkpoint is
            // mapped and encoded again: host memory never holds both.
        };
        decide(AutoEncoding::Encode { applied: true, why: why.clone() });
        let (mut new, result) = match self.attach() {
            Ok(new) => (new, Ok(true)),
            Err(e) => {
                decide(AutoEncoding::Raw { why: format!("{why}, but encoding failed: {e}") });
                (self.attach()?, Err(e))
            }
        };
        new.earlier = earlier;
        *g = Some(new);
        result
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ddo_core::{Dtype, StreamId};
    use ddo_source::MmapChoice;

    use super::*;
    use crate::session::{SessionSpec, Weights};
    use crate::{ExecutionDevice, ExecutionTarget};

    /// A session on the host backend `device` over a checkpoint of eight weight-like bf16
    /// blocks of 4 MiB, `vmm_weight_encoding = auto`, in `dir`.
    fn encodable_session(
        dir: &std::path::Path,
        device: Arc<ddo_platform::host::HostDevice>,
    ) -> ComponentSession {
        let path = dir.join("model.safetensors");
        let mut names = vec![("embed.weight".to_owned(), vec![1024, 8])];
        for b in 0..8 {
            names.push((format!("blocks.{b}.attn.weight"), vec![2048, 1024]));
        }
        // Weight-like: a few exponents, random signs and mantissas.
        let byte = |t: usize, i: u64| {
            let h = (t as u64 * 0x9e37_79b9 + i / 2).wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
            if i.is_multiple_of(2) { h as u8 } else { (0x3b + (h >> 8) % 3) as u8 }
        };
        crate::testing::write_dtype(&path, Dtype::BF16, &names, byte).unwrap();
        let plan = crate::testing::resolve_plan(&[
            ("execution_device", "cpu"),
            ("backend", "vmm"),
            ("vmm_resident_weight_budget_gb", "0.02"),
            ("vmm_weight_encoding", "auto"),
        ])
        .unwrap();
        let weights = Weights::Checkpoint { path, mmap: MmapChoice::never() };
        let platform = ddo_platform::host_platform(device);
        let target = ExecutionTarget::unmeasured(ExecutionDevice::Host, platform);
        ComponentSession::open(SessionSpec { plan, weights, tree: None }, target).unwrap()
    }

    #[test]
    fn a_switch_to_encoded_streaming_serves_the_same_bytes_and_keeps_the_counters() {
        let dir = tempfile::tempdir().unwrap();
        let device = Arc::new(ddo_platform::host::HostDevice::new());
        let session = encodable_session(dir.path(), device);
        // The host backend measures no link: make it time passes as a GPU's session does,
        // attached raw.
        *session.auto_encoding.lock().unwrap() = Some(AutoEncoding::timing());
        assert!(session.unload().unwrap());
        session.reload().unwrap();
        let setup = |s: &ComponentSession| s.metrics(None).setup;
        assert_eq!(setup(&session).encoded_tensors, None);
        let stream = StreamId(0);
        let pass = |s: &ComponentSession| {
            s.begin_pass(stream).unwrap();
            let mut seen = Vec::new();
            for unit in s.units().unwrap().iter().filter(|u| !u.pinned) {
                let lease = s.acquire(unit.id, stream).unwrap();
                seen.push(s.read_tensor(&format!("{}.attn.weight", unit.name)).unwrap());
                s.release(lease, stream).unwrap();
            }
            s.end_pass(stream).unwrap();
            seen
        };
        let raw = pass(&session);
        assert!(session.metrics(None).setup.streamed_units.unwrap() >= 2, "blocks stream");
        assert!(!session.encoding_switch_due());
        *session.auto_encoding.lock().unwrap() =
            Some(AutoEncoding::Encode { applied: false, why: "passes at the floor".into() });
        assert!(session.encoding_switch_due());
        assert!(session.switch_encoding().unwrap());
        assert!(!session.encoding_switch_due());
        let s = setup(&session);
        assert!(s.encoded_tensors.is_some_and(|n| n >= 2), "{s:?}");
        assert!(s.weight_encoding.as_deref().unwrap().contains("passes at the floor"), "{s:?}");
        for _ in 0..2 {
            assert_eq!(pass(&session), raw);
        }
        let rt = session.metrics(None).runtime;
        assert!(rt.device_decodes.unwrap() > 0, "{rt:?}");
        assert!(rt.passes.unwrap() >= 3, "the counters go on: {rt:?}");
        // Applied: a second call changes nothing.
        assert!(!session.switch_encoding().unwrap());
    }

    #[test]
    fn re_plans_encoding_switches_and_reloads_release_the_streams_they_create() {
        let dir = tempfile::tempdir().unwrap();
        let device = Arc::new(ddo_platform::host::HostDevice::new());
        let session = encodable_session(dir.path(), device.clone());
        let live = || device.live_streams();
        // The streams of one arena; a closed arena leaves none.
        let one_arena = live();
        assert!(one_arena >= 1, "an arena uploads on a stream of its own");
        let cycle = |session: &ComponentSession, streams: usize| {
            for _ in 0..3 {
                assert!(session.set_budget(24 << 20).unwrap());
                assert!(session.set_budget(20 << 20).unwrap());
                assert_eq!(live(), streams, "a re-plan keeps one arena's streams");
                assert!(session.unload().unwrap());
                assert_eq!(live(), 0, "an unloaded component holds no stream");
                session.reload().unwrap();
                assert_eq!(live(), streams, "a reload holds one arena's streams");
            }
        };
        cycle(&session, one_arena);
        *session.auto_encoding.lock().unwrap() =
            Some(AutoEncoding::Encode { applied: false, why: "passes at the floor".into() });
        assert!(session.switch_encoding().unwrap());
        assert!(session.metrics(None).setup.encoded_tensors.is_some_and(|n| n > 0));
        let encoded = live();
        assert!((1..=2).contains(&encoded), "one arena's streams after the switch: {encoded}");
        cycle(&session, encoded);
        session.close().unwrap();
        assert_eq!(live(), 0);
    }
}
