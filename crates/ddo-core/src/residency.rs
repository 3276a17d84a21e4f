//! The residency ports: device memory, streams, copies into the device, host registration, a
//! peer weight store and on-device transforms, each a small trait of its own; [`Residency`] is
//! all of them, what a [`crate::Platform`] holds.

use crate::{
    BackingId, DeviceError, DeviceOrdinal, DeviceRange, Dtype, HostSlice, PeerBuffer, Registration,
    Reservation, StreamId,
};

/// Device memory of one device, in the shape of CUDA's virtual memory management: reserve
/// addresses once, then map and unmap physical backing inside them, so the addresses a tensor
/// view points at never change while the reservation lives.
///
/// Contract (the adapter validates what it cheaply can and reports [`DeviceError::InvalidUse`]):
/// - Sizes and offsets passed to `reserve`, `create_backing`, `map` and `unmap` are multiples of
///   [`granularity`](DeviceMemory::granularity).
/// - `map` places the whole backing at `range` (same length) inside a live reservation, with
///   read/write access for this device; the range must not be mapped already.
/// - `read_back` copies device bytes to the host synchronously (waits for all work on the
///   device first). It exists for verification and tests, never for the hot path.
/// - A failing `unmap`, `release_backing` or `release_reservation` leaves the resource in place:
///   the caller keeps ownership and must not reuse it.
pub trait DeviceMemory: Send + Sync {
    /// The device this adapter manages.
    fn device(&self) -> DeviceOrdinal;
    /// The mapping granularity in bytes (a power of two).
    fn granularity(&self) -> Result<u64, DeviceError>;
    /// Reserves `len` bytes of device virtual addresses, backed by nothing.
    fn reserve(&self, len: u64) -> Result<Reservation, DeviceError>;
    /// Frees a reservation; everything inside it must be unmapped.
    fn release_reservation(&self, reservation: Reservation) -> Result<(), DeviceError>;
    /// Creates `len` bytes of physical device memory.
    fn create_backing(&self, len: u64) -> Result<BackingId, DeviceError>;
    /// Maps `backing` at `range` and grants this device access to it.
    fn map(&self, range: DeviceRange, backing: BackingId) -> Result<(), DeviceError>;
    /// Unmaps whatever is mapped at `range`; the addresses stay reserved.
    fn unmap(&self, range: DeviceRange) -> Result<(), DeviceError>;
    /// Frees physical memory; it must not be mapped anywhere.
    fn release_backing(&self, backing: BackingId) -> Result<(), DeviceError>;
    /// Copies `src` back to `dst` synchronously (verification only).
    fn read_back(&self, src: DeviceRange, dst: &mut [u8]) -> Result<(), DeviceError>;
}

/// The device's streams: the queues work is ordered on. Whoever creates a stream releases it.
pub trait Streams: Send + Sync {
    /// Creates a non-blocking stream for copies (and the conversions that follow them), at the
    /// device's highest priority where streams have priorities.
    fn create_stream(&self) -> Result<StreamId, DeviceError>;
    /// Gives back a stream [`create_stream`](Streams::create_stream) made, once no more work
    /// will be enqueued on it. Work already enqueued completes first and fences recorded on it
    /// stay valid; copies not yet covered by a recorded fence refuse the release
    /// ([`DeviceError::InvalidUse`]), as does a stream this adapter did not create (an adopted
    /// one belongs to its owner). Whoever creates a stream releases it: a stream is never
    /// reclaimed before the device is dropped otherwise.
    fn release_stream(&self, stream: StreamId) -> Result<(), DeviceError>;
}

/// Host-to-device copies.
///
/// Contract: `copy_to_device` enqueues an asynchronous copy on `stream` into a mapped range. The
/// adapter keeps `src` (and so its region) alive until the copy has completed; completion is
/// observed through a [`crate::Fence`] value recorded on `stream` after the call.
pub trait Copies: Send + Sync {
    /// Enqueues a host-to-device copy of `src` into `dst` (same length) on `stream`.
    fn copy_to_device(
        &self,
        src: HostSlice,
        dst: DeviceRange,
        stream: StreamId,
    ) -> Result<(), DeviceError>;
    /// Drops the device's hold on the source of every copy already proven complete (a host
    /// buffer whose copies are done then has no owner but its own), without waiting for any
    /// work in flight and without a device-wide synchronize. Copies no fence covers yet count:
    /// the adapter marks where they are (an upload still being enqueued may wait for a buffer
    /// its own first copies hold), so a later call releases them once they complete. Adapters
    /// that keep a copy's [`HostSlice`] past the copy's completion implement it; the default
    /// does nothing (an adapter that copies synchronously, or releases each source at
    /// completion, holds none).
    fn retire_completed_copies(&self) -> Result<(), DeviceError> {
        Ok(())
    }
}

/// Host registration: page-locking host memory for copies at link speed.
///
/// Contract: `register_host` page-locks host memory for fast DMA; `unregister_host` undoes it
/// and never frees or changes the bytes. On CUDA, unregistering waits for all device work: call
/// it only at phase boundaries. A failing `unregister_host` leaves the registration in place:
/// the caller keeps ownership.
pub trait HostRegistration: Send + Sync {
    /// Page-locks `slice` for DMA; `read_only` for memory the device only reads (mapped files).
    fn register_host(&self, slice: HostSlice, read_only: bool)
    -> Result<Registration, DeviceError>;
    /// Undoes a registration; the bytes stay as they are.
    fn unregister_host(&self, registration: &Registration) -> Result<(), DeviceError>;
    /// Whether exactly `slice` is already page-locked in this process (by another device or
    /// session): registering it again joins that registration and locks no new memory. The
    /// default: never (an adapter whose registrations are its own).
    fn host_registered(&self, slice: &HostSlice) -> bool {
        let _ = slice;
        false
    }
}

/// A weight store in another device's memory, read over the peer link. None by default.
pub trait PeerStore: Send + Sync {
    /// Allocates `len` bytes of `peer`'s memory (another GPU, or this one) that this device
    /// reads over the peer link: a weight store copies come from. Refused with a message saying
    /// why where this device cannot read `peer`'s memory (no peer access between them). None by
    /// default.
    fn create_peer_buffer(&self, peer: DeviceOrdinal, len: u64) -> Result<PeerBuffer, DeviceError> {
        let _ = len;
        Err(DeviceError::Unsupported(format!(
            "this device keeps no weight store in {peer}'s memory"
        )))
    }
    /// Writes `src` into `buffer` at `offset`, synchronously (filling the store at load).
    fn write_peer_buffer(
        &self,
        buffer: PeerBuffer,
        offset: u64,
        src: &[u8],
    ) -> Result<(), DeviceError> {
        let _ = (buffer, offset, src);
        Err(DeviceError::Unsupported("this device keeps no peer weight store".into()))
    }
    /// Enqueues on `stream` a copy of `dst.len` bytes of `buffer` at `offset` into `dst` (a
    /// mapped range of this device), completion observed like a host copy's.
    fn copy_from_peer(
        &self,
        buffer: PeerBuffer,
        offset: u64,
        dst: DeviceRange,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let _ = (buffer, offset, dst, stream);
        Err(DeviceError::Unsupported("this device keeps no peer weight store".into()))
    }
    /// Enqueues on `stream` a copy of `src` (a mapped range of this device) into `buffer` at
    /// `offset`: filling the store with bytes already on this device.
    fn copy_into_peer(
        &self,
        src: DeviceRange,
        buffer: PeerBuffer,
        offset: u64,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let _ = (src, buffer, offset, stream);
        Err(DeviceError::Unsupported("this device keeps no peer weight store".into()))
    }
    /// Frees a peer buffer; no enqueued copy may still read it (waits for the device's work
    /// on CUDA). A failure keeps it allocated.
    fn release_peer_buffer(&self, buffer: PeerBuffer) -> Result<(), DeviceError> {
        let _ = buffer;
        Err(DeviceError::Unsupported("this device keeps no peer weight store".into()))
    }
}

/// Work on the device that turns uploaded bytes into the served ones: dtype conversion and the
/// decoding of entropy-coded weights. None by default.
pub trait Transforms: Send + Sync {
    /// Whether [`convert`](Transforms::convert) turns `from` elements into `to` elements on this
    /// device. None by default.
    fn converts(&self, from: Dtype, to: Dtype) -> bool {
        let _ = (from, to);
        false
    }
    /// Enqueues on `stream` the conversion of the `from` elements at `src` into `to` elements at
    /// `dst`, with values as [`crate::convert`] gives them (NaN payloads aside). Both ranges are
    /// mapped, hold the same number of elements and do not overlap; work enqueued on `stream`
    /// before (the copy that filled `src`) completes first.
    fn convert(
        &self,
        src: DeviceRange,
        from: Dtype,
        dst: DeviceRange,
        to: Dtype,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let _ = (src, dst, stream);
        Err(DeviceError::Unsupported(format!(
            "this device does not convert {} to {}",
            from.as_str(),
            to.as_str()
        )))
    }
    /// Whether [`decode`](Transforms::decode) decodes entropy-coded bf16 weights on this
    /// device. None by default.
    fn decodes(&self) -> bool {
        false
    }
    /// Enqueues on `stream` the decoding of the bf16 encoding at `src` (the bytes
    /// `ddo_codec::EncodedBf16::to_bytes` writes, starting 4-byte aligned) into its
    /// `dst.len / 2` bf16 elements at `dst`, bit for bit. Both ranges are mapped and do not
    /// overlap; work enqueued on `stream` before (the copy that filled `src`) completes first.
    /// Adapters bound every read by `src` and every write by `dst` whatever the bytes hold.
    fn decode(
        &self,
        src: DeviceRange,
        dst: DeviceRange,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let _ = (src, dst, stream);
        Err(DeviceError::Unsupported("this device does not decode encoded weights".into()))
    }
    /// Bytes written and device seconds taken by the decodes enqueued on `stream` that are
    /// known complete (as the device timed them; host wall time where decoding is
    /// synchronous). `(0, 0.0)` by default. A released stream's totals are forgotten: the
    /// device may give its id to a new stream, so whoever reports them reads them before
    /// releasing the stream.
    fn decode_totals(&self, stream: StreamId) -> (u64, f64) {
        let _ = stream;
        (0, 0.0)
    }
}

/// One device's ports together: what the arena and the session use through a
/// [`crate::Platform`]. Implemented for every type that implements the six ports; a caller that
/// needs one of them takes that port alone (`&dyn HostRegistration`, `&dyn Streams`).
pub trait Residency:
    DeviceMemory + Streams + Copies + HostRegistration + PeerStore + Transforms
{
}

impl<T> Residency for T where
    T: DeviceMemory + Streams + Copies + HostRegistration + PeerStore + Transforms + ?Sized
{
}

#[cfg(feature = "mocks")]
mockall::mock! {
    /// A device whose every port call is an expectation (`expect_create_stream`, ...).
    pub Residency {}
    impl DeviceMemory for Residency {
        fn device(&self) -> DeviceOrdinal;
        fn granularity(&self) -> Result<u64, DeviceError>;
        fn reserve(&self, len: u64) -> Result<Reservation, DeviceError>;
        fn release_reservation(&self, reservation: Reservation) -> Result<(), DeviceError>;
        fn create_backing(&self, len: u64) -> Result<BackingId, DeviceError>;
        fn map(&self, range: DeviceRange, backing: BackingId) -> Result<(), DeviceError>;
        fn unmap(&self, range: DeviceRange) -> Result<(), DeviceError>;
        fn release_backing(&self, backing: BackingId) -> Result<(), DeviceError>;
        fn read_back(&self, src: DeviceRange, dst: &mut [u8]) -> Result<(), DeviceError>;
    }
    impl Streams for Residency {
        fn create_stream(&self) -> Result<StreamId, DeviceError>;
        fn release_stream(&self, stream: StreamId) -> Result<(), DeviceError>;
    }
    impl Copies for Residency {
        fn copy_to_device(
            &self,
            src: HostSlice,
            dst: DeviceRange,
            stream: StreamId,
        ) -> Result<(), DeviceError>;
        fn retire_completed_copies(&self) -> Result<(), DeviceError>;
    }
    impl HostRegistration for Residency {
        fn register_host(&self, slice: HostSlice, read_only: bool)
            -> Result<Registration, DeviceError>;
        fn unregister_host(&self, registration: &Registration) -> Result<(), DeviceError>;
        fn host_registered(&self, slice: &HostSlice) -> bool;
    }
    impl PeerStore for Residency {
        fn create_peer_buffer(&self, peer: DeviceOrdinal, len: u64) -> Result<PeerBuffer, DeviceError>;
        fn write_peer_buffer(
            &self,
            buffer: PeerBuffer,
            offset: u64,
            src: &[u8],
        ) -> Result<(), DeviceError>;
        fn copy_from_peer(
            &self,
            buffer: PeerBuffer,
            offset: u64,
            dst: DeviceRange,
            stream: StreamId,
        ) -> Result<(), DeviceError>;
        fn copy_into_peer(
            &self,
            src: DeviceRange,
            buffer: PeerBuffer,
            offset: u64,
            stream: StreamId,
        ) -> Result<(), DeviceError>;
        fn release_peer_buffer(&self, buffer: PeerBuffer) -> Result<(), DeviceError>;
    }
    impl Transforms for Residency {
        fn converts(&self, from: Dtype, to: Dtype) -> bool;
        fn convert(
            &self,
            src: DeviceRange,
            from: Dtype,
            dst: DeviceRange,
            to: Dtype,
            stream: StreamId,
        ) -> Result<(), DeviceError>;
        fn decodes(&self) -> bool;
        fn decode(
            &self,
            src: DeviceRange,
            dst: DeviceRange,
            stream: StreamId,
        ) -> Result<(), DeviceError>;
        fn decode_totals(&self, stream: StreamId) -> (u64, f64);
    }
}
