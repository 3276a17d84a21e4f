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

    /// Whether the streamed units should switch to encoded streaming
    /// ([`switch_encoding`](Self::switch_encoding), between passes): where encodings are written
    /// in the background (a measured link and an encoded-file folder), once their file is
    /// complete, for `auto`'s decision or `on`; elsewhere as soon as `auto` timed the passes as
    /// transfer-bound (the switch then encodes). A background encoding that failed makes it
    /// never due: the component streams raw and the profile says why.
    pub fn encoding_switch_due(&self) -> bool {
        if self.background_encoding_ready() {
            return true;
        }
        self.background_folder().is_none()
            && matches!(
                &*self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()),
                Some(AutoEncoding::Encode { applied: false, .. })
            )
    }

    /// Attaches again with the streamed units' tensors encoded, once
    /// [`encoding_switch_due`](Self::encoding_switch_due): from the encoded file written in the
    /// background (nothing is encoded inside the call), or, without a background folder, encoded
    /// here. The arena is rebuilt (new addresses) and its counters go on. `false` (nothing
    /// changed, and the component stays raw) while tensors view its memory, or when no switch
    /// is due. Refused during a pass. When encoding fails (the host cannot hold the encodings)
    /// the component attaches raw again, the reason goes to the profile and the error is
    /// returned.
    pub fn switch_encoding(&self) -> Result<bool, SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        Self::between_passes(a, "the weights switch to encoded streaming between passes")?;
        let decide = |state: AutoEncoding| {
            *self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()) = Some(state);
        };
        let ready = self.background_encoding_ready();
        let auto_why = match &*self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(AutoEncoding::Encode { applied: false, why }) => Some(why.clone()),
            _ => None,
        };
        if !ready && (auto_why.is_none() || self.background_folder().is_some()) {
            return Ok(false);
        }
        let why = auto_why.clone().unwrap_or_else(|| "on".into());
        let earlier = {
            let mut attached = g.take().expect("attached");
            let memory = match Arc::try_unwrap(attached.memory) {
                Ok(m) => m,
                Err(held) => {
                    attached.memory = held;
                    *g = Some(attached);
                    let kept = format!("{why}, but tensors kept from the module view the arena");
                    *self.encoding_job.lock().unwrap_or_else(|p| p.into_inner()) =
                        super::encoding::JobSlot::Failed(kept.clone());
                    if auto_why.is_some() {
                        decide(AutoEncoding::Raw { why: kept });
                    }
                    return Ok(false);
                }
            };
            let earlier = attached.earlier.then(&memory.arena.stats());
            memory.close()?;
            earlier
            // The raw attach's source and its mapping go here, before the checkpoint is
            // mapped and encoded again: host memory never holds both.
        };
        let (mut new, result) = match self.attach() {
            Ok(new) => (new, Ok(true)),
            Err(e) => {
                let failed = format!("{why}, but encoding failed: {e}");
                *self.encoding_job.lock().unwrap_or_else(|p| p.into_inner()) =
                    super::encoding::JobSlot::Failed(failed.clone());
                if auto_why.is_some() {
                    decide(AutoEncoding::Raw { why: failed });
                }
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
        encodable_session_with(dir, device, &[("vmm_weight_encoding", "auto")], |_| {})
    }

    /// [`encodable_session`] with `extra` settings, its target as `target` leaves it; the
    /// checkpoint is written once.
    fn encodable_session_with(
        dir: &std::path::Path,
        device: Arc<ddo_platform::host::HostDevice>,
        extra: &[(&str, &str)],
        target: impl FnOnce(&mut ExecutionTarget),
    ) -> ComponentSession {
        let path = dir.join("model.safetensors");
        if path.exists() {
            return open_encodable(&path, device, extra, target);
        }
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
        open_encodable(&path, device, extra, target)
    }

    fn open_encodable(
        path: &std::path::Path,
        device: Arc<ddo_platform::host::HostDevice>,
        extra: &[(&str, &str)],
        target: impl FnOnce(&mut ExecutionTarget),
    ) -> ComponentSession {
        let mut settings = vec![
            ("execution_device", "cpu"),
            ("backend", "vmm"),
            ("vmm_resident_weight_budget_gb", "0.02"),
        ];
        settings.extend_from_slice(extra);
        let plan = crate::testing::resolve_plan(&settings).unwrap();
        let weights = Weights::Checkpoint { path: path.to_owned(), mmap: MmapChoice::never() };
        let platform = ddo_platform::host_platform(device);
        let mut t = ExecutionTarget::unmeasured(ExecutionDevice::Host, platform);
        target(&mut t);
        ComponentSession::open(SessionSpec { plan, weights, tree: None }, t).unwrap()
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

    // ---- encodings written in the background ---------------------------------------------

    /// A target whose passes are timed (a link of 1 GB/s) with `folder` as its default
    /// encoded-file folder.
    fn timed_with_default(folder: &std::path::Path) -> impl FnOnce(&mut ExecutionTarget) {
        let folder = folder.to_owned();
        move |t: &mut ExecutionTarget| {
            t.link_bytes_per_second = Some(1e9);
            t.encoded_cache = Some(crate::EncodedCacheFolder { path: folder, cap_bytes: 64 << 30 });
        }
    }

    /// Decodes fast enough that `auto` encodes every streamed 4 MiB matrix.
    fn fast_decoding(session: &ComponentSession) {
        *session.decode_speed.lock().unwrap() =
            Some(crate::decode_speed::DecodeSpeed::of(vec![(1 << 20, 1e-6), (16 << 20, 16e-6)]));
    }

    /// One pass acquiring every streamed unit: each unit's weight as it reads on the device.
    fn pass(s: &ComponentSession) -> Vec<Vec<u8>> {
        let stream = StreamId(0);
        s.begin_pass(stream).unwrap();
        let mut seen = Vec::new();
        for unit in s.units().unwrap().iter().filter(|u| !u.pinned) {
            let lease = s.acquire(unit.id, stream).unwrap();
            seen.push(s.read_tensor(&format!("{}.attn.weight", unit.name)).unwrap());
            s.release(lease, stream).unwrap();
        }
        s.end_pass(stream).unwrap();
        seen
    }

    /// Passes (each checked against `raw`) until the switch is due; panics after 20 s.
    fn passes_until_due(s: &ComponentSession, raw: &[Vec<u8>]) {
        let t = std::time::Instant::now();
        while !s.encoding_switch_due() {
            assert!(t.elapsed().as_secs() < 20, "the background encoding never completed");
            assert_eq!(pass(s), raw);
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    fn names_in(folder: &std::path::Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(folder)
            .map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        names.sort();
        names
    }

    fn decided(session: &ComponentSession) {
        *session.auto_encoding.lock().unwrap() =
            Some(AutoEncoding::Encode { applied: false, why: "passes at the floor".into() });
    }

    #[test]
    fn auto_switches_only_once_the_background_file_is_complete_and_passes_stay_bit_identical() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("cache");
        let device = Arc::new(ddo_platform::host::HostDevice::new());
        let auto = [("vmm_weight_encoding", "auto")];
        let session =
            encodable_session_with(dir.path(), device.clone(), &auto, timed_with_default(&folder));
        fast_decoding(&session);
        // A temporary file a killed writer left, a prefix of nothing valid, is never served.
        std::fs::create_dir_all(&folder).unwrap();
        std::fs::write(folder.join(".0123456789abcdef.ddoenc.1.0.tmp"), b"DDOENC\r\n partial")
            .unwrap();
        let hold = Arc::new(std::sync::RwLock::new(()));
        *session.encoding_hold.lock().unwrap() = Some(hold.clone());
        let held = hold.write().unwrap();
        let raw = pass(&session);
        assert_eq!(session.metrics(None).setup.encoded_tensors, None);
        decided(&session);
        // The decision starts the encodings at the next pass; they are held back.
        for _ in 0..3 {
            assert_eq!(pass(&session), raw);
            assert!(!session.encoding_switch_due());
            assert!(!session.switch_encoding().unwrap(), "no switch before the file is complete");
            assert_eq!(session.metrics(None).setup.encoded_tensors, None);
        }
        assert!(matches!(
            *session.encoding_job.lock().unwrap(),
            super::super::encoding::JobSlot::Running(_)
        ));
        assert!(names_in(&folder).iter().all(|n| n.ends_with(".tmp")), "{:?}", names_in(&folder));
        drop(held);
        passes_until_due(&session, &raw);
        let files: Vec<String> =
            names_in(&folder).into_iter().filter(|n| n.ends_with(".ddoenc")).collect();
        assert_eq!(files.len(), 1, "{:?}", names_in(&folder));
        assert!(session.switch_encoding().unwrap());
        assert!(!session.encoding_switch_due());
        let s = session.metrics(None).setup;
        assert!(s.encoded_tensors.is_some_and(|n| n >= 2), "{s:?}");
        let note = s.weight_encoding.unwrap();
        assert!(
            note.contains("passes at the floor") && note.contains("written in the background"),
            "{note}"
        );
        for _ in 0..2 {
            assert_eq!(pass(&session), raw);
        }
        assert!(session.metrics(None).runtime.device_decodes.unwrap() > 0);
        session.close().unwrap();
        // The decision is recorded: a second load of the checkpoint streams encoded from the
        // start, from the file.
        // (Its decode speed is timed at open, on the host backend of a debug build slowly: a
        // slow link keeps the same choice of tensors.)
        let slow_link = |t: &mut ExecutionTarget| {
            timed_with_default(&folder)(t);
            t.link_bytes_per_second = Some(1e6);
        };
        let again = encodable_session_with(dir.path(), device, &auto, slow_link);
        let s = again.metrics(None).setup;
        let note = s.weight_encoding.clone().unwrap();
        assert!(note.contains("recorded by an earlier load"), "{note}");
        assert!(s.encoded_tensors.is_some_and(|n| n >= 2), "{s:?}");
        assert!(note.contains("read from"), "{note}");
        assert!(!again.encoding_switch_due());
        assert_eq!(pass(&again), raw);
    }

    #[test]
    fn unloading_or_dropping_during_a_background_encoding_joins_it_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("cache");
        let device = Arc::new(ddo_platform::host::HostDevice::new());
        let auto = [("vmm_weight_encoding", "auto")];
        let session =
            encodable_session_with(dir.path(), device.clone(), &auto, timed_with_default(&folder));
        fast_decoding(&session);
        let hold = Arc::new(std::sync::RwLock::new(()));
        *session.encoding_hold.lock().unwrap() = Some(hold.clone());
        let held = hold.write().unwrap();
        let raw = pass(&session);
        decided(&session);
        assert_eq!(pass(&session), raw);
        assert!(matches!(
            *session.encoding_job.lock().unwrap(),
            super::super::encoding::JobSlot::Running(_)
        ));
        // Unload cancels the job and joins its thread (it is held: only a cancel ends it).
        assert!(session.unload().unwrap());
        assert!(matches!(
            *session.encoding_job.lock().unwrap(),
            super::super::encoding::JobSlot::Idle
        ));
        assert!(
            names_in(&folder).iter().all(|n| !n.ends_with(".ddoenc") && !n.ends_with(".tmp")),
            "{:?}",
            names_in(&folder)
        );
        // The reload streams raw and starts it again.
        session.reload().unwrap();
        let note = session.metrics(None).setup.weight_encoding.unwrap();
        assert!(note.contains("in the background"), "{note}");
        assert!(matches!(
            *session.encoding_job.lock().unwrap(),
            super::super::encoding::JobSlot::Running(_)
        ));
        assert_eq!(pass(&session), raw);
        // Dropping the session cancels and joins it too.
        drop(session);
        drop(held);
        assert!(
            names_in(&folder).iter().all(|n| !n.ends_with(".ddoenc") && !n.ends_with(".tmp")),
            "{:?}",
            names_in(&folder)
        );
    }

    #[test]
    fn on_streams_raw_while_its_file_is_written_then_switches() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("named");
        let device = Arc::new(ddo_platform::host::HostDevice::new());
        let named = folder.to_str().unwrap().to_owned();
        let on = [("vmm_weight_encoding", "on"), ("vmm_encoded_cache_dir", named.as_str())];
        let timed = |t: &mut ExecutionTarget| t.link_bytes_per_second = Some(1e9);
        let session = encodable_session_with(dir.path(), device.clone(), &on, timed);
        let note = session.metrics(None).setup.weight_encoding.unwrap();
        assert!(note.starts_with("on") && note.contains("in the background"), "{note}");
        let raw = pass(&session);
        passes_until_due(&session, &raw);
        assert!(session.switch_encoding().unwrap());
        assert_eq!(
            session.metrics(None).setup.encoded_tensors,
            Some(8),
            "every tensor of 64 KiB or more"
        );
        assert_eq!(pass(&session), raw);
        assert!(!session.switch_encoding().unwrap(), "applied: nothing more to switch");
        // The named folder is used, no decision is recorded for `on`.
        let names = names_in(&folder);
        assert!(names.iter().any(|n| n.ends_with(".ddoenc")), "{names:?}");
        assert!(!names.iter().any(|n| n.ends_with(".decision")), "{names:?}");
    }

    #[test]
    fn a_background_encoding_that_fails_leaves_the_component_raw_and_says_why() {
        let dir = tempfile::tempdir().unwrap();
        // A folder that cannot be made: a file stands in its way.
        let blocked = dir.path().join("a-file");
        std::fs::write(&blocked, b"").unwrap();
        let folder = blocked.join("cache");
        let device = Arc::new(ddo_platform::host::HostDevice::new());
        let auto = [("vmm_weight_encoding", "auto")];
        let session =
            encodable_session_with(dir.path(), device, &auto, timed_with_default(&folder));
        fast_decoding(&session);
        let raw = pass(&session);
        decided(&session);
        let t = std::time::Instant::now();
        loop {
            assert_eq!(pass(&session), raw);
            assert!(!session.encoding_switch_due());
            if matches!(
                *session.encoding_job.lock().unwrap(),
                super::super::encoding::JobSlot::Failed(_)
            ) {
                break;
            }
            assert!(t.elapsed().as_secs() < 20);
        }
        match &*session.auto_encoding.lock().unwrap() {
            Some(AutoEncoding::Raw { why }) => {
                assert!(why.contains("could not be written"), "{why}")
            }
            other => panic!("{other:?}"),
        }
        assert!(!session.switch_encoding().unwrap());
        // A reload stays raw and says why.
        assert!(session.unload().unwrap());
        session.reload().unwrap();
        let note = session.metrics(None).setup.weight_encoding.unwrap();
        assert!(note.contains("could not be written"), "{note}");
        assert_eq!(pass(&session), raw);
    }
}
