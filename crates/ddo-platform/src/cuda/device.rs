//! [`CudaDevice`]: owned driver handles behind the device ports. Driver calls go through
//! cudarc's result layer (`driver`), or this crate's ([`super::result`]) where cudarc has none.

use ddo_core::{Copies, DeviceMemory, HostRegistration, PeerStore, Streams, Transforms};
use std::collections::{BTreeMap, HashMap};

use crate::book::AddressBook;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use ddo_core::{
    BackingId, DeviceAddress, DeviceError, DeviceOrdinal, DeviceRange, Dtype, Fence, FenceValue,
    HostSlice, PeerBuffer, Registration, Reservation, StreamId,
};

use cudarc::driver::result::{self as driver, DriverError};

use super::error::{CudaError, Named};
use super::result::vmm;
use super::sys;

/// Events kept outstanding before `record` starts retiring completed ones.
const RETIRE_AFTER: usize = 64;

#[derive(Debug, Default)]
struct State {
    book: AddressBook,
    /// Known streams: handle -> owned by this device.
    streams: HashMap<u64, bool>,
    /// Live registrations by address, each holding its host memory: a registered range stays
    /// allocated until it is unregistered (or for good, when unregistering fails), whatever
    /// happens to the caller's [`Registration`].
    registrations: HashMap<u64, HostSlice>,
    /// Host slices of copies enqueued on a stream and not yet covered by a recorded fence.
    pending: Vec<(u64, HostSlice)>,
    /// Outstanding fence values: value -> (event handle, host slices held until completion).
    events: BTreeMap<u64, (usize, Vec<HostSlice>)>,
    free_events: Vec<usize>,
    next_value: u64,
    /// Conversion kernels by dtype pair: the function, or `None` where the driver could not
    /// compile it for this device (an older GPU).
    kernels: HashMap<(Dtype, Dtype), Option<usize>>,
    /// The decoding kernel once loaded: the function, or `None` where the driver could not
    /// load its PTX (a driver older than CUDA 12.0, a GPU older than Ampere).
    decoder: Option<Option<usize>>,
    /// Modules loaded for the kernels, unloaded at drop.
    modules: Vec<usize>,
    /// Decodes enqueued and not yet known complete, in enqueue order, each between two timing
    /// events.
    timed: Vec<TimedDecode>,
    /// Bytes written and device seconds of the decodes known complete, by stream.
    decoded: HashMap<u64, (u64, f64)>,
    /// Timing events free for reuse.
    free_timing: Vec<usize>,
    /// Live peer buffers by address: (physical allocation, mapped length).
    peers: HashMap<u64, (sys::CUmemGenericAllocationHandle, usize)>,
}

/// A decode between two timing events recorded on its stream.
#[derive(Debug)]
struct TimedDecode {
    stream: u64,
    start: usize,
    end: usize,
    bytes: u64,
}

/// A CUDA device (its primary context) implementing [`ddo_core::Residency`] and [`Fence`].
///
/// Device addresses and stream ids are the driver's own values, so they can be handed to other
/// CUDA code (PyTorch, cuBLAS) in the same process. Streams this device did not create must be
/// introduced with [`CudaDevice::adopt_stream`] before use; stream 0 (the legacy default
/// stream) is always known.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: u32,
    dev: sys::CUdevice,
    ctx: usize,
    granularity: u64,
    state: Mutex<State>,
}

impl CudaDevice {
    /// Opens device `ordinal` through its primary context. Fails with
    /// [`DeviceError::DriverNotFound`] when no driver library exists, and with
    /// [`DeviceError::InvalidDevice`] for an ordinal the machine lacks.
    pub fn new(ordinal: u32) -> Result<Arc<CudaDevice>, DeviceError> {
        if !super::driver_present() {
            return Err(DeviceError::DriverNotFound);
        }
        driver::init().named("cuInit")?;
        let count = driver::device::get_count().named("cuDeviceGetCount")?;
        let Ok(index) = i32::try_from(ordinal) else {
            return Err(DeviceError::InvalidDevice { ordinal, count: count as u32 });
        };
        if index >= count {
            return Err(DeviceError::InvalidDevice { ordinal, count: count as u32 });
        }
        let dev = driver::device::get(index).named("cuDeviceGet")?;
        // SAFETY: `dev` came from cuDeviceGet; the retain is balanced by the release in drop.
        let ctx = unsafe { driver::primary_ctx::retain(dev) }.named("cuDevicePrimaryCtxRetain")?;
        let device = CudaDevice {
            ordinal,
            dev,
            ctx: ctx as usize,
            granularity: 0,
            state: Mutex::new(State { next_value: 1, ..State::default() }),
        };
        device.bind()?;
        let granularity = vmm::granularity(index).named("cuMemGetAllocationGranularity")? as u64;
        let mut device = device;
        device.granularity = granularity;
        device
            .state
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .streams
            .insert(0, false);
        Ok(Arc::new(device))
    }

    fn index(&self) -> i32 {
        self.ordinal as i32
    }

    /// Makes the primary context current on the calling thread.
    fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: `ctx` is the retained primary context, live until drop.
        unsafe { driver::ctx::set_current(self.ctx as sys::CUcontext) }.named("cuCtxSetCurrent")
    }

    /// Introduces a stream created elsewhere (PyTorch's current stream) so ports accept it.
    ///
    /// # Safety
    /// 1. `raw` is a live `CUstream` of this device's primary context.
    /// 2. It stays alive while any port call uses it.
    pub unsafe fn adopt_stream(&self, raw: u64) -> StreamId {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .streams
            .entry(raw)
            .or_insert(false);
        StreamId(raw)
    }

    /// The raw `CUstream` of `stream`, for other CUDA libraries in the same process.
    pub fn raw_stream(&self, stream: StreamId) -> u64 {
        stream.0
    }

    /// Free and total device memory in bytes.
    pub fn memory_info(&self) -> Result<(u64, u64), DeviceError> {
        self.bind()?;
        let (free, total) = driver::mem_get_info().named("cuMemGetInfo")?;
        Ok((free as u64, total as u64))
    }

    /// Waits for all work on the device (tests and phase boundaries only).
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.bind()?;
        Ok(driver::ctx::synchronize().named("cuCtxSynchronize")?)
    }

    /// The conversion kernel of `from` -> `to`, compiled on first use.
    fn kernel(&self, state: &mut State, from: Dtype, to: Dtype) -> Option<sys::CUfunction> {
        if let Some(&k) = state.kernels.get(&(from, to)) {
            return k.map(|f| f as sys::CUfunction);
        }
        let loaded = (|| {
            let ptx = std::ffi::CString::new(super::convert::ptx(from, to)?).ok()?;
            self.bind().ok()?;
            // SAFETY: a NUL-terminated PTX image; the driver copies what it needs.
            let module = unsafe { driver::module::load_data(ptx.as_ptr().cast()) }.ok()?;
            state.modules.push(module as usize);
            // SAFETY: `module` was just loaded and stays loaded until drop.
            unsafe { driver::module::get_function(module, super::convert::KERNEL.to_owned()) }.ok()
        })();
        state.kernels.insert((from, to), loaded.map(|f| f as usize));
        loaded
    }

    /// The decoding kernel, loaded on first use.
    fn decoder(&self, state: &mut State) -> Option<sys::CUfunction> {
        if let Some(k) = state.decoder {
            return k.map(|f| f as sys::CUfunction);
        }
        let loaded = (|| {
            let ptx = std::ffi::CString::new(super::decode::PTX).ok()?;
            self.bind().ok()?;
            // SAFETY: a NUL-terminated PTX image; the driver copies what it needs.
            let module = unsafe { driver::module::load_data(ptx.as_ptr().cast()) }.ok()?;
            state.modules.push(module as usize);
            // SAFETY: `module` was just loaded and stays loaded until drop.
            unsafe { driver::module::get_function(module, super::decode::KERNEL.to_owned()) }.ok()
        })();
        state.decoder = Some(loaded.map(|f| f as usize));
        loaded
    }

    /// The address `offset` bytes into live peer buffer `buffer`, when `len` bytes fit there.
    fn peer_at(
        state: &State,
        buffer: PeerBuffer,
        offset: u64,
        len: u64,
    ) -> Result<u64, DeviceError> {
        let start = buffer.range.start.0;
        if !state.peers.contains_key(&start) {
            return Err(DeviceError::InvalidUse(format!(
                "peer buffer at {start:#x} on {} is not live",
                buffer.device
            )));
        }
        match offset.checked_add(len) {
            Some(end) if end <= buffer.range.len => Ok(start + offset),
            _ => Err(DeviceError::InvalidUse(format!(
                "{len} bytes at {offset} run past the peer buffer's {} bytes",
                buffer.range.len
            ))),
        }
    }

    fn known_stream(state: &State, stream: StreamId) -> Result<sys::CUstream, DeviceError> {
        if state.streams.contains_key(&stream.0) {
            Ok(stream.0 as sys::CUstream)
        } else {
            Err(DeviceError::InvalidUse(format!(
                "stream {:#x} is not known to this device; adopt it first",
                stream.0
            )))
        }
    }

    /// `cuEventQuery`: `Ok(true)` when `event` completed, `Ok(false)` when not yet.
    ///
    /// # Safety
    /// 1. `event` is a live event of this device.
    unsafe fn event_complete(event: usize) -> Result<bool, CudaError> {
        // SAFETY: forwarded.
        match unsafe { driver::event::query(event as sys::CUevent) } {
            Ok(()) => Ok(true),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(e).named("cuEventQuery"),
        }
    }

    /// Records a fence on `stream` (raw handle `raw`, of the bound context) that takes the
    /// holds of the copies enqueued on it so far.
    fn record_on(
        state: &mut State,
        stream: StreamId,
        raw: sys::CUstream,
    ) -> Result<FenceValue, DeviceError> {
        if state.events.len() > RETIRE_AFTER {
            let oldest: Vec<(u64, usize)> =
                state.events.iter().take(16).map(|(&v, (e, _))| (v, *e)).collect();
            for (value, event) in oldest {
                // SAFETY: a live event of this device.
                if unsafe { Self::event_complete(event) }? {
                    Self::retire(state, value);
                } else {
                    break;
                }
            }
        }
        let event = match state.free_events.pop() {
            Some(e) => e,
            None => driver::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .named("cuEventCreate")? as usize,
        };
        // SAFETY: live event and known stream of this context.
        let recorded = unsafe { driver::event::record(event as sys::CUevent, raw) };
        if let Err(e) = recorded.named("cuEventRecord") {
            state.free_events.push(event);
            return Err(e.into());
        }
        let value = state.next_value;
        state.next_value += 1;
        let (held, rest): (Vec<_>, Vec<_>) =
            std::mem::take(&mut state.pending).into_iter().partition(|(s, _)| *s == stream.0);
        state.pending = rest;
        state.events.insert(value, (event, held.into_iter().map(|(_, h)| h).collect()));
        Ok(FenceValue(value))
    }

    /// Retires every outstanding value that holds host slices and has completed; a value whose
    /// query fails keeps its slices (nothing is proven).
    fn sweep(state: &mut State) -> Result<(), DeviceError> {
        let holding: Vec<(u64, usize)> = state
            .events
            .iter()
            .filter(|(_, (_, holds))| !holds.is_empty())
            .map(|(v, (e, _))| (*v, *e))
            .collect();
        for (value, event) in holding {
            // SAFETY: a live event of this device (outstanding, so not recycled).
            if unsafe { Self::event_complete(event) }? {
                Self::retire(state, value);
            }
        }
        Ok(())
    }

    /// A timing event from the free list or new (timed events cost more than fences' and
    /// serve only the decode totals).
    fn timing_event(state: &mut State) -> Result<usize, CudaError> {
        match state.free_timing.pop() {
            Some(e) => Ok(e),
            None => Ok(driver::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .named("cuEventCreate")? as usize),
        }
    }

    /// Adds the decodes known complete to their stream's totals, in each stream's order (a
    /// decode completes after those enqueued before it on its stream); a failed query proves
    /// nothing and keeps the decode outstanding.
    fn retire_decodes(state: &mut State) {
        let mut waiting: Vec<u64> = Vec::new();
        let mut kept = Vec::new();
        for t in std::mem::take(&mut state.timed) {
            // SAFETY: `end` is a live timing event of this device, outstanding (not recycled).
            let done = !waiting.contains(&t.stream)
                && unsafe { Self::event_complete(t.end) }.unwrap_or(false);
            if !done {
                waiting.push(t.stream);
                kept.push(t);
                continue;
            }
            // SAFETY: both are live timing events of this device, both complete.
            let ms =
                unsafe { driver::event::elapsed(t.start as sys::CUevent, t.end as sys::CUevent) };
            let total = state.decoded.entry(t.stream).or_default();
            total.0 += t.bytes;
            total.1 += f64::from(ms.unwrap_or(0.0)) / 1e3;
            state.free_timing.extend([t.start, t.end]);
        }
        state.timed = kept;
    }

    /// Forgets `stream`'s decodes: its totals, and the timed decodes not yet retired (their
    /// timing events go back to the free list).
    fn forget_decodes(state: &mut State, stream: u64) {
        let (gone, kept): (Vec<TimedDecode>, Vec<TimedDecode>) =
            std::mem::take(&mut state.timed).into_iter().partition(|t| t.stream == stream);
        state.timed = kept;
        state.free_timing.extend(gone.iter().flat_map(|t| [t.start, t.end]));
        state.decoded.remove(&stream);
    }

    /// Marks `value` complete: recycles its event and drops the host slices it held.
    fn retire(state: &mut State, value: u64) {
        if let Some((event, holds)) = state.events.remove(&value) {
            state.free_events.push(event);
            drop(holds);
        }
    }
}

impl DeviceMemory for CudaDevice {
    fn device(&self) -> DeviceOrdinal {
        DeviceOrdinal(self.ordinal)
    }

    fn granularity(&self) -> Result<u64, DeviceError> {
        Ok(self.granularity)
    }

    fn reserve(&self, len: u64) -> Result<Reservation, DeviceError> {
        AddressBook::check_aligned(self.granularity, "reservation length", len)?;
        self.bind()?;
        let ptr = vmm::address_reserve(len as usize, self.granularity as usize)
            .named("cuMemAddressReserve")?;
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .book
            .add_reservation(ptr, len);
        Ok(Reservation { range: DeviceRange { start: DeviceAddress(ptr), len } })
    }

    fn release_reservation(&self, reservation: Reservation) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (start, len) = (reservation.range.start.0, reservation.range.len);
        state.book.check_release_reservation(reservation.range)?;
        self.bind()?;
        // SAFETY: a reservation of this device with nothing mapped in it (checked above).
        unsafe { vmm::address_free(start, len as usize) }.named("cuMemAddressFree")?;
        state.book.remove_reservation(start);
        Ok(())
    }

    fn create_backing(&self, len: u64) -> Result<BackingId, DeviceError> {
        AddressBook::check_aligned(self.granularity, "backing length", len)?;
        self.bind()?;
        let handle = vmm::create(len as usize, self.index())
            .named("cuMemCreate")
            .map_err(|e| e.into_device(len))?;
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .book
            .add_backing(BackingId(handle), len);
        Ok(BackingId(handle))
    }

    fn map(&self, range: DeviceRange, backing: BackingId) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.book.check_map(range, backing, self.granularity)?;
        self.bind()?;
        let (ptr, len) = (range.start.0, range.len as usize);
        // SAFETY: the range is an aligned, unmapped part of a live reservation and the backing
        // is live with the same length (checked above under the lock).
        unsafe { vmm::map(ptr, len, backing.0) }.named("cuMemMap")?;
        // SAFETY: the range was just mapped, whole.
        let access = unsafe { vmm::set_access(ptr, len, self.index()) }.named("cuMemSetAccess");
        if let Err(e) = access {
            // SAFETY: undoes the mapping made above; nothing has used it.
            let _ = unsafe { vmm::unmap(ptr, len) };
            return Err(e.into());
        }
        state.book.add_mapping(range, backing);
        Ok(())
    }

    fn unmap(&self, range: DeviceRange) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.book.check_unmap(range)?;
        self.bind()?;
        // SAFETY: exactly one mapping of this device; the caller (the arena) has proven with a
        // fence that no enqueued work uses it.
        unsafe { vmm::unmap(range.start.0, range.len as usize) }.named("cuMemUnmap")?;
        state.book.remove_mapping(range.start.0);
        Ok(())
    }

    fn release_backing(&self, backing: BackingId) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.book.check_release_backing(backing)?;
        self.bind()?;
        // SAFETY: a live allocation of this device mapped nowhere (checked above).
        unsafe { vmm::release(backing.0) }.named("cuMemRelease")?;
        state.book.remove_backing(backing);
        Ok(())
    }

    fn read_back(&self, src: DeviceRange, dst: &mut [u8]) -> Result<(), DeviceError> {
        AddressBook::check_lengths("read", dst.len(), src.len)?;
        let state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.book.check_mapped(src)?;
        self.bind()?;
        driver::ctx::synchronize().named("cuCtxSynchronize")?;
        // SAFETY: `src` is inside a live mapping (checked, held by the lock); `dst` has its length
        // (checked); the copy is synchronous and in bytes.
        unsafe { driver::memcpy_dtoh_sync(dst, src.start.0) }.named("cuMemcpyDtoH")?;
        Ok(())
    }
}

impl Streams for CudaDevice {
    fn create_stream(&self) -> Result<StreamId, DeviceError> {
        self.bind()?;
        // The highest priority: conversion kernels enqueued after uploads are scheduled ahead of
        // the blocks of the compute that waits for them.
        let (_, greatest) =
            driver::stream::get_priority_range().named("cuCtxGetStreamPriorityRange")?;
        let s =
            driver::stream::create_with_priority(driver::stream::StreamKind::NonBlocking, greatest)
                .named("cuStreamCreateWithPriority")? as u64;
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .streams
            .insert(s, true);
        Ok(StreamId(s))
    }

    fn release_stream(&self, stream: StreamId) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match state.streams.get(&stream.0) {
            Some(true) => {}
            Some(false) => {
                return Err(DeviceError::InvalidUse(format!(
                    "stream {:#x} was adopted, not created by this device: its owner destroys it",
                    stream.0
                )));
            }
            None => {
                return Err(DeviceError::InvalidUse(format!(
                    "stream {:#x} is not known to this device (released already?)",
                    stream.0
                )));
            }
        }
        // A copy's host slice is held until a fence covers it: the stream must have one.
        if state.pending.iter().any(|(s, _)| *s == stream.0) {
            return Err(DeviceError::InvalidUse(format!(
                "stream {:#x} has copies no recorded fence covers yet: record one before releasing it",
                stream.0
            )));
        }
        self.bind()?;
        // SAFETY: a live stream this device created (checked above), on which its owner enqueues
        // nothing more; cuStreamDestroy returns at once and the driver frees the stream once the
        // work already enqueued completes, and events recorded on it stay valid.
        unsafe { driver::stream::destroy(stream.0 as sys::CUstream) }.named("cuStreamDestroy")?;
        state.streams.remove(&stream.0);
        // The driver may give the handle to a new stream: its timed decodes and totals go, so
        // the new stream starts with none. Their timing events are recycled (recording one
        // again is allowed whatever it captured before).
        Self::forget_decodes(&mut state, stream.0);
        Ok(())
    }
}

impl Copies for CudaDevice {
    fn copy_to_device(
        &self,
        src: HostSlice,
        dst: DeviceRange,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        AddressBook::check_lengths("copy", src.len(), dst.len)?;
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.book.check_mapped(dst)?;
        let raw = Self::known_stream(&state, stream)?;
        self.bind()?;
        // SAFETY: `dst` is inside a live mapping (checked); `src` is kept alive in `pending`
        // until a fence recorded after this copy on `stream` completes; the stream is known.
        // cudarc's further conditions (the element type and stream the memory was allocated
        // with) concern its own allocations: these are bytes into a mapping, on any stream.
        unsafe { driver::memcpy_htod_async(dst.start.0, src.as_bytes(), raw) }
            .named("cuMemcpyHtoDAsync")?;
        state.pending.push((stream.0, src));
        Ok(())
    }

    fn retire_completed_copies(&self) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.bind()?;
        // Copies no fence covers yet (a unit whose upload is still being enqueued, waiting for
        // one of the buffers its first copies hold) get one, so their holds can be retired.
        let mut streams: Vec<u64> = state.pending.iter().map(|(s, _)| *s).collect();
        streams.sort_unstable();
        streams.dedup();
        for s in streams {
            let stream = StreamId(s);
            let raw = Self::known_stream(&state, stream)?;
            Self::record_on(&mut state, stream, raw)?;
        }
        // Event queries only: nothing waits for work in flight.
        Self::sweep(&mut state)
    }
}

impl HostRegistration for CudaDevice {
    fn register_host(
        &self,
        slice: HostSlice,
        read_only: bool,
    ) -> Result<Registration, DeviceError> {
        let ptr = slice.as_bytes().as_ptr() as u64;
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if state.registrations.contains_key(&ptr) {
            return Err(DeviceError::InvalidUse(format!(
                "host memory at {ptr:#x} is already registered"
            )));
        }
        self.bind()?;
        // SAFETY: the slice's region is held in `registrations` from here until this device's
        // hold ends (unregistration, or the device's drop), so the pages stay allocated while
        // held; `dev` is the device of the context just bound.
        unsafe { super::shared::hold(ptr, slice.len(), read_only, self.dev) }?;
        state.registrations.insert(ptr, slice.clone());
        Ok(Registration { slice, handle: ptr })
    }

    fn unregister_host(&self, registration: &Registration) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !state.registrations.contains_key(&registration.handle) {
            return Err(DeviceError::InvalidUse(format!(
                "registration {:#x} is not live",
                registration.handle
            )));
        }
        self.bind()?;
        // SAFETY: held by this device (checked) and still in `registrations`; the caller's
        // contract: no work of this device reads it any more.
        unsafe { super::shared::let_go(registration.handle) }?;
        // The memory may go now: the driver no longer references it for this device (another
        // holder keeps its own slice of it).
        state.registrations.remove(&registration.handle);
        Ok(())
    }

    fn host_registered(&self, slice: &HostSlice) -> bool {
        super::shared::registered(slice.as_bytes().as_ptr() as u64, slice.len())
    }
}

impl PeerStore for CudaDevice {
    /// Physical memory of `peer` (`cuMemCreate` located there), mapped at addresses of their own
    /// with read/write access for this device: copies from it run on this device's copy engines
    /// over the peer link. Refused where the driver reports no peer access between the two.
    fn create_peer_buffer(&self, peer: DeviceOrdinal, len: u64) -> Result<PeerBuffer, DeviceError> {
        let count = driver::device::get_count().named("cuDeviceGetCount")?;
        let Some(index) = i32::try_from(peer.0).ok().filter(|&i| i < count) else {
            return Err(DeviceError::InvalidDevice { ordinal: peer.0, count: count as u32 });
        };
        if peer.0 != self.ordinal {
            let peer_dev = driver::device::get(index).named("cuDeviceGet")?;
            if !super::result::peer::can_access(self.dev, peer_dev)
                .named("cuDeviceCanAccessPeer")?
            {
                return Err(DeviceError::Unsupported(format!(
                    "cuda:{} cannot read {peer}'s memory (the driver reports no peer access between them): keep the weights in host memory",
                    self.ordinal
                )));
            }
        }
        if len == 0 {
            return Err(DeviceError::InvalidUse("a peer buffer holds at least one byte".into()));
        }
        self.bind()?;
        let granularity = vmm::granularity(index).named("cuMemGetAllocationGranularity")?;
        let mapped = usize::try_from(len)
            .ok()
            .and_then(|l| l.checked_next_multiple_of(granularity))
            .ok_or(DeviceError::OutOfMemory { requested: len })?;
        let handle = vmm::create(mapped, index)
            .named("cuMemCreate")
            .map_err(|e| e.into_device(mapped as u64))?;
        let ptr = match vmm::address_reserve(mapped, granularity).named("cuMemAddressReserve") {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the handle was just created and is mapped nowhere.
                let _ = unsafe { vmm::release(handle) };
                return Err(e.into());
            }
        };
        // SAFETY: `ptr..ptr+mapped` is the reservation just made and `handle` holds exactly
        // `mapped` bytes; on failure each step is undone in reverse.
        let mapped_ok = unsafe { vmm::map(ptr, mapped, handle) }.named("cuMemMap").and_then(|()| {
            // SAFETY: the range is wholly mapped just above.
            unsafe { vmm::set_access(ptr, mapped, self.index()) }.named("cuMemSetAccess")
        });
        if let Err(e) = mapped_ok {
            // SAFETY: undoing the steps above; nothing else uses these handles yet.
            unsafe {
                let _ = vmm::unmap(ptr, mapped);
                let _ = vmm::address_free(ptr, mapped);
                let _ = vmm::release(handle);
            }
            return Err(e.into());
        }
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.peers.insert(ptr, (handle, mapped));
        Ok(PeerBuffer { device: peer, range: DeviceRange { start: DeviceAddress(ptr), len } })
    }

    fn write_peer_buffer(
        &self,
        buffer: PeerBuffer,
        offset: u64,
        src: &[u8],
    ) -> Result<(), DeviceError> {
        let state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let at = Self::peer_at(&state, buffer, offset, src.len() as u64)?;
        self.bind()?;
        // SAFETY: `at..at+src.len()` lies inside a live peer buffer this device can write
        // (checked under the lock, which keeps it allocated); the copy is synchronous.
        unsafe { driver::memcpy_htod_sync(at, src) }.named("cuMemcpyHtoD")?;
        Ok(())
    }

    fn copy_from_peer(
        &self,
        buffer: PeerBuffer,
        offset: u64,
        dst: DeviceRange,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.book.check_mapped(dst)?;
        let at = Self::peer_at(&state, buffer, offset, dst.len)?;
        let raw = Self::known_stream(&state, stream)?;
        self.bind()?;
        // SAFETY: `dst` is inside a live mapping and `at..at+dst.len` inside a live peer buffer
        // (both checked); the buffer is freed only after the device's work is synchronized.
        unsafe { driver::memcpy_dtod_async(dst.start.0, at, dst.len as usize, raw) }
            .named("cuMemcpyDtoDAsync")?;
        Ok(())
    }

    fn copy_into_peer(
        &self,
        src: DeviceRange,
        buffer: PeerBuffer,
        offset: u64,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.book.check_mapped(src)?;
        let at = Self::peer_at(&state, buffer, offset, src.len)?;
        let raw = Self::known_stream(&state, stream)?;
        self.bind()?;
        // SAFETY: `src` is inside a live mapping and `at..at+src.len` inside a live peer buffer
        // (both checked); the buffer is freed only after the device's work is synchronized.
        unsafe { driver::memcpy_dtod_async(at, src.start.0, src.len as usize, raw) }
            .named("cuMemcpyDtoDAsync")?;
        Ok(())
    }

    fn release_peer_buffer(&self, buffer: PeerBuffer) -> Result<(), DeviceError> {
        let ptr = buffer.range.start.0;
        // Forgotten under the lock first: no copy can be enqueued from it after this.
        let (handle, mapped) = {
            let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            Self::peer_at(&state, buffer, 0, 0)?;
            state.peers.remove(&ptr).expect("checked")
        };
        let keep = |e: DeviceError| {
            // Not proven idle, or still mapped: kept, so a later release can try again.
            let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            state.peers.insert(ptr, (handle, mapped));
            e
        };
        // No copy enqueued from it may still be reading. Synchronized outside the device's
        // lock, so other work on this device is not held up meanwhile.
        self.bind().map_err(|e| keep(e.into()))?;
        driver::ctx::synchronize().named("cuCtxSynchronize").map_err(|e| keep(e.into()))?;
        // SAFETY: the context is synchronized and no copy can be enqueued from the buffer any
        // more, so nothing uses it; each handle was made by `create_peer_buffer` and is
        // released once (removed from `peers`).
        unsafe { vmm::unmap(ptr, mapped) }.named("cuMemUnmap").map_err(|e| keep(e.into()))?;
        // SAFETY: as above; the range is unmapped now.
        unsafe {
            let _ = vmm::address_free(ptr, mapped);
            let _ = vmm::release(handle);
        }
        Ok(())
    }
}

impl Transforms for CudaDevice {
    fn converts(&self, from: Dtype, to: Dtype) -> bool {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.kernel(&mut state, from, to).is_some()
    }

    fn convert(
        &self,
        src: DeviceRange,
        from: Dtype,
        dst: DeviceRange,
        to: Dtype,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut n = state.book.check_conversion(src, from, dst, to)?;
        let raw = Self::known_stream(&state, stream)?;
        let Some(f) = self.kernel(&mut state, from, to) else {
            return Err(DeviceError::Unsupported(format!(
                "this GPU's driver cannot compile the {} -> {} conversion kernel",
                from.as_str(),
                to.as_str()
            )));
        };
        self.bind()?;
        let (mut a, mut b) = (src.start.0, dst.start.0);
        let mut params: [*mut c_void; 3] =
            [(&raw mut a).cast(), (&raw mut b).cast(), (&raw mut n).cast()];
        const THREADS: u64 = 256;
        let blocks = n.div_ceil(THREADS).clamp(1, 4096) as u32;
        // SAFETY: `f` takes (u64 src, u64 dst, u64 n), matching `params`; both ranges are inside
        // live mappings (checked) and hold `n` elements of their dtypes; the stream is known.
        unsafe {
            driver::launch_kernel(f, (blocks, 1, 1), (THREADS as u32, 1, 1), 0, raw, &mut params)
        }
        .named("cuLaunchKernel")?;
        Ok(())
    }

    fn decodes(&self) -> bool {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.decoder(&mut state).is_some()
    }

    fn decode(
        &self,
        src: DeviceRange,
        dst: DeviceRange,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (mut elements, mut coded_bytes) = state.book.check_decode(src, dst)?;
        let raw = Self::known_stream(&state, stream)?;
        let Some(f) = self.decoder(&mut state) else {
            return Err(DeviceError::Unsupported(
                "this GPU's driver cannot load the decoding kernel (PTX 8.0 for sm_80: a driver \
                 of CUDA 12.0 or later and an Ampere or newer GPU)"
                    .into(),
            ));
        };
        let blocks = super::decode::blocks(elements);
        if blocks == 0 {
            return Ok(());
        }
        let blocks = u32::try_from(blocks).ok().filter(|&b| b < 1 << 31).ok_or_else(|| {
            DeviceError::InvalidUse(format!(
                "{elements} bf16 elements are too many to decode at once"
            ))
        })?;
        self.bind()?;
        if state.timed.len() > RETIRE_AFTER {
            Self::retire_decodes(&mut state);
        }
        let start = Self::timing_event(&mut state)?;
        let end = match Self::timing_event(&mut state) {
            Ok(e) => e,
            Err(e) => {
                state.free_timing.push(start);
                return Err(e.into());
            }
        };
        let (mut a, mut b) = (src.start.0, dst.start.0);
        let mut params: [*mut c_void; 4] = [
            (&raw mut a).cast(),
            (&raw mut b).cast(),
            (&raw mut elements).cast(),
            (&raw mut coded_bytes).cast(),
        ];
        let threads = super::decode::THREADS;
        let launched = (|| {
            // SAFETY: a live timing event and a known stream of this context.
            unsafe { driver::event::record(start as sys::CUevent, raw) }.named("cuEventRecord")?;
            // SAFETY: `f` takes (u64 blob, u64 dst, u64 elements, u64 coded_bytes), matching
            // `params`; `src` (4-byte aligned, at least the layout's fixed parts plus
            // `coded_bytes`) and `dst` (`elements` bf16, 2-byte aligned) lie inside live
            // mappings and do not overlap (checked); the kernel reads only `src` and writes only
            // `dst` whatever the bytes hold; its shared memory is static; the stream is known.
            unsafe {
                driver::launch_kernel(f, (blocks, 1, 1), (threads, 1, 1), 0, raw, &mut params)
            }
            .named("cuLaunchKernel")?;
            // SAFETY: as for `start`.
            unsafe { driver::event::record(end as sys::CUevent, raw) }.named("cuEventRecord")
        })();
        if let Err(e) = launched {
            state.free_timing.extend([start, end]);
            return Err(e.into());
        }
        state.timed.push(TimedDecode { stream: stream.0, start, end, bytes: dst.len });
        Ok(())
    }

    fn decode_totals(&self, stream: StreamId) -> (u64, f64) {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.bind().is_ok() {
            Self::retire_decodes(&mut state);
        }
        state.decoded.get(&stream.0).copied().unwrap_or_default()
    }
}

impl Fence for CudaDevice {
    fn record(&self, stream: StreamId) -> Result<FenceValue, DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let raw = Self::known_stream(&state, stream)?;
        self.bind()?;
        Self::record_on(&mut state, stream, raw)
    }

    fn query(&self, value: FenceValue) -> Result<bool, DeviceError> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if value.0 >= state.next_value || value.0 == 0 {
            return Err(DeviceError::InvalidUse(format!(
                "fence value {} was never recorded",
                value.0
            )));
        }
        let Some(&(event, _)) = state.events.get(&value.0) else { return Ok(true) };
        self.bind()?;
        // SAFETY: a live event of this device.
        let done = unsafe { Self::event_complete(event) }?;
        if done {
            Self::retire(&mut state, value.0);
        }
        Ok(done)
    }

    fn wait(&self, value: FenceValue) -> Result<(), DeviceError> {
        let event = {
            let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if value.0 >= state.next_value || value.0 == 0 {
                return Err(DeviceError::InvalidUse(format!(
                    "fence value {} was never recorded",
                    value.0
                )));
            }
            match state.events.get(&value.0) {
                Some(&(event, _)) => event,
                None => {
                    self.bind()?;
                    return Self::sweep(&mut state);
                }
            }
        };
        self.bind()?;
        // SAFETY: a live event: events are recycled only after their value retires, which
        // happens under the lock after completion, so a recycled event is re-recorded only
        // for a later value and synchronizing on it waits no less than needed.
        unsafe { driver::event::synchronize(event as sys::CUevent) }.named("cuEventSynchronize")?;
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        Self::retire(&mut state, value.0);
        // A host wait is a phase boundary (reclaim, close): give back every host slice whose
        // copy is proven complete, also those of values nobody asks about (uploads the
        // consumer waited for on the device).
        Self::sweep(&mut state)
    }

    fn stream_wait(&self, stream: StreamId, value: FenceValue) -> Result<(), DeviceError> {
        let state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if value.0 >= state.next_value || value.0 == 0 {
            return Err(DeviceError::InvalidUse(format!(
                "fence value {} was never recorded",
                value.0
            )));
        }
        let raw = Self::known_stream(&state, stream)?;
        let Some(&(event, _)) = state.events.get(&value.0) else { return Ok(()) };
        self.bind()?;
        // SAFETY: live event and known stream of this context.
        unsafe {
            driver::stream::wait_event(
                raw,
                event as sys::CUevent,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .named("cuStreamWaitEvent")?;
        Ok(())
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let synchronized = self.bind().is_ok() && driver::ctx::synchronize().is_ok();
        let state = self.state.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !synchronized {
            // Completion cannot be proven: keep every allocation (never force-free), the host
            // memory of registrations and of copies in flight included.
            let kept: u64 = state.registrations.values().map(|s| s.len() as u64).sum();
            std::mem::forget(std::mem::take(state));
            ddo_core::note_drop_failure(ddo_core::DropFailure {
                what: "CUDA device",
                message: "the context could not be synchronized, so completion of its work cannot                           be proven; its device memory, events and registered host memory stay                           allocated"
                    .into(),
                retained_bytes: Some(kept),
            });
            return;
        }
        // SAFETY: (all calls below) the context is synchronized, so no work uses these handles;
        // each was created by this device and is released exactly once here.
        unsafe {
            for (ptr, len) in state.book.mappings() {
                let _ = vmm::unmap(ptr, len as usize);
            }
            for handle in state.book.backings() {
                let _ = vmm::release(handle.0);
            }
            for (ptr, len) in state.book.reservations() {
                let _ = vmm::address_free(ptr, len as usize);
            }
            for (ptr, (handle, mapped)) in std::mem::take(&mut state.peers) {
                let _ = vmm::unmap(ptr, mapped);
                let _ = vmm::address_free(ptr, mapped);
                let _ = vmm::release(handle);
            }
            for (ptr, slice) in std::mem::take(&mut state.registrations) {
                if let Err(e) = super::shared::let_go(ptr) {
                    // Still registered: its memory stays allocated for the process's life.
                    ddo_core::note_drop_failure(ddo_core::DropFailure {
                        what: "host registration",
                        message: format!("cuMemHostUnregister at {ptr:#x}: {e:?}"),
                        retained_bytes: Some(slice.len() as u64),
                    });
                    std::mem::forget(slice);
                }
            }
            for (event, _) in std::mem::take(&mut state.events).into_values() {
                let _ = driver::event::destroy(event as sys::CUevent);
            }
            for event in state.free_events.drain(..) {
                let _ = driver::event::destroy(event as sys::CUevent);
            }
            let timed = std::mem::take(&mut state.timed).into_iter().flat_map(|t| [t.start, t.end]);
            for event in timed.chain(state.free_timing.drain(..)) {
                let _ = driver::event::destroy(event as sys::CUevent);
            }
            for (&s, &owned) in &state.streams {
                if owned {
                    let _ = driver::stream::destroy(s as sys::CUstream);
                }
            }
            for &module in &state.modules {
                let _ = driver::module::unload(module as sys::CUmodule);
            }
            let _ = driver::primary_ctx::release(self.dev);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_without_a_driver_gets_driver_not_found() {
        if super::super::driver_present() {
            return; // A GPU machine: the arena's cuda_backend tests cover opening a device.
        }
        let e = CudaDevice::new(0).unwrap_err();
        assert!(matches!(e, DeviceError::DriverNotFound), "{e:?}");
    }
}
