//! The set of adapters a host builds once.

use std::sync::Arc;

use crate::{AdmissionProbe, Fence, Residency};

/// The adapters ddo runs on, as one value. Build it once per device; to change one adapter in a
/// test, use struct update syntax:
///
/// ```
/// # use std::sync::Arc;
/// # use ddo_core::{Platform, AdmissionProbe, Admission, GrowthRequest, HostMemoryObservation};
/// # #[derive(Debug)] struct Generous;
/// # impl AdmissionProbe for Generous {
/// #     fn admit(&self, _: &GrowthRequest) -> Admission { Admission::Granted { headroom: u64::MAX } }
/// #     fn observe(&self) -> HostMemoryObservation { HostMemoryObservation::default() }
/// # }
/// fn with_generous_host(platform: &Platform) -> Platform {
///     Platform { admission: Arc::new(Generous), ..platform.clone() }
/// }
/// ```
#[derive(Clone)]
pub struct Platform {
    /// A short name of the backend (`cuda`, `host`).
    pub name: &'static str,
    /// Device memory.
    pub residency: Arc<dyn Residency>,
    /// Completion tracking for the same device.
    pub fences: Arc<dyn Fence>,
    /// Host-memory admission.
    pub admission: Arc<dyn AdmissionProbe>,
}

impl std::fmt::Debug for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Platform").field("name", &self.name).finish_non_exhaustive()
    }
}
