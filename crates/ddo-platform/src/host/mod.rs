//! The host backend: ddo's device ports on real host memory, with no GPU.
//!
//! It emulates CUDA's virtual memory management faithfully with Linux primitives: a reservation
//! is an inaccessible anonymous mapping, a backing is a `memfd`, mapping places the memfd at a
//! fixed address inside the reservation (`MAP_SHARED | MAP_FIXED`), so one backing can be mapped
//! at several addresses at once and every address is a real pointer. Copies are synchronous
//! `memcpy`s; fences are signalled when recorded. The whole arena runs on it without a GPU, with
//! the same layouts and addresses semantics as on CUDA.

mod vm;

use ddo_core::{Copies, DeviceMemory, HostRegistration, PeerStore, Streams, Transforms};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use ddo_core::{
    BackingId, DeviceError, DeviceOrdinal, DeviceRange, Dtype, Fence, FenceValue, HostSlice,
    PeerBuffer, Registration, Reservation, StreamId,
};

use vm::{Backing, ReservedSpan};

use crate::book::AddressBook;

/// Default mapping granularity of the host backend: 2 MiB, as on current NVIDIA GPUs.
pub const HOST_GRANULARITY: u64 = 2 << 20;

#[derive(Debug, Default)]
struct State {
    book: AddressBook,
    reservations: BTreeMap<u64, ReservedSpan>,
    backings: HashMap<BackingId, Backing>,
    next_backing: u64,
    /// Live registrations by handle, each holding its host memory until it is unregistered,
    /// as the CUDA adapter does.
    registered: HashMap<u64, HostSlice>,
    next_registration: u64,
    /// Bytes written and wall seconds of the decodes done, by stream.
    decoded: HashMap<u64, (u64, f64)>,
    /// Live peer buffers (another device's memory, modelled in host memory) by start address.
    peers: HashMap<u64, Box<[u8]>>,
    /// Streams created and not yet released.
    streams: HashSet<u64>,
}

impl State {
    /// The bytes of `buffer` at `offset`, `len` long, when the buffer is live and holds them.
    fn peer_bytes(&self, buffer: PeerBuffer, offset: u64, len: u64) -> Result<&[u8], DeviceError> {
        let bytes = self
            .peers
            .get(&buffer.range.start.0)
            .filter(|b| b.len() as u64 == buffer.range.len)
            .ok_or_else(|| {
                DeviceError::InvalidUse(format!(
                    "peer buffer at {:#x} on {} is not live",
                    buffer.range.start.0, buffer.device
                ))
            })?;
        offset
            .checked_add(len)
            .filter(|&end| end <= bytes.len() as u64)
            .map(|end| &bytes[offset as usize..end as usize])
            .ok_or_else(|| {
                DeviceError::InvalidUse(format!(
                    "{len} bytes at {offset} run past the peer buffer's {} bytes",
                    bytes.len()
                ))
            })
    }
}

impl State {
    /// Refuses a copy from host memory that starts in a registered range and runs past its end,
    /// as CUDA does (`CUDA_ERROR_INVALID_VALUE`): page-locked sources must lie in one
    /// registration.
    fn check_source(&self, src: &HostSlice) -> Result<(), DeviceError> {
        let start = src.as_bytes().as_ptr() as u64;
        let end = start + src.len() as u64;
        for slice in self.registered.values() {
            let (at, len) = (slice.as_bytes().as_ptr() as u64, slice.len() as u64);
            if (at..at + len).contains(&start) && end > at + len {
                return Err(DeviceError::InvalidUse(format!(
                    "a copy of {} bytes from {start:#x} starts in registered host memory \
                     [{at:#x}, {:#x}) and runs past its end",
                    src.len(),
                    at + len
                )));
            }
        }
        Ok(())
    }
}

/// Counters of what the host backend holds, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostUsage {
    /// Bytes of live backings ("device memory").
    pub backing_bytes: u64,
    /// Highest `backing_bytes` seen.
    pub peak_backing_bytes: u64,
    /// Bytes of live reservations (addresses only).
    pub reserved_bytes: u64,
    /// Bytes registered (accounting only).
    pub registered_bytes: u64,
    /// Bytes of live peer buffers (a peer device's memory, modelled in host memory).
    pub peer_bytes: u64,
}

/// A device made of host memory. Implements [`ddo_core::Residency`] and [`Fence`].
#[derive(Debug)]
pub struct HostDevice {
    granularity: u64,
    state: Mutex<State>,
    usage: Mutex<HostUsage>,
    next_stream: AtomicU64,
    next_fence: AtomicU64,
}

impl Default for HostDevice {
    fn default() -> Self {
        HostDevice::new()
    }
}

impl HostDevice {
    /// A host device with the default 2 MiB granularity.
    pub fn new() -> Self {
        HostDevice::with_granularity(HOST_GRANULARITY)
    }

    /// A host device with `granularity` (a multiple of the page size, a power of two); smaller
    /// granularities keep tests of tiny models small.
    pub fn with_granularity(granularity: u64) -> Self {
        let page = vm::page_size();
        assert!(
            granularity.is_power_of_two() && granularity.is_multiple_of(page),
            "granularity must be a power of two and a multiple of the {page}-byte page"
        );
        HostDevice {
            granularity,
            state: Mutex::new(State::default()),
            usage: Mutex::new(HostUsage::default()),
            next_stream: AtomicU64::new(1),
            next_fence: AtomicU64::new(1),
        }
    }

    /// What the device holds now.
    pub fn usage(&self) -> HostUsage {
        *self.usage.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Streams [`create_stream`](Streams::create_stream) made that were not released: what a
    /// test counts to prove that nothing leaks streams.
    pub fn live_streams(&self) -> usize {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).streams.len()
    }

    fn invalid(message: String) -> DeviceError {
        DeviceError::InvalidUse(message)
    }
}

impl DeviceMemory for HostDevice {
    fn device(&self) -> DeviceOrdinal {
        DeviceOrdinal(0)
    }

    fn granularity(&self) -> Result<u64, DeviceError> {
        Ok(self.granularity)
    }

    fn reserve(&self, len: u64) -> Result<Reservation, DeviceError> {
        AddressBook::check_aligned(self.granularity, "reservation length", len)?;
        let span = ReservedSpan::new(len, self.granularity)?;
        let start = span.start();
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.reservations.insert(start, span);
        state.book.add_reservation(start, len);
        self.usage.lock().unwrap_or_else(std::sync::PoisonError::into_inner).reserved_bytes += len;
        Ok(Reservation { range: DeviceRange { start: ddo_core::DeviceAddress(start), len } })
    }

    fn release_reservation(&self, reservation: Reservation) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let start = reservation.range.start.0;
        state.book.check_release_reservation(reservation.range)?;
        state.book.remove_reservation(start);
        drop(state.reservations.remove(&start));
        self.usage.lock().unwrap_or_else(std::sync::PoisonError::into_inner).reserved_bytes -=
            reservation.range.len;
        Ok(())
    }

    fn create_backing(&self, len: u64) -> Result<BackingId, DeviceError> {
        AddressBook::check_aligned(self.granularity, "backing length", len)?;
        let backing = Backing::new(len)?;
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let id = BackingId(state.next_backing);
        state.next_backing += 1;
        state.backings.insert(id, backing);
        state.book.add_backing(id, len);
        let mut usage = self.usage.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        usage.backing_bytes += len;
        usage.peak_backing_bytes = usage.peak_backing_bytes.max(usage.backing_bytes);
        Ok(id)
    }

    fn map(&self, range: DeviceRange, backing: BackingId) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.book.check_map(range, backing, self.granularity)?;
        state.backings[&backing].map_at(range.start.0)?;
        state.book.add_mapping(range, backing);
        Ok(())
    }

    fn unmap(&self, range: DeviceRange) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.book.check_unmap(range)?;
        vm::protect_none(range.start.0, range.len)?;
        state.book.remove_mapping(range.start.0);
        Ok(())
    }

    fn release_backing(&self, backing: BackingId) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let len = state.book.check_release_backing(backing)?;
        state.book.remove_backing(backing);
        state.backings.remove(&backing);
        self.usage.lock().unwrap_or_else(std::sync::PoisonError::into_inner).backing_bytes -= len;
        Ok(())
    }

    fn read_back(&self, src: DeviceRange, dst: &mut [u8]) -> Result<(), DeviceError> {
        AddressBook::check_lengths("read", dst.len(), src.len)?;
        let state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.book.check_mapped(src)?;
        // SAFETY: `src` lies inside a live mapping (checked under the lock); `dst` is a distinct
        // host buffer of the same length.
        unsafe {
            std::ptr::copy_nonoverlapping(src.start.0 as *const u8, dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }
}

impl Streams for HostDevice {
    fn create_stream(&self) -> Result<StreamId, DeviceError> {
        let stream = self.next_stream.fetch_add(1, Ordering::Relaxed);
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).streams.insert(stream);
        Ok(StreamId(stream))
    }

    fn release_stream(&self, stream: StreamId) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Copies run synchronously: nothing is in flight on the stream.
        if !state.streams.remove(&stream.0) {
            return Err(Self::invalid(format!(
                "stream {} was not created by this device or was released already",
                stream.0
            )));
        }
        // Its id may name a new stream, which starts with no decodes.
        state.decoded.remove(&stream.0);
        Ok(())
    }
}

impl Copies for HostDevice {
    fn copy_to_device(
        &self,
        src: HostSlice,
        dst: DeviceRange,
        _stream: StreamId,
    ) -> Result<(), DeviceError> {
        AddressBook::check_lengths("copy", src.len(), dst.len)?;
        let state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.book.check_mapped(dst)?;
        state.check_source(&src)?;
        // SAFETY: `dst` lies inside a live read/write mapping of this device (checked under the
        // lock, which also keeps it mapped during the copy); `src` is a live host slice of the
        // same length; the two cannot overlap (device mappings are memfd pages owned here).
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_bytes().as_ptr(),
                dst.start.0 as *mut u8,
                src.len(),
            )
        };
        Ok(())
    }
}

impl HostRegistration for HostDevice {
    fn register_host(
        &self,
        slice: HostSlice,
        _read_only: bool,
    ) -> Result<Registration, DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let handle = state.next_registration;
        state.next_registration += 1;
        state.registered.insert(handle, slice.clone());
        self.usage.lock().unwrap_or_else(std::sync::PoisonError::into_inner).registered_bytes +=
            slice.len() as u64;
        Ok(Registration { slice, handle })
    }

    fn unregister_host(&self, registration: &Registration) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let slice = state.registered.remove(&registration.handle).ok_or_else(|| {
            Self::invalid(format!("registration {} is not live", registration.handle))
        })?;
        self.usage.lock().unwrap_or_else(std::sync::PoisonError::into_inner).registered_bytes -=
            slice.len() as u64;
        Ok(())
    }
}

impl PeerStore for HostDevice {
    /// Any ordinal: the host backend models every device's memory in host memory.
    fn create_peer_buffer(&self, peer: DeviceOrdinal, len: u64) -> Result<PeerBuffer, DeviceError> {
        if len == 0 {
            return Err(Self::invalid("a peer buffer holds at least one byte".into()));
        }
        let mut bytes = Vec::new();
        bytes
            .try_reserve_exact(len as usize)
            .map_err(|_| DeviceError::OutOfMemory { requested: len })?;
        bytes.resize(len as usize, 0);
        let bytes = bytes.into_boxed_slice();
        let start = bytes.as_ptr() as u64;
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.peers.insert(start, bytes);
        self.usage.lock().unwrap_or_else(std::sync::PoisonError::into_inner).peer_bytes += len;
        Ok(PeerBuffer {
            device: peer,
            range: DeviceRange { start: ddo_core::DeviceAddress(start), len },
        })
    }

    fn write_peer_buffer(
        &self,
        buffer: PeerBuffer,
        offset: u64,
        src: &[u8],
    ) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.peer_bytes(buffer, offset, src.len() as u64)?;
        let bytes = state.peers.get_mut(&buffer.range.start.0).expect("checked");
        bytes[offset as usize..offset as usize + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn copy_from_peer(
        &self,
        buffer: PeerBuffer,
        offset: u64,
        dst: DeviceRange,
        _stream: StreamId,
    ) -> Result<(), DeviceError> {
        let state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.book.check_mapped(dst)?;
        let src = state.peer_bytes(buffer, offset, dst.len)?;
        // SAFETY: `dst` lies inside a live read/write mapping of this device (checked under the
        // lock, which keeps it mapped during the copy); `src` is a live peer buffer of the same
        // length, owned here and never mapped as device memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.start.0 as *mut u8, src.len()) };
        Ok(())
    }

    fn copy_into_peer(
        &self,
        src: DeviceRange,
        buffer: PeerBuffer,
        offset: u64,
        _stream: StreamId,
    ) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.book.check_mapped(src)?;
        state.peer_bytes(buffer, offset, src.len)?;
        let bytes = state.peers.get_mut(&buffer.range.start.0).expect("checked");
        // SAFETY: `src` lies inside a live mapping of this device (checked under the lock,
        // which keeps it mapped); the peer buffer is host memory owned here, never mapped.
        let from =
            unsafe { std::slice::from_raw_parts(src.start.0 as *const u8, src.len as usize) };
        bytes[offset as usize..(offset + src.len) as usize].copy_from_slice(from);
        Ok(())
    }

    fn release_peer_buffer(&self, buffer: PeerBuffer) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.peer_bytes(buffer, 0, 0)?;
        state.peers.remove(&buffer.range.start.0);
        self.usage.lock().unwrap_or_else(std::sync::PoisonError::into_inner).peer_bytes -=
            buffer.range.len;
        Ok(())
    }
}

impl Transforms for HostDevice {
    fn converts(&self, from: Dtype, to: Dtype) -> bool {
        ddo_core::convertible(from, to)
    }

    fn convert(
        &self,
        src: DeviceRange,
        from: Dtype,
        dst: DeviceRange,
        to: Dtype,
        _stream: StreamId,
    ) -> Result<(), DeviceError> {
        let state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.book.check_conversion(src, from, dst, to)?;
        // SAFETY: both ranges lie inside live mappings of this device (checked under the lock,
        // which keeps them mapped) and do not overlap (checked).
        let (s, d) = unsafe {
            (
                std::slice::from_raw_parts(src.start.0 as *const u8, src.len as usize),
                std::slice::from_raw_parts_mut(dst.start.0 as *mut u8, dst.len as usize),
            )
        };
        ddo_core::convert(from, to, s, d);
        Ok(())
    }

    fn decodes(&self) -> bool {
        true
    }

    /// Decodes at once, as every host operation runs: parses the encoding (its CRC checked) and
    /// decodes it with [`ddo_codec::decode_bf16`]. A damaged encoding is refused, naming what is
    /// wrong, with `dst` perhaps partly written.
    fn decode(
        &self,
        src: DeviceRange,
        dst: DeviceRange,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.book.check_decode(src, dst)?;
        let started = std::time::Instant::now();
        // SAFETY: both ranges lie inside live mappings of this device (checked under the lock,
        // which keeps them mapped) and do not overlap (checked).
        let (s, d) = unsafe {
            (
                std::slice::from_raw_parts(src.start.0 as *const u8, src.len as usize),
                std::slice::from_raw_parts_mut(dst.start.0 as *mut u8, dst.len as usize),
            )
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
        ddo_codec::EncodedBf16::parse(s)
            .and_then(|encoding| ddo_codec::decode_bf16(&encoding, d, threads))
            .map_err(|e| {
                Self::invalid(format!(
                    "the encoding of {} bytes at {:#x} does not decode into {} bytes: {e}",
                    src.len, src.start.0, dst.len
                ))
            })?;
        let total = state.decoded.entry(stream.0).or_default();
        total.0 += dst.len;
        total.1 += started.elapsed().as_secs_f64();
        Ok(())
    }

    fn decode_totals(&self, stream: StreamId) -> (u64, f64) {
        let state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.decoded.get(&stream.0).copied().unwrap_or_default()
    }
}

impl Fence for HostDevice {
    fn record(&self, _stream: StreamId) -> Result<FenceValue, DeviceError> {
        Ok(FenceValue(self.next_fence.fetch_add(1, Ordering::AcqRel)))
    }

    fn query(&self, value: FenceValue) -> Result<bool, DeviceError> {
        if value.0 >= self.next_fence.load(Ordering::Acquire) {
            return Err(Self::invalid(format!("fence value {} was never recorded", value.0)));
        }
        Ok(true)
    }

    fn wait(&self, value: FenceValue) -> Result<(), DeviceError> {
        self.query(value).map(|_| ())
    }

    fn stream_wait(&self, _stream: StreamId, value: FenceValue) -> Result<(), DeviceError> {
        self.query(value).map(|_| ())
    }
}

impl Drop for HostDevice {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Mappings live inside reservations: dropping the reservations (munmap) removes them.
        state.reservations.clear();
        state.backings.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ddo_core::{HostBytes, HostRegion, HostSlice, StreamId};

    use super::*;

    #[test]
    fn registered_memory_lives_until_unregistered_or_the_device_is_dropped() {
        let device = HostDevice::new();
        let region: Arc<dyn HostRegion> = Arc::new(HostBytes::from(vec![1u8; 4096]));
        let alive = Arc::downgrade(&region);
        let registration = device.register_host(HostSlice::whole(region), true).unwrap();
        drop(registration);
        assert!(alive.upgrade().is_some(), "the device holds registered memory");
        drop(device);
        assert!(alive.upgrade().is_none(), "a dropped device lets its registrations go");

        let device = HostDevice::new();
        let region: Arc<dyn HostRegion> = Arc::new(HostBytes::from(vec![1u8; 4096]));
        let alive = Arc::downgrade(&region);
        let registration = device.register_host(HostSlice::whole(region), true).unwrap();
        device.unregister_host(&registration).unwrap();
        drop(registration);
        assert!(alive.upgrade().is_none(), "unregistered memory is the caller's again");
    }

    #[test]
    fn decoding_gives_the_bf16_bytes_back_and_refuses_a_damaged_encoding() {
        let device = HostDevice::with_granularity(64 << 10);
        assert!(device.decodes());
        let bf16: Vec<u8> =
            (0..3000u32).flat_map(|i| (0x3c00 + (i % 700) as u16).to_le_bytes()).collect();
        let encoding = ddo_codec::encode_bf16(&bf16, 2).unwrap().to_bytes();
        let g = device.granularity().unwrap();
        let r = device.reserve(g).unwrap().range;
        let b = device.create_backing(g).unwrap();
        device.map(r, b).unwrap();
        let src = DeviceRange { start: r.start, len: encoding.len() as u64 };
        let dst = DeviceRange { start: r.start.offset(32 << 10), len: bf16.len() as u64 };
        let upload = |bytes: Vec<u8>| {
            let host = HostSlice::whole(Arc::new(HostBytes::from(bytes)) as Arc<dyn HostRegion>);
            device.copy_to_device(host, src, StreamId(0)).unwrap();
        };
        upload(encoding.clone());
        device.decode(src, dst, StreamId(0)).unwrap();
        let mut out = vec![0u8; bf16.len()];
        device.read_back(dst, &mut out).unwrap();
        assert!(out == bf16, "the decoded bytes");
        let (bytes, seconds) = device.decode_totals(StreamId(0));
        assert_eq!(bytes, bf16.len() as u64);
        assert!(seconds > 0.0);
        assert_eq!(device.decode_totals(StreamId(1)), (0, 0.0), "another stream decoded nothing");

        let mut damaged = encoding.clone();
        *damaged.last_mut().unwrap() ^= 1;
        upload(damaged);
        let e = device.decode(src, dst, StreamId(0)).unwrap_err();
        assert!(matches!(e, DeviceError::InvalidUse(_)), "{e:?}");
        assert!(e.to_string().contains("corrupt encoding: the body's CRC-32"), "{e}");

        upload(encoding);
        let shorter = DeviceRange { start: dst.start, len: dst.len - 2 };
        let e = device.decode(src, shorter, StreamId(0)).unwrap_err().to_string();
        assert!(e.contains("the decoded tensor is 6000 bytes; the destination has 5998"), "{e}");
        assert_eq!(
            device.decode_totals(StreamId(0)).0,
            bf16.len() as u64,
            "refusals count nothing"
        );
    }

    #[test]
    fn a_released_stream_forgets_its_decode_totals() {
        let device = HostDevice::with_granularity(64 << 10);
        let bf16: Vec<u8> = (0..3000u32).flat_map(|i| (0x3c00 + i as u16).to_le_bytes()).collect();
        let encoding = ddo_codec::encode_bf16(&bf16, 2).unwrap().to_bytes();
        let g = device.granularity().unwrap();
        let r = device.reserve(g).unwrap().range;
        let b = device.create_backing(g).unwrap();
        device.map(r, b).unwrap();
        let src = DeviceRange { start: r.start, len: encoding.len() as u64 };
        let dst = DeviceRange { start: r.start.offset(32 << 10), len: bf16.len() as u64 };
        let stream = device.create_stream().unwrap();
        let host = HostSlice::whole(Arc::new(HostBytes::from(encoding)) as Arc<dyn HostRegion>);
        device.copy_to_device(host, src, stream).unwrap();
        device.decode(src, dst, stream).unwrap();
        assert_eq!(device.decode_totals(stream).0, bf16.len() as u64);
        device.release_stream(stream).unwrap();
        assert_eq!(device.decode_totals(stream), (0, 0.0));
    }

    #[test]
    fn a_copy_that_starts_in_a_registration_must_end_in_it() {
        let device = HostDevice::new();
        let g = device.granularity().unwrap();
        let r = device.reserve(g).unwrap().range;
        let b = device.create_backing(g).unwrap();
        device.map(r, b).unwrap();
        let host =
            HostSlice::whole(Arc::new(HostBytes::from(vec![7u8; 8192])) as Arc<dyn HostRegion>);
        let registration = device.register_host(host.slice(0, 4096).unwrap(), true).unwrap();
        let to = |len: u64| DeviceRange { start: r.start, len };
        let s = StreamId(0);
        device.copy_to_device(host.slice(0, 4096).unwrap(), to(4096), s).unwrap();
        device.copy_to_device(host.slice(4096, 4096).unwrap(), to(4096), s).unwrap();
        let err = device.copy_to_device(host.slice(2048, 4096).unwrap(), to(4096), s).unwrap_err();
        assert!(err.to_string().contains("runs past its end"), "{err}");
        device.unregister_host(&registration).unwrap();
        device.copy_to_device(host.slice(2048, 4096).unwrap(), to(4096), s).unwrap();
    }
}
