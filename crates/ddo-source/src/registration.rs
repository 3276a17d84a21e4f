//! Host registration: page-locking host ranges for DMA under a ceiling of whole segments,
//! separate from the storage ceiling; each range is charged its pages.

use std::sync::{Arc, Mutex};

use ddo_core::{
    AdmissionProbe, GrowthKind, GrowthRequest, HostSlice, Registration, Residency, SourceError,
};

/// The registration ceiling is a whole number of segments of this size: 64 MiB.
pub const REGISTRATION_SEGMENT: u64 = 64 << 20;

/// Each registered range is charged its bytes in whole host pages (what the kernel locks), so
/// ranges smaller than a segment (retained windows of whole tensors) use the ceiling fully.
const HOST_PAGE: u64 = 4096;

/// A registered host range. Unregister it through [`Registrar::unregister`]; dropping it
/// without doing so keeps the pages locked and allocated (the device holds the memory until it
/// is unregistered, at the latest when the device is dropped) and keeps counting them.
#[derive(Debug)]
pub struct RegisteredRange {
    registration: Registration,
    charged: u64,
}

impl RegisteredRange {
    /// The registered bytes.
    pub fn slice(&self) -> &HostSlice {
        &self.registration.slice
    }

    /// Bytes charged against the ceiling (whole segments).
    pub fn charged(&self) -> u64 {
        self.charged
    }
}

#[derive(Debug, Default)]
struct Ledger {
    charged: u64,
    /// Bytes whose unregistration failed: still locked, never released, never reused.
    unsafe_retained: u64,
}

/// Registers host ranges through a [`Residency`] port under a ceiling of whole segments,
/// asking the host (RLIMIT_MEMLOCK) first. Unregistering never frees or changes the bytes: the
/// region stays alive as long as its owners hold it.
pub struct Registrar {
    ceiling: u64,
    residency: Arc<dyn Residency>,
    probe: Arc<dyn AdmissionProbe>,
    ledger: Mutex<Ledger>,
}

impl std::fmt::Debug for Registrar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registrar").field("ceiling", &self.ceiling).finish_non_exhaustive()
    }
}

impl Registrar {
    /// A registrar with a ceiling of `ceiling` bytes (rounded down to whole segments).
    pub fn new(
        ceiling: u64,
        residency: Arc<dyn Residency>,
        probe: Arc<dyn AdmissionProbe>,
    ) -> Self {
        let ceiling = ceiling - ceiling % REGISTRATION_SEGMENT;
        Registrar { ceiling, residency, probe, ledger: Mutex::new(Ledger::default()) }
    }

    /// The ceiling in bytes (whole segments).
    pub fn ceiling(&self) -> u64 {
        self.ceiling
    }

    /// Bytes charged now (whole pages), including ranges whose unregistration failed.
    pub fn charged(&self) -> u64 {
        self.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner).charged
    }

    /// Bytes kept registered after a failed unregistration.
    pub fn unsafe_retained(&self) -> u64 {
        self.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner).unsafe_retained
    }

    /// Registers `slice` (read-only for mapped files). Refused with nothing changed when the
    /// ceiling would be exceeded or the host refuses (RLIMIT_MEMLOCK).
    pub fn register(
        &self,
        slice: HostSlice,
        read_only: bool,
    ) -> Result<RegisteredRange, SourceError> {
        let charge = (slice.len() as u64).div_ceil(HOST_PAGE) * HOST_PAGE;
        let mut ledger = self.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if ledger.charged + charge > self.ceiling {
            return Err(SourceError::CeilingExceeded {
                what: "registration",
                ceiling: self.ceiling,
                used: ledger.charged,
                requested: charge,
            });
        }
        // Joining a registration of the process (the same mapping, registered by another device
        // or session) locks no new memory: the host is not asked again.
        if !self.residency.host_registered(&slice) {
            let request = GrowthRequest {
                kind: GrowthKind::Registration,
                bytes: slice.len() as u64,
                registered_bytes: ledger.charged,
            };
            self.probe.admit(&request).into_result().map_err(SourceError::Refused)?;
        }
        let registration = self.residency.register_host(slice, read_only)?;
        ledger.charged += charge;
        Ok(RegisteredRange { registration, charged: charge })
    }

    /// Unregisters a range. On failure the range stays registered and charged, is counted as
    /// unsafe-retained, and the error is returned: the pages are never released by force.
    pub fn unregister(&self, range: RegisteredRange) -> Result<(), SourceError> {
        let mut ledger = self.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match self.residency.unregister_host(&range.registration) {
            Ok(()) => {
                ledger.charged -= range.charged;
                Ok(())
            }
            Err(e) => {
                ledger.unsafe_retained += range.charged;
                // Keep the registration (and its region) alive for the life of the process.
                std::mem::forget(range);
                Err(SourceError::Device(e))
            }
        }
    }
}
