//! Encodings made in the background: where `vmm_weight_encoding` needs encodings that no
//! encoded file holds yet, on a device whose passes are timed (a measured link), one host thread
//! of lowered priority writes the encoded file into the encoded-file folder while passes stream
//! raw; the switch to encoded streaming is due once the file is complete, and then attaches from
//! it (no encoding inside a step).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use ddo_core::WeightSource;
use ddo_policy::encoded_cache::{CacheEntry, lru_evictions};
use ddo_source::{Checkpoint, CheckpointSource, EncodedFileIdentity, EncodedSource, ReadOptions};

/// Threads a background encoding uses: half the host's cores (at least two, at most eight), at
/// lowered priority, so the passes keep the rest and win any core they contend for; a
/// generation of a few seconds then ends encoded.
pub(in crate::session) fn background_workers() -> usize {
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    (cores / 2).clamp(2, 8)
}

/// The encoded-file folder of a session, and its bound (the default folder's; a folder the
/// settings name is the user's to keep).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::session) struct Folder {
    pub(in crate::session) path: PathBuf,
    pub(in crate::session) cap: Option<u64>,
}

/// What the background encoding of a session is doing.
#[derive(Default)]
pub(in crate::session) enum JobSlot {
    /// None runs.
    #[default]
    Idle,
    /// One runs.
    Running(EncodingJob),
    /// The file is complete and checked: its encodings, opened, for the switch.
    Ready { identity: EncodedFileIdentity, prepared: Box<EncodedSource> },
    /// It failed: the component streams raw, and the profile says why.
    Failed(String),
}

impl JobSlot {
    /// Collects a finished job: `Ready` or `Failed`, or `Idle` when it was cancelled. Gives the
    /// failure, once, when it just failed.
    pub(in crate::session) fn poll(&mut self) -> Option<String> {
        let JobSlot::Running(job) = self else { return None };
        if !job.finished() {
            return None;
        }
        let JobSlot::Running(job) = std::mem::take(self) else { unreachable!() };
        let identity = job.identity.clone();
        match job.join() {
            Ok(Some(prepared)) => {
                *self = JobSlot::Ready { identity, prepared: Box::new(prepared) };
                None
            }
            Ok(None) => None,
            Err(why) => {
                *self = JobSlot::Failed(why.clone());
                Some(why)
            }
        }
    }

    /// Stops a running job (cancelled, its thread joined, its temporary file removed) and
    /// forgets a finished one's encodings; a failure is kept.
    pub(in crate::session) fn stop(&mut self) {
        if !matches!(self, JobSlot::Failed(_)) {
            *self = JobSlot::Idle; // a running job is cancelled and joined as it drops
        }
    }
}

/// What a background encoding writes.
pub(in crate::session) struct JobSpec {
    pub(in crate::session) checkpoint: Arc<Checkpoint>,
    pub(in crate::session) identity: EncodedFileIdentity,
    pub(in crate::session) folder: Folder,
    /// Why `auto` chose encoding: recorded beside the file for later loads of the checkpoint.
    pub(in crate::session) decision: Option<String>,
    /// Tests hold the writing back while they hold this lock.
    #[cfg(test)]
    pub(in crate::session) hold: Option<Arc<std::sync::RwLock<()>>>,
}

impl JobSpec {
    /// The encoded file it writes.
    pub(in crate::session) fn path(&self) -> PathBuf {
        self.folder.path.join(self.identity.file_name())
    }
}

/// A background encoding: its thread and how to stop it.
pub(in crate::session) struct EncodingJob {
    pub(in crate::session) path: PathBuf,
    identity: EncodedFileIdentity,
    cancel: Arc<AtomicBool>,
    handle: Option<JoinHandle<Result<Option<EncodedSource>, String>>>,
}

impl EncodingJob {
    /// Starts writing the encoded file of `spec` on a thread of its own; a complete file already
    /// there that checks is used as it is.
    pub(in crate::session) fn start(spec: JobSpec) -> Result<EncodingJob, String> {
        let cancel = Arc::new(AtomicBool::new(false));
        let (path, identity) = (spec.path(), spec.identity.clone());
        let stop = cancel.clone();
        let handle = std::thread::Builder::new()
            .name("ddo-encode".into())
            .spawn(move || run(&spec, &stop))
            .map_err(|e| format!("no thread could be started: {e}"))?;
        Ok(EncodingJob { path, identity, cancel, handle: Some(handle) })
    }

    fn finished(&self) -> bool {
        self.handle.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Waits for the thread: the file's encodings, `None` when cancelled, or why it failed.
    fn join(mut self) -> Result<Option<EncodedSource>, String> {
        let handle = self.handle.take().expect("joined once");
        handle.join().unwrap_or_else(|_| Err("the encoding thread panicked".into()))
    }
}

impl Drop for EncodingJob {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

/// The background thread: the encoded file of `spec` written (unless one that checks is there),
/// opened and checked, the decision recorded, the folder kept under its bound.
fn run(spec: &JobSpec, cancel: &AtomicBool) -> Result<Option<EncodedSource>, String> {
    ddo_source::lower_thread_priority();
    let path = spec.path();
    let shown = path.display();
    let inner: Arc<dyn WeightSource> = Arc::new(
        CheckpointSource::new(spec.checkpoint.clone(), ReadOptions::pread())
            .map_err(|e| e.to_string())?,
    );
    let workers = background_workers();
    let prepared = match EncodedSource::open_file(inner.clone(), &spec.identity, &path, workers) {
        Ok(read) => read,
        Err(_) => {
            #[cfg(test)]
            if let Some(hold) = &spec.hold {
                while hold.try_read().is_err() {
                    if cancel.load(Ordering::Relaxed) {
                        return Ok(None);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            std::fs::create_dir_all(&spec.folder.path).map_err(|e| {
                format!("the folder {} cannot be made: {e}", spec.folder.path.display())
            })?;
            match EncodedSource::write_file(&*inner, &spec.identity, &path, workers, cancel) {
                Ok(Some(_)) => {}
                Ok(None) => return Ok(None),
                Err(e) => return Err(format!("{shown} could not be written: {e}")),
            }
            EncodedSource::open_file(inner, &spec.identity, &path, workers)
                .map_err(|e| format!("{shown} was written but does not check: {e}"))?
        }
    };
    if let Some(why) = &spec.decision {
        // Without the record a later load only times its passes again.
        let _ = ddo_source::record_decision(&spec.folder.path, &spec.identity, why);
    }
    let _ = ddo_source::mark_used(&path);
    if let Some(cap) = spec.folder.cap {
        bound(&spec.folder.path, cap, Some(&path));
    }
    Ok(Some(prepared))
}

/// Keeps the encoded files of `folder` within `cap` bytes, least recently used first, `keep`
/// (the file just written or used) never; temporary files a killed writer left go first.
pub(in crate::session) fn bound(
    folder: &std::path::Path,
    cap: u64,
    keep: Option<&std::path::Path>,
) {
    let files = ddo_source::cached_files(folder);
    let mut live = Vec::new();
    for f in files {
        if f.abandoned {
            let _ = std::fs::remove_file(&f.path);
        } else if !f.path.to_string_lossy().ends_with(".tmp") {
            // A temporary file being written is not the bound's to remove.
            live.push(f);
        }
    }
    let entries: Vec<CacheEntry> =
        live.iter().map(|f| CacheEntry { bytes: f.bytes, last_used: f.last_used_ns }).collect();
    let kept = keep.and_then(|k| live.iter().position(|f| f.path == k));
    for i in lru_evictions(&entries, cap, kept) {
        let _ = ddo_source::remove_cached(&live[i].path);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::*;

    #[test]
    fn a_bounded_folder_keeps_its_most_recently_used_files_within_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path();
        let now = SystemTime::now();
        // Four encoded files of 100 bytes used 40, 30, 20 and 10 s ago; a fresh and an
        // abandoned temporary file; a decision.
        let file = |name: &str, bytes: usize, ago: u64| {
            let path = folder.join(name);
            std::fs::write(&path, vec![0u8; bytes]).unwrap();
            let f = std::fs::File::options().write(true).open(&path).unwrap();
            f.set_modified(now - Duration::from_secs(ago)).unwrap();
            path
        };
        let a = file("a.ddoenc", 100, 40);
        let b = file("b.ddoenc", 100, 30);
        let c = file("c.ddoenc", 100, 20);
        let d = file("d.ddoenc", 100, 10);
        file(".d.ddoenc.1.0.tmp", 1000, 1);
        file(".e.ddoenc.1.0.tmp", 1000, 2 * ddo_source::ABANDONED_AFTER.as_secs());
        file("x.decision", 10, 50);
        // `a` was used last (its use mark is newer than every file).
        ddo_source::mark_used(&a).unwrap();
        let names = || {
            let mut n: Vec<String> = std::fs::read_dir(folder)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            n.sort();
            n
        };
        bound(folder, 250, Some(&b));
        // b is kept (just written), a was used last: c then d would be next... c goes (older
        // than d), then 300 > 250 still: d goes. The abandoned temporary file goes, the fresh
        // one and the decision stay.
        assert_eq!(
            names(),
            vec![".d.ddoenc.1.0.tmp", "a.ddoenc", "a.ddoenc.used", "b.ddoenc", "x.decision"]
        );
        assert!(!c.exists() && !d.exists());
        bound(folder, 1 << 30, None);
        assert_eq!(names().len(), 5, "under the bound nothing goes");
        bound(folder, 0, Some(&a));
        assert_eq!(names(), vec![".d.ddoenc.1.0.tmp", "a.ddoenc", "a.ddoenc.used", "x.decision"]);
    }
}
