//! Which tensors stream entropy-coded (`vmm_weight_encoding`): the choice, a pure function of
//! the units, the tensors and how the device weighs them, and the automatic mode's state
//! machine ([`auto`]).

mod auto;
mod background;

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use ddo_arena::{Layout, UnitSpec};
use ddo_core::{Dtype, TensorSlice, WeightSource};
use ddo_policy::{Settings, WeightEncoding};
use ddo_source::{Checkpoint, CheckpointSource, EncodedFileIdentity, EncodedSource, ReadOptions};

pub(super) use auto::AutoEncoding;
use background::{EncodingJob, JobSpec};
pub(super) use background::{Folder, JobSlot, bound};

/// The encoded-file folder of a session: `vmm_encoded_cache_dir` when set (unbounded: the
/// user's), else the target's default folder (bounded).
pub(super) fn folder(settings: &Settings, target: &crate::ExecutionTarget) -> Option<Folder> {
    let named = &settings.vmm_encoded_cache_dir;
    if !named.is_empty() {
        return Some(Folder { path: named.into(), cap: None });
    }
    let default = target.encoded_cache.as_ref()?;
    Some(Folder { path: default.path.clone(), cap: Some(default.cap_bytes) })
}

/// How an attach gets the encodings it chose.
pub(in crate::session) enum Encodings {
    /// From a complete encoded file, opened and checked (over a source of its own: serve it
    /// over the attach's with [`EncodedSource::serving`]), and what the profile says of it.
    Prepared(Box<EncodedSource>, String),
    /// They are written in the background: the attach streams raw; what the profile says.
    Pending(String),
    /// Encoded at load (no folder, or passes not timed on this device).
    AtLoad,
}

use super::{ComponentSession, SessionRoute};
use crate::SessionError;
use crate::decode_speed::DecodeSpeed;

impl ComponentSession {
    /// The tensors to stream entropy-coded (`vmm_weight_encoding`), unit by unit in upload
    /// order, and what the profile says of the choice.
    pub(in crate::session) fn encoding_choice(
        &self,
        slices: &[TensorSlice],
        converted: &HashSet<usize>,
    ) -> Result<EncodingChoice, SessionError> {
        let mode = self.plan.settings.vmm_weight_encoding;
        if mode == WeightEncoding::Off {
            return Ok(EncodingChoice::none("off".into()));
        }
        if self.route != SessionRoute::Native {
            let route = self.route.name();
            return Ok(EncodingChoice::none(format!(
                "{mode}: the {route} route streams bytes as read"
            )));
        }
        let residency = &self.target.platform.residency;
        if !residency.decodes() {
            return Ok(EncodingChoice::none(format!(
                "{mode}: this device cannot load the decoder"
            )));
        }
        let timed = match &mut *self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()) {
            None => None,
            Some(AutoEncoding::Timing { .. }) => {
                return Ok(EncodingChoice::none(
                    "auto: streaming raw while passes are timed".into(),
                ));
            }
            Some(AutoEncoding::Raw { why }) => {
                return Ok(EncodingChoice::none(format!("auto: raw: {why}")));
            }
            // Any attach from now on encodes (a reload included): the attach marks it applied
            // unless the encodings are still being written.
            Some(AutoEncoding::Encode { why, .. }) => Some(why.clone()),
        };
        let specs = self.assignment.unit_specs(slices);
        let streamed: Vec<bool> = match mode {
            WeightEncoding::On => vec![true; specs.len()],
            _ => {
                // The plan of the raw bytes says which units stream: their tensors cross the
                // link every pass, a resident unit's once.
                let budget = self.budget(slices, &specs)?;
                let layout = Layout::build(slices, &specs, residency.granularity()?)?;
                match ddo_arena::ResidencyPlan::new(&layout, budget) {
                    Ok(plan) => plan.resident.iter().map(|r| !r).collect(),
                    // The arena names the budget that cannot work.
                    Err(_) => vec![true; specs.len()],
                }
            }
        };
        // `auto` weighs each tensor on this device: it streams encoded where decoding it takes
        // less time than copying its bf16 bytes over the link (decoding then hides under the
        // copies). Without a measured link (the host backend) it keeps tensors of 1 MiB or more.
        let weigh = match (mode, self.target.link_bytes_per_second) {
            (WeightEncoding::Auto, Some(link)) => {
                let mut known = self.decode_speed.lock().unwrap_or_else(|p| p.into_inner());
                let speed = match &*known {
                    Some(speed) => speed.clone(),
                    None => crate::decode_speed::decode_speed(&self.target.platform).map_err(|e| {
                        SessionError::Capacity {
                            setting: "vmm_weight_encoding",
                            message: format!(
                                "the device could not time its decoding: {e}; set vmm_weight_encoding to off or on"
                            ),
                        }
                    })?,
                };
                *known = Some(speed.clone());
                Some((link, speed))
            }
            _ => None,
        };
        let choice = choose_tensors(
            mode,
            slices,
            &specs,
            &streamed,
            converted,
            weigh.as_ref().map(|(link, speed)| Weighing { link: *link, speed }),
        );
        let why = match timed {
            Some(timed) => format!("{}; {timed}", choice.why),
            None => choice.why,
        };
        Ok(EncodingChoice { tensors: choice.tensors, why })
    }
}

impl ComponentSession {
    /// The encoded-file folder where encodings are written in the background: a folder, on a
    /// device whose passes are timed (a measured link); elsewhere encodings are made at load.
    pub(in crate::session) fn background_folder(&self) -> Option<Folder> {
        self.target.link_bytes_per_second?;
        folder(&self.plan.settings, &self.target)
    }

    /// Marks `auto`'s decision to encode applied (or, `applied` false, due again).
    pub(in crate::session) fn mark_applied(&self, applied: bool) {
        if let Some(AutoEncoding::Encode { applied: a, .. }) =
            &mut *self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner())
        {
            *a = applied;
        }
    }

    /// How the attach gets the encodings of the tensors `encode` of `checkpoint`: the encoded
    /// file when one written in the background (or by an earlier load) is complete and checks,
    /// else written in the background while the attach streams raw (the job started unless it
    /// runs), or at load where there is no background folder.
    pub(in crate::session) fn encodings(
        &self,
        checkpoint: &Arc<Checkpoint>,
        encode: &[usize],
    ) -> Encodings {
        let Some(folder) = self.background_folder() else { return Encodings::AtLoad };
        let identity = match EncodedFileIdentity::of(checkpoint, checkpoint.slices(), encode) {
            Ok(id) => id,
            Err(_) => return Encodings::AtLoad,
        };
        let path = folder.path.join(identity.file_name());
        let shown = path.display().to_string();
        let mut slot = self.encoding_job.lock().unwrap_or_else(|p| p.into_inner());
        slot.poll();
        match std::mem::take(&mut *slot) {
            JobSlot::Ready { identity: written, prepared } if written == identity => {
                return Encodings::Prepared(
                    prepared,
                    format!("written in the background to {shown}"),
                );
            }
            JobSlot::Failed(why) => {
                let note = format!("raw: the encodings could not be written ({why})");
                *slot = JobSlot::Failed(why);
                return Encodings::Pending(note);
            }
            JobSlot::Running(job) if job.path == path => {
                *slot = JobSlot::Running(job);
                return Encodings::Pending(format!(
                    "streaming raw while the encodings are written to {shown} in the background"
                ));
            }
            // Another choice's job or encodings: stopped (dropped).
            _ => {}
        }
        let workers = std::thread::available_parallelism().map_or(1, usize::from);
        let file = CheckpointSource::new(checkpoint.clone(), ReadOptions::pread())
            .map_err(|e| e.to_string())
            .and_then(|inner| {
                let inner: Arc<dyn WeightSource> = Arc::new(inner);
                EncodedSource::open_file(inner, &identity, &path, workers)
                    .map_err(|e| e.to_string())
            });
        if let Ok(read) = file {
            let _ = ddo_source::mark_used(&path);
            return Encodings::Prepared(Box::new(read), format!("read from {shown}"));
        }
        *slot = self.start_job(checkpoint.clone(), identity, folder);
        match &*slot {
            JobSlot::Failed(why) => {
                Encodings::Pending(format!("raw: the encodings could not be written ({why})"))
            }
            _ => Encodings::Pending(format!(
                "streaming raw while the encodings are written to {shown} in the background"
            )),
        }
    }

    /// Starts writing the encoded file of `identity` in `folder`.
    fn start_job(
        &self,
        checkpoint: Arc<Checkpoint>,
        identity: EncodedFileIdentity,
        folder: Folder,
    ) -> JobSlot {
        let decision = match &*self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(AutoEncoding::Encode { why, .. }) => {
                // Recorded once: a decision read back is not recorded again.
                (!why.ends_with("(recorded by an earlier load)")).then(|| why.clone())
            }
            _ => None,
        };
        let spec = JobSpec {
            checkpoint,
            identity,
            folder,
            decision,
            #[cfg(test)]
            hold: self.encoding_hold.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        };
        match EncodingJob::start(spec) {
            Ok(job) => JobSlot::Running(job),
            Err(why) => JobSlot::Failed(why),
        }
    }

    /// `auto` decided to encode: its encodings start being written in the background, unless
    /// they are already (or failed), or there is no background folder (the switch encodes
    /// then). Called between passes; reads the checkpoint's header, writes nothing.
    pub(in crate::session) fn start_decided_encoding(&self) {
        let decided = matches!(
            &*self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()),
            Some(AutoEncoding::Encode { applied: false, .. })
        );
        if !decided
            || self.background_folder().is_none()
            || !matches!(
                *self.encoding_job.lock().unwrap_or_else(|p| p.into_inner()),
                JobSlot::Idle
            )
        {
            return;
        }
        let super::Weights::Checkpoint { path, .. } = &self.weights else { return };
        let Ok(checkpoint) = Checkpoint::open(path) else { return };
        let checkpoint = Arc::new(checkpoint);
        let encode = self
            .conversions(checkpoint.slices())
            .map(|all| all.iter().map(|&(i, _)| i).collect::<HashSet<usize>>())
            .and_then(|converted| self.encoding_choice(checkpoint.slices(), &converted));
        let why = |e: String| {
            *self.encoding_job.lock().unwrap_or_else(|p| p.into_inner()) = JobSlot::Failed(e);
        };
        match encode {
            // Nothing to encode: the switch only marks the decision applied.
            Ok(choice) if choice.tensors.is_empty() => {}
            Ok(choice) => {
                let folder = self.background_folder().expect("checked");
                match EncodedFileIdentity::of(&checkpoint, checkpoint.slices(), &choice.tensors) {
                    Ok(identity) => {
                        let job = self.start_job(checkpoint, identity, folder);
                        *self.encoding_job.lock().unwrap_or_else(|p| p.into_inner()) = job;
                    }
                    Err(e) => why(e.to_string()),
                }
            }
            Err(e) => why(e.to_string()),
        }
    }

    /// Whether the background encoding finished its file (collecting it), recording a failure:
    /// `auto` then stays raw and the profile says why.
    pub(in crate::session) fn background_encoding_ready(&self) -> bool {
        let mut slot = self.encoding_job.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = slot.poll() {
            let mut auto = self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(AutoEncoding::Encode { why: decided, .. }) = &*auto {
                *auto = Some(AutoEncoding::Raw {
                    why: format!("{decided}, but the encodings could not be written: {why}"),
                });
            }
        }
        matches!(*slot, JobSlot::Ready { .. })
    }

    /// Stops the background encoding (cancelled and joined) and forgets finished encodings.
    pub(in crate::session) fn stop_background_encoding(&self) {
        self.encoding_job.lock().unwrap_or_else(|p| p.into_inner()).stop();
    }
}

/// Keeps a bounded folder's encoded files within its bound after `written` was written or used.
pub(in crate::session) fn keep_bound(folder: &Folder, written: &Path) {
    if let Some(cap) = folder.cap {
        bound(&folder.path, cap, Some(written));
    }
}

/// The smallest tensor `on` encodes: below it the encoding's 8 KiB decoding table leaves
/// little or nothing saved, and the decode is a kernel launch for little.
const MIN_ON_BYTES: u64 = 64 << 10;

/// The smallest tensor `auto` streams entropy-coded where no link was measured to weigh it
/// against: its encoding carries an 8 KiB decoding table, and decoding a small tensor is a
/// kernel launch for little.
const MIN_ENCODED_BYTES: u64 = 1 << 20;

/// How `auto` weighs a tensor on a device with a measured link.
#[derive(Debug, Clone, Copy)]
pub(in crate::session) struct Weighing<'a> {
    /// The host-to-device link, bytes per second.
    pub(in crate::session) link: f64,
    /// How fast the device decodes.
    pub(in crate::session) speed: &'a DecodeSpeed,
}

/// The tensors to stream entropy-coded, in upload order, and what the profile says of the
/// choice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::session) struct EncodingChoice {
    /// Indices into the source's slices.
    pub(in crate::session) tensors: Vec<usize>,
    /// Why.
    pub(in crate::session) why: String,
}

impl EncodingChoice {
    fn none(why: String) -> EncodingChoice {
        EncodingChoice { tensors: Vec::new(), why }
    }
}

/// The bf16 and fp16 tensors of the units `specs` (`streamed`: per unit, whether it streams)
/// that `mode` encodes: under `on` every unit's tensors of [`MIN_ON_BYTES`] or more; under
/// `auto` the streamed units' tensors whose decoding takes less time than copying their bytes
/// over the link (`weigh`), or of [`MIN_ENCODED_BYTES`] or more where no link was measured.
/// Tensors in `converted` (served converted) are never encoded. Each unit's tensors come in
/// file order.
pub(in crate::session) fn choose_tensors(
    mode: WeightEncoding,
    slices: &[TensorSlice],
    specs: &[UnitSpec],
    streamed: &[bool],
    converted: &HashSet<usize>,
    weigh: Option<Weighing<'_>>,
) -> EncodingChoice {
    let pays = |len: u64| match (&weigh, mode) {
        (_, WeightEncoding::On) => len >= MIN_ON_BYTES,
        (Some(w), _) => w.speed.seconds(len) < len as f64 / w.link,
        (None, _) => len >= MIN_ENCODED_BYTES,
    };
    let mut chosen = Vec::new();
    let mut declined = 0usize;
    for (spec, _) in
        specs.iter().zip(streamed).filter(|(u, s)| **s && !u.pinned || mode == WeightEncoding::On)
    {
        let mut tensors: Vec<usize> = Vec::new();
        for &t in &spec.tensors {
            let slice = &slices[t];
            if !matches!(slice.dtype, Dtype::BF16 | Dtype::F16) || converted.contains(&t) {
                continue;
            }
            if pays(slice.len) {
                tensors.push(t);
            } else {
                declined += 1;
            }
        }
        tensors.sort_by_key(|&t| (slices[t].file, slices[t].offset));
        chosen.extend(tensors);
    }
    let why = match (mode, &weigh, chosen.is_empty()) {
        (WeightEncoding::On, _, false) => {
            "on: every unit's bf16 and fp16 tensors of 64 KiB or more".to_owned()
        }
        (WeightEncoding::On, _, true) => {
            "on: no unit holds a bf16 or fp16 tensor of 64 KiB or more".to_owned()
        }
        (_, Some(w), _) => format!(
            "auto: the streamed units' bf16 and fp16 tensors this device decodes faster than \
                 the link copies them ({:.0} GB/s of decoding at 16 MiB, {:.1} GB/s link; {declined} \
                 smaller tensors stay raw)",
            w.speed.rate() / 1e9,
            w.link / 1e9
        ),
        (_, None, false) => {
            "auto: the streamed units' bf16 and fp16 tensors of 1 MiB or more".to_owned()
        }
        (_, None, true) => {
            "auto: no streamed unit holds a bf16 or fp16 tensor of 1 MiB or more".to_owned()
        }
    };
    EncodingChoice { tensors: chosen, why }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use ddo_core::CheckpointFileId;

    use super::*;

    fn slice(name: &str, dtype: Dtype, offset: u64, len: u64) -> TensorSlice {
        TensorSlice {
            name: name.into(),
            dtype,
            shape: vec![len / dtype.size_bytes()],
            file: CheckpointFileId(0),
            path: PathBuf::from("model.safetensors"),
            offset,
            len,
        }
    }

    /// A pinned unit (tensor 0) and two blocks of a large bf16, a small bf16 and a large f32
    /// tensor each, the second block's stored in reverse file order.
    fn model() -> (Vec<TensorSlice>, Vec<UnitSpec>) {
        let mib = 1 << 20;
        let slices = vec![
            slice("embed", Dtype::BF16, 0, 2 * mib),
            slice("b0.big", Dtype::BF16, 2 * mib, 2 * mib),
            slice("b0.small", Dtype::BF16, 4 * mib, 128 << 10),
            slice("b0.f32", Dtype::F32, 5 * mib, 2 * mib),
            slice("b1.big", Dtype::F16, 9 * mib, 2 * mib),
            slice("b1.small", Dtype::BF16, 8 * mib, 128 << 10),
            slice("b1.f32", Dtype::F32, 11 * mib, 2 * mib),
        ];
        let unit = |name: &str, tensors: Vec<usize>, pinned| UnitSpec {
            name: name.into(),
            tensors,
            pinned,
        };
        let specs = vec![
            unit("resident", vec![0], true),
            unit("b.0", vec![1, 2, 3], false),
            unit("b.1", vec![4, 5, 6], false),
        ];
        (slices, specs)
    }

    #[test]
    fn on_encodes_every_units_half_precision_tensors_of_64_kib_or_more() {
        let (slices, specs) = model();
        let none = HashSet::new();
        let c = choose_tensors(WeightEncoding::On, &slices, &specs, &[false; 3], &none, None);
        // Each unit's tensors in file order: b1.small lies before b1.big.
        assert_eq!(c.tensors, vec![0, 1, 2, 5, 4]);
        assert!(c.why.starts_with("on: every unit's"), "{}", c.why);
    }

    #[test]
    fn auto_without_a_link_encodes_the_streamed_units_tensors_of_1_mib_or_more() {
        let (slices, specs) = model();
        let none = HashSet::new();
        let streamed = [true, true, false];
        let c = choose_tensors(WeightEncoding::Auto, &slices, &specs, &streamed, &none, None);
        // The pinned unit and the resident block are not streamed; small tensors stay raw.
        assert_eq!(c.tensors, vec![1]);
        let converted: HashSet<usize> = [1].into();
        let c = choose_tensors(WeightEncoding::Auto, &slices, &specs, &streamed, &converted, None);
        assert!(c.tensors.is_empty());
        assert!(c.why.contains("no streamed unit"), "{}", c.why);
    }

    #[test]
    fn auto_with_a_link_encodes_what_decodes_faster_than_it_copies() {
        let (slices, specs) = model();
        let none = HashSet::new();
        // Decoding costs 100 us for anything up to 1 MiB, then 1 MiB per 100 us (10 GB/s); the
        // link copies 5 GB/s: 128 KiB copies in 26 us (raw), 2 MiB in 419 us (encoded, 200 us).
        let speed = DecodeSpeed::of(vec![(1 << 20, 100e-6), (4 << 20, 400e-6)]);
        let weigh = Some(Weighing { link: 5e9, speed: &speed });
        let all = [true; 3];
        let c = choose_tensors(WeightEncoding::Auto, &slices, &specs, &all, &none, weigh);
        assert_eq!(c.tensors, vec![1, 4]);
        assert!(c.why.contains("2 smaller tensors stay raw"), "{}", c.why);
    }
}
