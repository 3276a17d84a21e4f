//! A checkpoint's own bytes: retained windows (the rest read ahead into staging), the mapping,
//! reads on demand, or the disk route's staging, and the staging pools they read into.

use std::collections::HashSet;
use std::sync::Arc;

use ddo_arena::Layout;
use ddo_core::{HostRegion, HostSlice, SourceError, WeightSource};
use ddo_policy::{Origin, ReadBackend};
use ddo_source::{
    Checkpoint, CheckpointSource, MmapChoice, REGISTRATION_SEGMENT, ReadOptions, RetainedSource,
    RetainedStore, StagedSource, StagingOptions, StagingPool,
};

use super::runs::stored_runs;
use crate::SessionError;
use crate::session::host_tier::{HostTier, TierChoice};
use crate::session::state::{CheckpointBytes, HostRange, HostReport, ReadIn};
use crate::session::{ComponentSession, GIB, SessionRoute, gib};

/// Retained windows of about one registration segment: whole tensors, so a unit's range uploads
/// in copies of link-speed size.
const RETAINED_WINDOW: u64 = REGISTRATION_SEGMENT;

/// The largest unit's upload and the largest extent (one contiguous file range), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Largest {
    unit: u64,
    extent: u64,
}

impl ComponentSession {
    /// The checkpoint's own bytes: retained windows, the mapping, or reads on demand. With
    /// `targets` to convert, a mapping registers only the ranges of the tensors served as stored.
    pub(in crate::session) fn checkpoint_bytes(
        &self,
        checkpoint: Arc<Checkpoint>,
        mmap: MmapChoice,
        skip: &HashSet<usize>,
    ) -> Result<CheckpointBytes, SessionError> {
        let s = &self.plan.settings;
        let p = &self.target.platform;
        let workers = s.pin_cpu_workers.max(1) as usize;
        let reads = |backend: ReadBackend| match backend {
            ReadBackend::Direct => ReadOptions { workers, ..ReadOptions::direct() },
            _ => ReadOptions { workers, ..ReadOptions::pread() },
        };
        if self.route == SessionRoute::Disk {
            let buffer = self.staging_buffer(&checkpoint)?;
            let mut bytes = self.disk_bytes(checkpoint, buffer)?;
            bytes.host.tier_reason = Some(
                "disk: the disk route (vmm_runtime, preset nvme_baseline) reads the checkpoint into staging every pass".into(),
            );
            return Ok(bytes);
        }
        let mut cache = gib("vmm_source_cache_gb", s.vmm_source_cache_gb)?;
        let mut backend = s.load_safetensors_backend;
        let mut reason = (cache > 0).then(|| {
            format!(
                "retained: vmm_source_cache_gb = {} holds the checkpoint's bytes in host memory",
                s.vmm_source_cache_gb
            )
        });
        // A preset's mapping is the default tier; a caller's setting is kept.
        let by_caller = !matches!(
            self.plan.origins.get("load_safetensors_backend"),
            None | Some(Origin::Default | Origin::Preset(_))
        );
        let chooses = cache == 0
            && (backend == ReadBackend::Auto || backend == ReadBackend::Mmap && !by_caller)
            && s.vmm_source_registered_gb == 0.0
            && self.route == SessionRoute::Native;
        let mut staging_ceiling = None;
        if chooses {
            let TierChoice { tier, why } = self.host_tier(&checkpoint, skip)?;
            reason = Some(why);
            match tier {
                HostTier::Mapping => {}
                HostTier::Retained { windows, staging } => {
                    // Read past the page cache, which the host has no room for either.
                    (cache, backend) = (windows, ReadBackend::Direct);
                    staging_ceiling = Some(staging);
                }
                HostTier::Disk { buffer } => {
                    let mut bytes = self.disk_bytes(checkpoint, buffer).map_err(|e| match e {
                        SessionError::Source(e @ SourceError::Refused(_)) => {
                            SessionError::Capacity {
                                setting: "vmm_staging_buffer_gb",
                                message: format!(
                                    "the host cannot hold the checkpoint, nor staging to read it from disk: {e}"
                                ),
                            }
                        }
                        e => e,
                    })?;
                    bytes.host.tier_reason = reason;
                    return Ok(bytes);
                }
            }
        }
        if cache > 0 {
            let reader = CheckpointSource::new(checkpoint.clone(), reads(backend))?;
            let store = RetainedStore::new(cache, p.admission.clone());
            // Tensors converted at load are served converted, encoded ones from their encodings:
            // their stored bytes are not retained.
            let (source, report) = RetainedSource::retain_only(
                Arc::new(reader),
                &store,
                RETAINED_WINDOW.min(cache),
                |i| !skip.contains(&i),
            )?;
            let mut windows: Vec<HostRange> =
                source.windows().into_iter().map(|w| HostRange::new(w, false)).collect();
            let mut host = HostReport {
                kind: "retained",
                read_workers: Some(workers as u64),
                tier_reason: reason,
                ..HostReport::default()
            };
            let mut source: Arc<dyn WeightSource> = Arc::new(source);
            if report.unretained_bytes > 0 {
                // The rest is read ahead into staging, off the uploads' critical path.
                // A caller's vmm_staging_buffer_gb is the whole ring; else two buffers, each
                // holding the largest unit, as the chosen tier stages.
                let staging = match staging_ceiling {
                    Some(c) => c,
                    None if self.staging_by_caller() => {
                        gib("vmm_staging_buffer_gb", s.vmm_staging_buffer_gb)?
                    }
                    None => self.staging_buffer(&checkpoint)?.saturating_mul(2),
                };
                match self.staging_pool(&checkpoint, staging, backend) {
                    Ok(pool) => {
                        windows
                            .extend(pool.buffers().into_iter().map(|b| HostRange::new(b, false)));
                        source = Arc::new(StagedSource::new(source, pool.clone()));
                        host.staging = Some(pool);
                    }
                    Err(SessionError::Source(SourceError::CeilingExceeded { .. })) => {
                        host.staging_note = Some(format!(
                            "vmm_staging_buffer_gb = {} holds no unit: the bytes past vmm_source_cache_gb are read when each upload needs them (raise vmm_staging_buffer_gb to read them ahead)",
                            s.vmm_staging_buffer_gb
                        ));
                    }
                    Err(SessionError::Source(e @ SourceError::Refused(_))) => {
                        host.staging_note = Some(format!(
                            "the bytes past vmm_source_cache_gb are read when each upload needs them: the host refused their staging buffers ({e})"
                        ));
                    }
                    Err(e) => return Err(e),
                }
            }
            host.retained = Some(report);
            return Ok(CheckpointBytes { source, mapped: None, ranges: windows, host });
        }
        let mapped = match backend {
            ReadBackend::Auto | ReadBackend::Mmap => {
                CheckpointSource::mapped(checkpoint.clone(), workers, mmap)?
            }
            ReadBackend::Pread | ReadBackend::Direct => None,
        };
        match mapped {
            Some(source) => {
                let source = Arc::new(source);
                let maps = (0..checkpoint.files().len())
                    .filter_map(|i| {
                        let map =
                            HostSlice::whole(source.mapping(i)?.clone() as Arc<dyn HostRegion>);
                        Some(map)
                    })
                    .collect::<Vec<_>>();
                let ranges: Vec<HostRange> = if skip.is_empty() {
                    maps.into_iter().map(|m| HostRange::new(m, true)).collect()
                } else {
                    stored_runs(checkpoint.slices(), skip, &maps)
                };
                // A cold file is read in at the disk's speed before registration pins it: each
                // range just before it is registered, the next one read meanwhile.
                let read_in = ranges
                    .iter()
                    .enumerate()
                    .filter_map(|(range, r)| {
                        let file = (0..checkpoint.files().len())
                            .filter_map(|i| source.mapping(i))
                            .find(|m| {
                                std::ptr::addr_eq(Arc::as_ptr(r.slice.region()), Arc::as_ptr(*m))
                            })?;
                        Some(ReadIn { range, file: file.clone() })
                    })
                    .collect();
                let tier_reason = reason.or_else(|| {
                    Some(if s.vmm_source_registered_gb > 0.0 {
                        format!(
                            "mapping: vmm_source_registered_gb = {} bounds its page-locked part",
                            s.vmm_source_registered_gb
                        )
                    } else {
                        format!("mapping: load_safetensors_backend = {}", backend.as_str())
                    })
                });
                Ok(CheckpointBytes {
                    source: source.clone() as Arc<dyn WeightSource>,
                    mapped: Some(source),
                    ranges,
                    host: HostReport {
                        kind: "mapping",
                        tier_reason,
                        read_in,
                        ..HostReport::default()
                    },
                })
            }
            None => {
                let source = CheckpointSource::new(checkpoint, reads(backend))?;
                Ok(CheckpointBytes {
                    source: Arc::new(source),
                    mapped: None,
                    ranges: Vec::new(),
                    host: HostReport {
                        kind: "reads",
                        read_workers: Some(workers as u64),
                        tier_reason: Some(format!(
                            "reads: load_safetensors_backend = {} reads each upload's bytes from the files",
                            backend.as_str()
                        )),
                        ..HostReport::default()
                    },
                })
            }
        }
    }

    /// The disk route's bytes: the checkpoint read (never mapped) into a staging pool of two
    /// buffers of `vmm_staging_buffer_gb` each (fewer, larger units; more, smaller ones, within
    /// the same ceiling), registered for DMA.
    pub(in crate::session) fn disk_bytes(
        &self,
        checkpoint: Arc<Checkpoint>,
        buffer: u64,
    ) -> Result<CheckpointBytes, SessionError> {
        let s = &self.plan.settings;
        let largest = self.largest_unit(&checkpoint)?;
        if largest > buffer {
            return Err(SessionError::Config {
                setting: "vmm_staging_buffer_gb",
                message: format!(
                    "{} GiB is smaller than the largest unit ({:.4} GiB): the disk route stages a whole unit in one buffer; set vmm_staging_buffer_gb to at least {:.4}",
                    s.vmm_staging_buffer_gb,
                    largest as f64 / GIB,
                    largest.div_ceil(1 << 20) as f64 / 1024.0
                ),
            });
        }
        let backend = match s.load_safetensors_backend {
            ReadBackend::Pread => ReadBackend::Pread,
            _ => ReadBackend::Direct,
        };
        let pool = self.staging_pool(&checkpoint, buffer.saturating_mul(2), backend)?;
        // Reads outside staging (a range larger than a buffer) use the same path.
        let options = match (backend, pool.is_direct()) {
            (ReadBackend::Direct, true) => ReadOptions::direct(),
            _ => ReadOptions::pread(),
        };
        let reader = CheckpointSource::new(checkpoint, options)?;
        let ranges = pool.buffers().into_iter().map(|b| HostRange::new(b, false)).collect();
        let host = HostReport {
            kind: "disk",
            read_workers: Some(options.workers as u64),
            staging: Some(pool.clone()),
            ..HostReport::default()
        };
        let source = StagedSource::new(Arc::new(reader), pool);
        Ok(CheckpointBytes { source: Arc::new(source), mapped: None, ranges, host })
    }

    /// Bytes of the largest unit's upload (its stored tensors), as the arena lays units out.
    /// Whether the caller set `vmm_staging_buffer_gb` (not its default or a preset's).
    pub(in crate::session) fn staging_by_caller(&self) -> bool {
        !matches!(
            self.plan.origins.get("vmm_staging_buffer_gb"),
            None | Some(Origin::Default | Origin::Preset(_))
        )
    }

    /// Bytes of one staging buffer: `vmm_staging_buffer_gb`, grown to hold the largest unit
    /// unless the caller set it (a caller's setting is kept, and refused where a unit must fit).
    pub(in crate::session) fn staging_buffer(
        &self,
        checkpoint: &Checkpoint,
    ) -> Result<u64, SessionError> {
        let setting = gib("vmm_staging_buffer_gb", self.plan.settings.vmm_staging_buffer_gb)?;
        if self.staging_by_caller() {
            return Ok(setting);
        }
        Ok(setting.max(self.largest_unit(checkpoint)?.next_multiple_of(1 << 20)))
    }

    pub(in crate::session) fn largest_unit(
        &self,
        checkpoint: &Checkpoint,
    ) -> Result<u64, SessionError> {
        Ok(self.largest(checkpoint)?.unit)
    }

    /// The largest unit's and the largest extent's (one contiguous file range) bytes.
    fn largest(&self, checkpoint: &Checkpoint) -> Result<Largest, SessionError> {
        let granularity = self.target.platform.residency.granularity()?;
        let specs = self.assignment.unit_specs(checkpoint.slices());
        let layout = Layout::build(checkpoint.slices(), &specs, granularity)?;
        let unit = layout.units.iter().map(|u| u.link_bytes()).max().unwrap_or(0);
        let extent =
            layout.units.iter().flat_map(|u| u.extents.iter().map(|e| e.len)).max().unwrap_or(0);
        Ok(Largest { unit, extent })
    }

    /// A staging pool under `ceiling` for the checkpoint's ranges, read with `backend` (O_DIRECT
    /// where the file system allows, else pread), its copies' completion asked of the device.
    pub(in crate::session) fn staging_pool(
        &self,
        checkpoint: &Checkpoint,
        ceiling: u64,
        backend: ReadBackend,
    ) -> Result<Arc<StagingPool>, SessionError> {
        let p = &self.target.platform;
        let extent = self.largest(checkpoint)?.extent;
        let read = match backend {
            ReadBackend::Direct => ReadOptions::direct(),
            _ => ReadOptions::pread(),
        };
        let options = StagingOptions {
            ceiling,
            largest_range: extent,
            readers: read.workers,
            method: read.method,
            chunk_bytes: read.chunk_bytes,
        };
        let store = RetainedStore::new(ceiling, p.admission.clone());
        let pool = StagingPool::new(checkpoint, options, &store, Some(p.residency.clone()))?;
        Ok(Arc::new(pool))
    }
}
