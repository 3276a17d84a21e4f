//! The sources an attach streams from: a checkpoint as stored, converted at load or served
//! from its encodings ([`checkpoint`]: mapping, retained windows, reads, disk staging), or a
//! module's host tensors ([`host`]).

mod checkpoint;
mod host;
mod runs;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ddo_core::{Dtype, SourceError, TensorSlice, WeightSource};
use ddo_policy::ConversionSite;
use ddo_source::{
    Checkpoint, CheckpointSource, ConvertedSource, EncodedFileIdentity, EncodedFileRefusal,
    EncodedSource, MmapChoice, RetainedStore,
};

use super::encoding::{self, EncodingChoice, Encodings};
use super::state::{CheckpointBytes, HostRange, SourceBytes};
use super::{ComponentSession, SessionRoute};
use crate::SessionError;

impl ComponentSession {
    /// The checkpoint's source: retained windows under `vmm_source_cache_gb`, else the mapping
    /// (`load_safetensors_backend` auto/mmap) or reads on demand (pread/direct); the tensors
    /// `vmm_weight_encoding` chooses served from their encodings.
    pub(super) fn checkpoint_source(
        &self,
        path: &PathBuf,
        mmap: MmapChoice,
        host_only: bool,
    ) -> Result<SourceBytes, SessionError> {
        let checkpoint = Arc::new(Checkpoint::open(path)?);
        let all = self.conversions(checkpoint.slices())?;
        let converted: HashSet<usize> = all.iter().map(|&(i, _)| i).collect();
        let EncodingChoice { tensors: mut encode, why: mut note } =
            self.encoding_choice(checkpoint.slices(), &converted)?;
        let (mut prepared, mut pending) = (None, false);
        if !encode.is_empty() {
            match self.encodings(&checkpoint, &encode) {
                Encodings::Prepared(read, file_note) => prepared = Some((read, file_note)),
                Encodings::Pending(why) => {
                    encode.clear();
                    note = format!("{note}; {why}");
                    pending = true;
                }
                Encodings::AtLoad => {}
            }
        }
        // Unless the encodings are still being written, this attach applies `auto`'s decision.
        self.mark_applied(!pending);
        let CheckpointBytes { source, mapped, mut ranges, mut host } =
            self.stored_source(checkpoint.clone(), all.clone(), mmap, host_only, &encode)?;
        host.encoding_note = Some(note);
        if encode.is_empty() {
            return Ok(SourceBytes { source, ranges, host });
        }
        let served = prepared.and_then(|(read, file_note)| {
            (*read).serving(source.clone()).map(|read| (read, Some(file_note)))
        });
        let (mut encoded, file_note) = match served {
            Some(served) => served,
            None => self.encoded_source(source, &checkpoint, &encode, mapped.as_deref())?,
        };
        if let (Some(note), Some(file_note)) = (&mut host.encoding_note, file_note) {
            *note = format!("{note}; {file_note}");
        }
        // A tensor whose encoding was not smaller is served as stored, so its stored bytes must
        // be registered (and held) like every other stored tensor's: the source is opened again
        // with only the encoded tensors left out.
        let held: Vec<usize> =
            encode.iter().copied().filter(|&i| encoded.encoding(i).is_some()).collect();
        if held.len() < encode.len() {
            drop((ranges, mapped));
            let CheckpointBytes { source, mapped: _mapped, ranges: again, host: mut rehost } =
                self.stored_source(checkpoint.clone(), all, mmap, host_only, &held)?;
            rehost.encoding_note = host.encoding_note.take();
            encoded = encoded.serving(source).ok_or_else(|| {
                SessionError::Weights(
                    "the checkpoint's tensors changed while it was encoded".into(),
                )
            })?;
            (ranges, host) = (again, rehost);
        }
        ranges.extend(encoded.windows().into_iter().map(|(w, ro)| HostRange::new(w, ro)));
        host.encoding = Some(encoded.report());
        Ok(SourceBytes { source: Arc::new(encoded), ranges, host })
    }

    /// `source` with the tensors of `encode` also held entropy-coded, encoded on every core; a
    /// tensor's pages of `mapped` are dropped once read (its encoding serves it). Under
    /// `vmm_encoded_cache_dir` the encodings come from the encoded file of the same checkpoint
    /// files and tensors when it checks, else they are encoded and the file written; with what
    /// the profile says of the file.
    pub(super) fn encoded_source(
        &self,
        source: Arc<dyn WeightSource>,
        checkpoint: &Checkpoint,
        encode: &[usize],
        mapped: Option<&CheckpointSource>,
    ) -> Result<(EncodedSource, Option<String>), SessionError> {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let workers = cores.max(self.plan.settings.pin_cpu_workers as usize);
        let bounded = encoding::folder(&self.plan.settings, &self.target);
        let folder = bounded.as_ref().map_or(Path::new(""), |f| f.path.as_path());
        let file = (!folder.as_os_str().is_empty()).then(|| {
            EncodedFileIdentity::of(checkpoint, source.slices(), encode).map(|identity| {
                let path = folder.join(identity.file_name());
                (identity, path)
            })
        });
        let mut refused = None;
        if let Some(Ok((identity, path))) = &file {
            match EncodedSource::open_file(source.clone(), identity, path, workers) {
                Ok(read) => {
                    let _ = ddo_source::mark_used(path);
                    return Ok((read, Some(format!("read from {}", path.display()))));
                }
                Err(EncodedFileRefusal::Missing) => {}
                Err(why) => refused = Some(why),
            }
        }
        let mut encoded = self.encode(source, encode, mapped, workers)?;
        let note = match file {
            None => None,
            Some(Err(e)) => Some(format!("encoded (no encoded file: {e})")),
            Some(Ok((identity, path))) => {
                // A folder that cannot be written only leaves the encodings unsaved.
                let saved =
                    std::fs::create_dir_all(folder).and_then(|()| encoded.save(&identity, &path));
                if let (Ok(_), Some(bounded)) = (&saved, &bounded) {
                    let _ = ddo_source::mark_used(&path);
                    encoding::keep_bound(bounded, &path);
                }
                let shown = path.display();
                Some(match (saved, refused) {
                    (Ok(_), None) => format!("encoded (encoded file {shown} written)"),
                    (Ok(_), Some(why)) => format!("re-encoded: {why} (written again)"),
                    (Err(e), None) => {
                        format!("encoded (the encoded file {shown} could not be written: {e})")
                    }
                    (Err(e), Some(why)) => {
                        format!("re-encoded: {why} (it could not be written again: {e})")
                    }
                })
            }
        };
        Ok((encoded, note))
    }

    /// `source` with the tensors of `encode` encoded on `workers` threads into retained memory.
    pub(super) fn encode(
        &self,
        source: Arc<dyn WeightSource>,
        encode: &[usize],
        mapped: Option<&CheckpointSource>,
        workers: usize,
    ) -> Result<EncodedSource, SessionError> {
        let p = &self.target.platform;
        let store = RetainedStore::new(u64::MAX, p.admission.clone());
        let drop_pages = |i: usize| {
            if let Some(m) = mapped {
                let t = &m.slices()[i];
                if let Some(file) = m.mapping(t.file.0 as usize) {
                    file.drop_pages(t.offset as usize, t.len as usize);
                }
            }
        };
        EncodedSource::encode(source, encode, &store, workers, &drop_pages).map_err(|e| match e {
            e @ (SourceError::Refused(_) | SourceError::CeilingExceeded { .. }) => {
                SessionError::Capacity {
                    setting: "vmm_weight_encoding",
                    message: format!(
                        "the host cannot hold the encodings of {} tensors: {e}; set vmm_weight_encoding to off",
                        encode.len()
                    ),
                }
            }
            e => SessionError::Source(e),
        })
    }

    /// The checkpoint's source as stored (or converted at load), the tensors of `encode` left
    /// unregistered and unretained (their encodings serve them), with the mapping it reads.
    pub(super) fn stored_source(
        &self,
        checkpoint: Arc<Checkpoint>,
        all: Vec<(usize, Dtype)>,
        mmap: MmapChoice,
        host_only: bool,
        encode: &[usize],
    ) -> Result<CheckpointBytes, SessionError> {
        let s = &self.plan.settings;
        let p = &self.target.platform;
        let workers = s.pin_cpu_workers.max(1) as usize;
        let slices = checkpoint.slices();
        let device_can = |&(i, to): &(usize, Dtype)| p.residency.converts(slices[i].dtype, to);
        let (on_device, targets): (Vec<_>, Vec<_>) = match s.dtype_conversion {
            ConversionSite::Host => (Vec::new(), all.clone()),
            ConversionSite::Auto if host_only => (Vec::new(), all.clone()),
            ConversionSite::Device => {
                if let Some(&(i, to)) = all.iter().find(|c| !device_can(c)) {
                    return Err(SessionError::Capacity {
                        setting: "dtype_conversion",
                        message: format!(
                            "the device cannot convert tensor {} from {} to {}; set dtype_conversion to host or auto",
                            slices[i].name,
                            slices[i].dtype.as_str(),
                            to.as_str()
                        ),
                    });
                }
                (all.clone(), Vec::new())
            }
            // The disk route bounds host memory by its staging: every conversion the device can
            // make runs there, narrowing included (a converted copy would hold the model).
            ConversionSite::Auto if self.route == SessionRoute::Disk => {
                all.iter().partition(|c| device_can(c))
            }
            // Widening streams fewer bytes in the stored dtype.
            ConversionSite::Auto => all.iter().partition(|&&(i, to)| {
                to.size_bytes() > slices[i].dtype.size_bytes() && device_can(&(i, to))
            }),
        };
        let skip: HashSet<usize> =
            targets.iter().map(|&(i, _)| i).chain(encode.iter().copied()).collect();
        let CheckpointBytes { source, mapped, ranges, mut host } =
            self.checkpoint_bytes(checkpoint.clone(), mmap, &skip)?;
        host.device_conversions = on_device.iter().copied().collect();
        if targets.is_empty() {
            return Ok(CheckpointBytes { source, mapped, ranges, host });
        }
        let store = RetainedStore::new(u64::MAX, p.admission.clone());
        // A converted tensor's pages of the mapping are not needed again: drop them, so the
        // process holds the module's bytes once.
        let drop_pages = |i: usize| {
            if let Some(m) = &mapped {
                let t = &m.slices()[i];
                if let Some(file) = m.mapping(t.file.0 as usize) {
                    file.drop_pages(t.offset as usize, t.len as usize);
                }
            }
        };
        let converted = match ConvertedSource::convert(
            source.clone(),
            &targets,
            &store,
            workers,
            &drop_pages,
        ) {
            Ok(c) => c,
            // The host cannot hold the converted copy: stream the stored bytes and convert them
            // on the device instead, when it can.
            Err(SourceError::Refused(_) | SourceError::CeilingExceeded { .. })
                if s.dtype_conversion == ConversionSite::Auto
                    && !host_only
                    && targets.iter().all(device_can) =>
            {
                // What the first attempt holds (retained windows count against admission).
                drop((source, ranges, mapped));
                let skip = encode.iter().copied().collect();
                let mut bytes = self.checkpoint_bytes(checkpoint, mmap, &skip)?;
                bytes.host.device_conversions = all.into_iter().collect();
                bytes.host.host_short = true;
                return Ok(bytes);
            }
            Err(e @ (SourceError::Refused(_) | SourceError::CeilingExceeded { .. })) => {
                return Err(SessionError::Capacity {
                    setting: "torch_dtype",
                    message: format!(
                        "converting {} tensors to the module's dtypes needs host memory: {e}; load the model with torch_dtype matching the checkpoint",
                        targets.len()
                    ),
                });
            }
            Err(e) => return Err(SessionError::Source(e)),
        };
        host.conversion = Some(converted.report());
        let ranges = ranges
            .into_iter()
            .chain(converted.buffers().iter().map(|b| HostRange::new(b.clone(), false)))
            .collect();
        Ok(CheckpointBytes { source: Arc::new(converted), mapped, ranges, host })
    }

    /// The checkpoint's tensors whose parameters have another floating dtype: `(slice, dtype)`.
    pub(super) fn conversions(
        &self,
        slices: &[TensorSlice],
    ) -> Result<Vec<(usize, Dtype)>, SessionError> {
        let index: HashMap<&str, usize> =
            slices.iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
        let mut targets: HashMap<usize, (Dtype, &str)> = HashMap::new();
        for p in &self.assignment.parameters {
            let Some(&i) = p.names.iter().find_map(|n| index.get(n.as_str())) else { continue };
            let t = &slices[i];
            let Some(to) = p.dtype.filter(|&d| ddo_source::convertible(t.dtype, d)) else {
                continue;
            };
            if p.shape.as_ref().is_some_and(|shape| *shape != t.shape) {
                continue; // bind() names the shape mismatch
            }
            if let Some((other, name)) = targets.insert(i, (to, &p.names[0]))
                && other != to
            {
                return Err(SessionError::Weights(format!(
                    "tensor {} is bound to parameters {name} ({}) and {} ({}); tied parameters need one dtype",
                    t.name,
                    other.as_str(),
                    p.names[0],
                    to.as_str()
                )));
            }
        }
        let mut out: Vec<(usize, Dtype)> = targets.into_iter().map(|(i, (d, _))| (i, d)).collect();
        out.sort_unstable_by_key(|&(i, _)| i);
        Ok(out)
    }
}
