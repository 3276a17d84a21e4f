//! What one attach holds: its memory (arena and registrations), source, leases and the report
//! of its host side; and the named results the sources hand the attach.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ddo_arena::{Arena, Lease};
use ddo_core::{Dtype, HostSlice, WeightSource};
use ddo_source::{
    CheckpointSource, ConversionReport, EncodingReport, PackReport, RegisteredRange, Registrar,
    RetainedReport, StagingPool,
};

use super::{ComponentSession, UnitInfo};
use crate::SessionError;
use crate::report::SetupStages;

/// One host range to register, and whether the device only reads it.
#[derive(Debug, Clone)]
pub(super) struct HostRange {
    pub(super) slice: HostSlice,
    pub(super) read_only: bool,
}

impl HostRange {
    pub(super) fn new(slice: HostSlice, read_only: bool) -> HostRange {
        HostRange { slice, read_only }
    }
}

/// A source, the host ranges to register for it and what its host side is.
pub(super) struct SourceBytes {
    pub(super) source: Arc<dyn WeightSource>,
    pub(super) ranges: Vec<HostRange>,
    pub(super) host: HostReport,
}

/// A checkpoint's source, its mapped form when mapped, the host ranges to register and what the
/// host side is.
pub(super) struct CheckpointBytes {
    pub(super) source: Arc<dyn WeightSource>,
    pub(super) mapped: Option<Arc<CheckpointSource>>,
    pub(super) ranges: Vec<HostRange>,
    pub(super) host: HostReport,
}

/// Where host bytes came from and what was registered, for the profile.
#[derive(Debug, Clone, Default)]
pub(super) struct HostReport {
    pub(super) kind: &'static str,
    /// Why small tensors were not packed (the host refused the bytes).
    pub(super) not_packed: Option<String>,
    pub(super) read_workers: Option<u64>,
    pub(super) registered: u64,
    pub(super) unregistered: u64,
    pub(super) unregistered_reason: Option<String>,
    pub(super) retained: Option<RetainedReport>,
    pub(super) packed: PackReport,
    pub(super) conversion: Option<ConversionReport>,
    /// Tensors converted on the device after each upload: slice -> the parameter's dtype.
    pub(super) device_conversions: HashMap<usize, Dtype>,
    /// Conversion moved to the device because the host could not hold the converted copy.
    pub(super) host_short: bool,
    /// Widening moved to the host because the GPU budget had no room for staging buffers.
    pub(super) staging_short: bool,
    /// The staging pool disk reads land in (the disk route; the unretained rest of a
    /// checkpoint on the native route).
    pub(super) staging: Option<Arc<StagingPool>>,
    /// Why the unretained rest is read on demand instead of ahead (no staging buffer fits).
    pub(super) staging_note: Option<String>,
    /// Why this host tier (mapping, retained windows, disk) serves the checkpoint.
    pub(super) tier_reason: Option<String>,
    /// What `vmm_weight_encoding` chose, and why.
    pub(super) encoding_note: Option<String>,
    /// What encoding the chosen tensors did.
    pub(super) encoding: Option<EncodingReport>,
    /// Ranges of file mappings to read in (populate) just before they are registered.
    pub(super) read_in: Vec<ReadIn>,
    /// The streamed units held in a peer device's memory (`vmm_peer_store_device`).
    pub(super) peer: Option<ddo_arena::PeerStoreReport>,
    /// Why no peer store serves (it was asked for and refused), or how fast its link is.
    pub(super) peer_note: Option<String>,
    /// The peer link's speed measured at attach, bytes per second (two CUDA devices).
    pub(super) peer_link: Option<f64>,
    /// How long the attach's stages took.
    pub(super) stages: SetupStages,
}

/// A range (an index into the attach's host ranges) of a file mapping, read in from the page
/// cache or the disk before registration pins it.
#[derive(Debug, Clone)]
pub(super) struct ReadIn {
    pub(super) range: usize,
    pub(super) file: Arc<ddo_source::MappedFile>,
}

/// The device memory of one attach and the host registrations its copies use. Shared by the
/// session and by every tensor view handed out ([`TensorView::owner`]): it is closed (after
/// every fence completed) when the last of them lets go, so a view never outlives its memory.
pub(super) struct Memory {
    pub(super) arena: Arena,
    pub(super) registrar: Registrar,
    pub(super) registered: Mutex<Vec<RegisteredRange>>,
}

impl Memory {
    /// Closes the arena, then unregisters (a phase boundary). A failure keeps what is left.
    pub(super) fn close(&self) -> Result<(), SessionError> {
        self.arena.close()?;
        let mut registered = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        ComponentSession::unregister_all(&self.registrar, &mut registered)
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        // Live leases make close refuse: the memory then stays owned, never freed early, and
        // the failure is noted (the arena's drop, right after, does not note it again).
        let reported = self.arena.close_failure().is_some();
        match self.close() {
            Ok(()) => {}
            // A close failure a caller was given is not reported again.
            Err(SessionError::Arena(_)) if reported => {}
            Err(SessionError::Arena(e)) => {
                ddo_core::note_drop_failure(ddo_arena::drop_failure(&e, self.arena.kept_bytes()))
            }
            Err(e) => ddo_core::note_drop_failure(ddo_core::DropFailure {
                what: "host registrations",
                message: e.to_string(),
                retained_bytes: Some(self.registrar.unsafe_retained()),
            }),
        }
    }
}

/// One attach: the source, the memory, and the live leases.
pub(super) struct Attached {
    pub(super) memory: Arc<Memory>,
    pub(super) source: Arc<dyn WeightSource>,
    pub(super) units: Vec<UnitInfo>,
    /// Every parameter name (aliases included) -> the source's slice index.
    pub(super) slices: HashMap<String, usize>,
    pub(super) leases: HashMap<u64, Lease>,
    pub(super) next_lease: u64,
    /// Leases of pinned and plan-resident units held from `begin_pass` to `end_pass`.
    pub(super) pass: Vec<Lease>,
    pub(super) host: HostReport,
    pub(super) setup_seconds: f64,
    pub(super) total_bytes: u64,
    pub(super) tensor_count: u64,
    /// Counters of the arenas this attach closed when its budget changed.
    pub(super) earlier: ddo_arena::ArenaStats,
}
