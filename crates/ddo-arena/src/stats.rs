//! Arena counters.

/// What the arena did. Times are host wall time in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ArenaStats {
    /// Acquisitions.
    pub acquires: u64,
    /// Host time spent in `acquire` (prefetch work included).
    pub acquire_seconds: f64,
    /// Releases.
    pub releases: u64,
    /// Host time spent in `release`.
    pub release_seconds: f64,
    /// Unit uploads (demand and prefetch).
    pub uploads: u64,
    /// Bytes uploaded.
    pub upload_bytes: u64,
    /// Host-to-device copies enqueued by uploads.
    pub upload_copies: u64,
    /// Tensors converted on the device after their upload.
    pub device_conversions: u64,
    /// Tensors uploaded encoded and decoded on the device.
    pub device_decodes: u64,
    /// Bytes of those encodings (part of `upload_bytes`).
    pub encoded_upload_bytes: u64,
    /// Bytes the decodes wrote (the tensors as served).
    pub decoded_bytes: u64,
    /// Device seconds of the decodes known complete, as the device timed them.
    pub decode_seconds: f64,
    /// Host time spent enqueuing uploads.
    pub upload_seconds: f64,
    /// Host time spent blocked on fences (reclaim, close).
    pub wait_seconds: f64,
    /// Streamed acquisitions whose unit was already uploaded by prefetch.
    pub prefetch_hits: u64,
    /// Streamed acquisitions that uploaded on demand.
    pub prefetch_misses: u64,
    /// Prefetched units dropped from look-ahead because the order changed.
    pub prefetch_cancels: u64,
    /// Prefetch uploads issued.
    pub prefetch_issued: u64,
    /// Slot contents replaced by another unit.
    pub evictions: u64,
    /// Slot backings released by reclaim.
    pub reclaim_cycles: u64,
    /// Slot backings recreated after reclaim.
    pub backing_restores: u64,
    /// Passes seen.
    pub passes: u64,
    /// Acquisitions out of the learned order.
    pub order_mismatches: u64,
    /// Device bytes of resident units.
    pub resident_bytes: u64,
    /// Device bytes of slot backings alive now.
    pub slot_bytes: u64,
    /// Highest device bytes (resident + slots) held.
    pub peak_bytes: u64,
    /// Bytes retained unsafe after a failed release.
    pub unsafe_retained_bytes: u64,
    /// Uploads served from the peer weight store (part of `uploads`).
    pub peer_uploads: u64,
    /// Bytes they copied over the peer link (not part of `upload_bytes`, the host link's).
    pub peer_upload_bytes: u64,
    /// Bytes the peer weight store holds now.
    pub peer_store_bytes: u64,
}

impl ArenaStats {
    /// The counters of `self` (an earlier arena of the same component) followed by `later`'s:
    /// counts and times add up, the peak is the higher one, and the bytes held now are `later`'s.
    pub fn then(&self, later: &ArenaStats) -> ArenaStats {
        ArenaStats {
            acquires: self.acquires + later.acquires,
            acquire_seconds: self.acquire_seconds + later.acquire_seconds,
            releases: self.releases + later.releases,
            release_seconds: self.release_seconds + later.release_seconds,
            uploads: self.uploads + later.uploads,
            upload_bytes: self.upload_bytes + later.upload_bytes,
            upload_copies: self.upload_copies + later.upload_copies,
            device_conversions: self.device_conversions + later.device_conversions,
            device_decodes: self.device_decodes + later.device_decodes,
            encoded_upload_bytes: self.encoded_upload_bytes + later.encoded_upload_bytes,
            decoded_bytes: self.decoded_bytes + later.decoded_bytes,
            decode_seconds: self.decode_seconds + later.decode_seconds,
            upload_seconds: self.upload_seconds + later.upload_seconds,
            wait_seconds: self.wait_seconds + later.wait_seconds,
            prefetch_hits: self.prefetch_hits + later.prefetch_hits,
            prefetch_misses: self.prefetch_misses + later.prefetch_misses,
            prefetch_cancels: self.prefetch_cancels + later.prefetch_cancels,
            prefetch_issued: self.prefetch_issued + later.prefetch_issued,
            evictions: self.evictions + later.evictions,
            reclaim_cycles: self.reclaim_cycles + later.reclaim_cycles,
            backing_restores: self.backing_restores + later.backing_restores,
            passes: self.passes + later.passes,
            order_mismatches: self.order_mismatches + later.order_mismatches,
            resident_bytes: later.resident_bytes,
            slot_bytes: later.slot_bytes,
            peak_bytes: self.peak_bytes.max(later.peak_bytes),
            unsafe_retained_bytes: self.unsafe_retained_bytes + later.unsafe_retained_bytes,
            peer_uploads: self.peer_uploads + later.peer_uploads,
            peer_upload_bytes: self.peer_upload_bytes + later.peer_upload_bytes,
            peer_store_bytes: later.peer_store_bytes,
        }
    }

    /// Mean host microseconds per acquire + release pair.
    pub fn host_us_per_pair(&self) -> f64 {
        let pairs = self.acquires.min(self.releases).max(1) as f64;
        (self.acquire_seconds + self.release_seconds) * 1e6 / pairs
    }
}
