//! Host registration: the registrar's ceiling by route, registering the attach's ranges (read
//! in one ahead) and unregistering them all.

use std::collections::HashSet;
use std::time::Instant;

use ddo_core::SourceError;
use ddo_source::{REGISTRATION_SEGMENT, RegisteredRange, Registrar};

use super::state::{HostRange, HostReport};
use super::{ComponentSession, SessionRoute, gib};
use crate::SessionError;

impl ComponentSession {
    /// Registers `ranges` in order into `registered`, counting what stays unregistered (and
    /// why) in `host`. The ranges of file mappings are read in first, on their own threads,
    /// one range ahead: registering one overlaps reading the next, and registration never
    /// pins a page it would have to fault in itself. An error leaves `registered` for the
    /// caller to unregister.
    pub(super) fn register_all(
        &self,
        ranges: Vec<HostRange>,
        registrar: &Registrar,
        registered: &mut Vec<RegisteredRange>,
        host: &mut HostReport,
    ) -> Result<(), SourceError> {
        use std::sync::atomic::{AtomicBool, Ordering};
        let s = &self.plan.settings;
        let register = self.route != SessionRoute::Linear || self.plan.effective_pin_cpu_memory;
        let read_in = std::mem::take(&mut host.read_in);
        let readers = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .clamp(1, 16)
            .max(s.pin_cpu_workers as usize);
        let pending: HashSet<usize> = read_in.iter().map(|r| r.range).collect();
        let spans: Vec<(usize, usize)> =
            ranges.iter().map(|r| (r.slice.offset(), r.slice.len())).collect();
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            // A rendezvous: the reader reads the next range while this one is registered.
            let (done, arrived) = std::sync::mpsc::sync_channel::<usize>(0);
            let (stop, spans) = (&stop, &spans);
            let reader = scope.spawn(move || {
                let started = Instant::now();
                let mut bytes = 0u64;
                for r in &read_in {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let (offset, len) = spans[r.range];
                    bytes += r.file.populate(offset, len, readers) as u64;
                    if done.send(r.range).is_err() {
                        break;
                    }
                }
                (bytes, started.elapsed().as_secs_f64())
            });
            let mut read = HashSet::new();
            let mut result = Ok(());
            for (i, HostRange { slice: range, read_only }) in ranges.into_iter().enumerate() {
                // A range not read in yet waits for its read (a reader that stopped leaves the
                // rest to the first touch).
                while pending.contains(&i) && !read.contains(&i) {
                    match arrived.recv() {
                        Ok(r) => read.insert(r),
                        Err(_) => break,
                    };
                }
                let len = range.len() as u64;
                if !register {
                    host.unregistered += len;
                    host.unregistered_reason.get_or_insert_with(|| "pin_cpu_memory is off".into());
                    continue;
                }
                match registrar.register(range, read_only) {
                    Ok(r) => {
                        host.registered += len;
                        registered.push(r);
                    }
                    Err(
                        e @ (SourceError::CeilingExceeded { .. }
                        | SourceError::Refused(_)
                        | SourceError::Device(_)),
                    ) if self.route != SessionRoute::Linear || s.allow_pin_memory_fallback => {
                        host.unregistered += len;
                        host.unregistered_reason.get_or_insert(e.to_string());
                    }
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            stop.store(true, Ordering::Relaxed);
            drop(arrived);
            if let Ok((bytes, seconds)) = reader.join() {
                host.stages.read_in_bytes = bytes;
                host.stages.read_in_seconds = seconds;
            }
            result
        })
    }

    /// The registrar of `ranges`: its ceiling from the route's settings.
    pub(super) fn registrar(&self, ranges: &[HostRange]) -> Result<Registrar, SessionError> {
        let s = &self.plan.settings;
        let needed: u64 = ranges
            .iter()
            .map(|r| (r.slice.len() as u64).div_ceil(REGISTRATION_SEGMENT) * REGISTRATION_SEGMENT)
            .sum();
        let ceiling = match self.route {
            SessionRoute::Native => {
                let registered = if s.vmm_source_registered_gb > 0.0 {
                    s.vmm_source_registered_gb
                } else {
                    s.vmm_source_cache_gb
                };
                if registered > 0.0 { gib("vmm_source_registered_gb", registered)? } else { needed }
            }
            SessionRoute::Linear if s.pin_weight_budget_gb > 0.0 => {
                gib("pin_weight_budget_gb", s.pin_weight_budget_gb)?.div_ceil(REGISTRATION_SEGMENT)
                    * REGISTRATION_SEGMENT
            }
            SessionRoute::Linear | SessionRoute::Disk => needed,
        };
        let p = &self.target.platform;
        Ok(Registrar::new(ceiling, p.residency.clone(), p.admission.clone()))
    }

    /// Unregisters every range; the first failure is returned after all were tried. A failed
    /// unregistration keeps its pages locked and allocated (counted unsafe), never freed.
    pub(super) fn unregister_all(
        registrar: &Registrar,
        registered: &mut Vec<RegisteredRange>,
    ) -> Result<(), SessionError> {
        let mut first = None;
        while let Some(r) = registered.pop() {
            if let Err(e) = registrar.unregister(r) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), |e| Err(SessionError::Source(e)))
    }
}
