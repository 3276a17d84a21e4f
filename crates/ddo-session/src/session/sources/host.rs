//! A module's host tensors served in place, small isolated ones packed per unit.

use std::collections::HashMap;
use std::sync::Arc;

use ddo_core::{HostSlice, SourceError, TensorSlice, WeightSource};
use ddo_source::{HostTensor, HostTensorSource, MmapChoice, RetainedStore};

use super::runs::used_runs;
use crate::SessionError;
use crate::session::ComponentSession;
use crate::session::state::{HostRange, HostReport, SourceBytes};

impl ComponentSession {
    /// The module's host tensors in place; tensors up to `small_tensor_threshold_kb` packed per
    /// unit. The storages still serving tensors are registered in place.
    pub(in crate::session) fn host_source(
        &self,
        storages: &[HostSlice],
        tensors: &[HostTensor],
        mmap: MmapChoice,
    ) -> Result<SourceBytes, SessionError> {
        let s = &self.plan.settings;
        let files = crate::host_files::redirect(storages, tensors, mmap)?;
        let mut source = HostTensorSource::new(files.storages, files.tensors)?;
        for path in &files.paths {
            source.watch_file(path)?;
        }
        let mut not_packed = None;
        let threshold = u64::from(s.small_tensor_threshold_kb) * 1024;
        if threshold > 0 {
            let index: HashMap<&str, usize> =
                source.slices().iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
            let mut units: Vec<Vec<usize>> = vec![Vec::new(); self.assignment.units.len() + 1];
            for p in &self.assignment.parameters {
                let Some(&i) = p.names.iter().find_map(|n| index.get(n.as_str())) else { continue };
                units[p.unit.map_or(0, |u| u + 1)].push(i);
            }
            let groups: Vec<Vec<usize>> =
                units.iter().map(|u| isolated_small(source.slices(), u, threshold)).collect();
            let store = RetainedStore::new(u64::MAX, self.target.platform.admission.clone());
            match source.pack(&groups, &store) {
                Ok(()) => {}
                // Packing only saves copies: when the host refuses the bytes, serve in place.
                Err(e @ (SourceError::Refused(_) | SourceError::CeilingExceeded { .. })) => {
                    not_packed = Some(format!("small tensors served in place: {e}"));
                }
                Err(e) => return Err(e.into()),
            }
        }
        // Private file pages are never page-locked (the kernel would copy each one).
        let mut unregistered = 0u64;
        // A file mapped for its tensors is registered where they lie, not whole: the rest of
        // the file (tensors the framework converted, other components' bytes) stays unlocked.
        let mapped_files = storages.len()..storages.len() + files.paths.len();
        let ranges = source
            .storages_in_use()
            .into_iter()
            .filter(|(i, r)| {
                let keep = !files.private_in_place.contains(i);
                if !keep {
                    unregistered += r.len() as u64;
                }
                keep
            })
            .flat_map(|(i, r)| {
                if mapped_files.contains(&i) {
                    used_runs(source.slices(), |t| t.file.0 as usize == i, &r)
                } else {
                    vec![r]
                }
            })
            .map(|r| HostRange::new(r, true))
            .chain(source.packs().into_iter().map(|p| HostRange::new(p, true)))
            .collect();
        let packed = source.packed();
        let host = HostReport {
            kind: if files.paths.is_empty() { "host_tensors" } else { "host_tensors+file" },
            packed,
            not_packed,
            unregistered,
            unregistered_reason: (unregistered > 0).then(|| {
                "tensors in a written private file mapping are copied unregistered".to_owned()
            }),
            ..HostReport::default()
        };
        Ok(SourceBytes { source: Arc::new(source), ranges, host })
    }
}

/// The tensors of one unit (`unit`: indices into `slices`) worth packing: those of at most
/// `threshold` bytes not adjacent to another tensor of the unit in the same storage. Adjacent
/// tensors already upload in one copy (a checkpoint file a framework mapped holds a block's
/// tensors back to back); moving one of them out would split that copy in two.
fn isolated_small(slices: &[TensorSlice], unit: &[usize], threshold: u64) -> Vec<usize> {
    let mut order = unit.to_vec();
    order.sort_by_key(|&i| (slices[i].file, slices[i].offset));
    let touches = |a: usize, b: usize| {
        let (a, b) = (&slices[a], &slices[b]);
        a.file == b.file && a.offset + a.len == b.offset
    };
    (0..order.len())
        .filter(|&k| {
            let i = order[k];
            let after = k > 0 && touches(order[k - 1], i);
            let before = k + 1 < order.len() && touches(i, order[k + 1]);
            slices[i].len <= threshold && !after && !before
        })
        .map(|k| order[k])
        .collect()
}
