//! The retained store: host copies of tensor bytes kept independently of any loader tensor,
//! under a storage ceiling, with growth admitted by the host first.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapMut;

use ddo_core::{
    AdmissionProbe, GrowthKind, GrowthRequest, HostRegion, ReadRequest, SourceError, WeightSource,
};

/// Retained host storage under a ceiling. Bytes count from [`RetainedStore::retain`] until the
/// last `Arc` of the returned buffer is dropped (so a buffer still referenced by a copy in
/// flight still counts).
pub struct RetainedStore {
    ceiling: u64,
    used: Arc<AtomicU64>,
    probe: Arc<dyn AdmissionProbe>,
}

impl std::fmt::Debug for RetainedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetainedStore")
            .field("ceiling", &self.ceiling)
            .field("used", &self.used())
            .finish_non_exhaustive()
    }
}

/// Retained bytes: a [`HostRegion`] the arena can copy from and register. Each buffer is its own
/// anonymous mapping, so it starts on a page and shares no page with other memory: page-locking
/// one never touches another.
#[derive(Debug)]
pub struct RetainedBuffer {
    map: MmapMut,
    len: usize,
    used: Arc<AtomicU64>,
}

// SAFETY: the anonymous mapping is owned by the buffer and lent immutably once shared: its
// address, length and contents stay the same until the buffer is dropped.
unsafe impl HostRegion for RetainedBuffer {
    fn bytes(&self) -> &[u8] {
        &self.map[..self.len]
    }
}

impl Drop for RetainedBuffer {
    fn drop(&mut self) {
        self.used.fetch_sub(self.len as u64, Ordering::AcqRel);
    }
}

impl RetainedStore {
    /// A store that may hold up to `ceiling` bytes; growth is asked of `probe` first.
    pub fn new(ceiling: u64, probe: Arc<dyn AdmissionProbe>) -> Self {
        RetainedStore { ceiling, used: Arc::new(AtomicU64::new(0)), probe }
    }

    /// The ceiling in bytes.
    pub fn ceiling(&self) -> u64 {
        self.ceiling
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// Reads `requests` from `source` into a new retained buffer of `len` bytes.
    ///
    /// Refused, with nothing changed, when the ceiling would be exceeded
    /// ([`SourceError::CeilingExceeded`]) or the host refuses the growth
    /// ([`SourceError::Refused`], carrying the probe's reason). A failed read releases the bytes.
    pub fn retain(
        &self,
        source: &dyn WeightSource,
        requests: &[ReadRequest],
        len: u64,
    ) -> Result<Arc<RetainedBuffer>, SourceError> {
        let mut buffer = self.reserve(len)?;
        // The buffer owns the reservation: dropping it (on a failed read) releases it.
        source.read_batch(requests, buffer.bytes_mut())?;
        Ok(Arc::new(buffer))
    }

    /// A new zeroed retained buffer of `len` bytes, refused as [`retain`](Self::retain) is.
    pub(crate) fn reserve(&self, len: u64) -> Result<RetainedBuffer, SourceError> {
        // Reserve under the ceiling first so concurrent retains cannot overshoot it.
        let reserved = self.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
            used.checked_add(len).filter(|total| *total <= self.ceiling)
        });
        if let Err(used) = reserved {
            return Err(SourceError::CeilingExceeded {
                what: "retained storage",
                ceiling: self.ceiling,
                used,
                requested: len,
            });
        }
        let release = || self.used.fetch_sub(len, Ordering::AcqRel);
        let request = GrowthRequest { kind: GrowthKind::Retained, bytes: len, registered_bytes: 0 };
        if let Err(refusal) = self.probe.admit(&request).into_result() {
            release();
            return Err(SourceError::Refused(refusal));
        }
        let Ok(size) = usize::try_from(len) else {
            release();
            return Err(SourceError::InvalidBatch(format!("{len} bytes do not fit in memory")));
        };
        match MmapMut::map_anon(size.max(1)) {
            Ok(map) => Ok(RetainedBuffer { map, len: size, used: self.used.clone() }),
            Err(e) => {
                release();
                Err(SourceError::InvalidBatch(format!("allocating {len} host bytes failed: {e}")))
            }
        }
    }
}

impl RetainedBuffer {
    /// The buffer's bytes, to fill before it is shared.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map[..self.len]
    }

    /// Shortens the buffer to its first `len` bytes (before it is shared), giving the rest back
    /// to the store's count. Pages of the mapping past them that were never written hold no
    /// memory, so nothing is unmapped.
    pub(crate) fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.used.fetch_sub((self.len - len) as u64, Ordering::AcqRel);
            self.len = len;
        }
    }
}
