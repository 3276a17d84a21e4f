//! The core of ddo: the ports every hardware or storage adapter implements, the domain types they
//! exchange, and the errors they report.
//!
//! ddo streams diffusion-model weights from host memory (or disk) to a GPU just before each block
//! runs, inside a bounded GPU weight arena. This crate holds no I/O and no `unsafe` code beyond
//! the host-region contract (an `unsafe trait`, implemented once for owned bytes): it states the
//! contracts. Four small `Send + Sync` ports describe the outside world:
//!
//! - [`WeightSource`]: immutable tensor slices of a checkpoint and their bytes;
//! - [`Residency`]: one device's ports together, each a trait of a few methods:
//!   [`DeviceMemory`] (address reservations, physical backing, mappings), [`Streams`],
//!   [`Copies`], [`HostRegistration`], [`PeerStore`] and [`Transforms`] (dtype conversion and
//!   decoding on the device);
//! - [`Fence`]: monotonic completion values recorded on streams;
//! - [`AdmissionProbe`]: whether the host can take more retained, staged or registered bytes.
//!
//! Adapters are values: a [`Platform`] holds one of each, so a test replaces a single field
//! (struct update syntax) and keeps the rest. Hardware-facing ports are synchronous or poll-based;
//! a fence is a value you query or wait on, never a future.
// Denied, not forbidden: the host-region contract is an `unsafe trait` (declared, and implemented
// once for owned bytes, in `host.rs`); nothing else here is unsafe.
#![deny(unsafe_code)]

mod admission;
mod bytes;
mod convert;
mod device;
mod dropped;
mod dtype;
mod error;
mod fence;
mod host;
mod platform;
mod residency;
mod source;
mod tensor;
mod topology;
mod unit;

pub use admission::{
    Admission, AdmissionProbe, CgroupMemory, GrowthKind, GrowthRequest, HostMemoryObservation,
    OvercommitMode, Refusal, RefusalReason,
};
pub use bytes::{ByteSize, GIB, KIB, MIB};
pub use convert::{convert, convertible};
pub use device::{
    BackingId, DeviceAddress, DeviceOrdinal, DeviceRange, PeerBuffer, Reservation, StreamId,
};
pub use dropped::{DropFailure, note_drop_failure, take_drop_failures};
pub use dtype::{Dtype, UnknownDtype};
pub use error::{DeviceError, PlatformError, SourceError};
pub use fence::{Fence, FenceValue};
pub use host::{HostBytes, HostRegion, HostSlice, Registration};
pub use platform::Platform;
pub use residency::{
    Copies, DeviceMemory, HostRegistration, PeerStore, Residency, Streams, Transforms,
};
pub use source::{FileRange, ReadRequest, WeightSource};
pub use tensor::{CheckpointFileId, FileIdentity, TensorSlice};
pub use topology::{DeviceInfo, DeviceTopology, LinkMeasurement, PeerAccess};
pub use unit::{ExecutionUnit, SlotId, UnitId, UnitTensor};

#[cfg(feature = "mocks")]
pub use admission::MockAdmissionProbe;
#[cfg(feature = "mocks")]
pub use fence::MockFence;
#[cfg(feature = "mocks")]
pub use residency::MockResidency;
#[cfg(feature = "mocks")]
pub use source::MockWeightSource;
