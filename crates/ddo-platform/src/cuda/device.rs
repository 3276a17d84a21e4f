//! [`CudaDevice`]: owned driver handles behind the device ports.

use std::collections::{BTreeMap, HashMap};

use crate::book::AddressBook;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use ddo_core::{
    BackingId, DeviceAddress, DeviceError, DeviceOrdinal, DeviceRange, Fence, FenceValue,
    HostSlice, Registration, Reservation, Residency, StreamId,
};

use super::result::{self, CudaError};
use super::sys;

/// Events kept outstanding before `record` starts retiring completed ones.
const RETIRE_AFTER: usize = 64;

#[derive(Debug, Default)]
struct State {
    book: AddressBook,
    /// Known streams: handle -> owned by this device.
    streams: HashMap<u64, bool>,
    registrations: HashMap<u64, usize>,
    /// Host slices of copies enqueued on a stream and not yet covered by a recorded fence.
    pending: Vec<(u64, HostSlice)>,
    /// Outstanding fence values: value -> (event handle, host slices held until completion).
    events: BTreeMap<u64, (usize, Vec<HostSlice>)>,
    free_events: Vec<usize>,
    next_value: u64,
}

/// A CUDA device (its primary context) implementing [`Residency`] and [`Fence`].
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
        result::init()?;
        let count = result::device_count()?;
        let Ok(index) = i32::try_from(ordinal) else {
            return Err(DeviceError::InvalidDevice { ordinal, count: count as u32 });
        };
        if index >= count {
            return Err(DeviceError::InvalidDevice { ordinal, count: count as u32 });
        }
        let dev = result::device_get(index)?;
        let ctx = result::primary_ctx_retain(dev)?;
        let device = CudaDevice {
            ordinal,
            dev,
            ctx: ctx as usize,
            granularity: 0,
            state: Mutex::new(State { next_value: 1, ..State::default() }),
        };
        device.bind()?;
        let granularity = result::mem_granularity(index)? as u64;
        let mut device = device;
        device.granularity = granularity;
        device.state.get_mut().expect("state").streams.insert(0, false);
        Ok(Arc::new(device))
    }

    fn index(&self) -> i32 {
        self.ordinal as i32
    }

    /// Makes the primary context current on the calling thread.
    fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: `ctx` is the retained primary context, live until drop.
        unsafe { result::ctx_set_current(self.ctx as sys::CUcontext) }
    }

    /// Introduces a stream created elsewhere (PyTorch's current stream) so ports accept it.
    ///
    /// # Safety
    /// 1. `raw` is a live `CUstream` of this device's primary context.
    /// 2. It stays alive while any port call uses it.
    pub unsafe fn adopt_stream(&self, raw: u64) -> StreamId {
        self.state.lock().expect("state").streams.entry(raw).or_insert(false);
        StreamId(raw)
    }

    /// The raw `CUstream` of `stream`, for other CUDA libraries in the same process.
    pub fn raw_stream(&self, stream: StreamId) -> u64 {
        stream.0
    }

    /// Free and total device memory in bytes.
    pub fn memory_info(&self) -> Result<(u64, u64), DeviceError> {
        self.bind()?;
        let (free, total) = result::mem_get_info()?;
        Ok((free as u64, total as u64))
    }

    /// Waits for all work on the device (tests and phase boundaries only).
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.bind()?;
        Ok(result::ctx_synchronize()?)
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

    /// Marks `value` complete: recycles its event and drops the host slices it held.
    fn retire(state: &mut State, value: u64) {
        if let Some((event, holds)) = state.events.remove(&value) {
            state.free_events.push(event);
            drop(holds);
        }
    }
}

impl Residency for CudaDevice {
    fn device(&self) -> DeviceOrdinal {
        DeviceOrdinal(self.ordinal)
    }

    fn granularity(&self) -> Result<u64, DeviceError> {
        Ok(self.granularity)
    }

    fn reserve(&self, len: u64) -> Result<Reservation, DeviceError> {
        AddressBook::check_aligned(self.granularity, "reservation length", len)?;
        self.bind()?;
        let ptr = result::mem_address_reserve(len as usize, self.granularity as usize)?;
        self.state.lock().expect("state").book.add_reservation(ptr, len);
        Ok(Reservation { range: DeviceRange { start: DeviceAddress(ptr), len } })
    }

    fn release_reservation(&self, reservation: Reservation) -> Result<(), DeviceError> {
        let mut state = self.state.lock().expect("state");
        let (start, len) = (reservation.range.start.0, reservation.range.len);
        state.book.check_release_reservation(reservation.range)?;
        self.bind()?;
        // SAFETY: a reservation of this device with nothing mapped in it (checked above).
        unsafe { result::mem_address_free(start, len as usize) }?;
        state.book.remove_reservation(start);
        Ok(())
    }

    fn create_backing(&self, len: u64) -> Result<BackingId, DeviceError> {
        AddressBook::check_aligned(self.granularity, "backing length", len)?;
        self.bind()?;
        let handle =
            result::mem_create(len as usize, self.index()).map_err(|e| e.into_device(len))?;
        self.state.lock().expect("state").book.add_backing(BackingId(handle), len);
        Ok(BackingId(handle))
    }

    fn map(&self, range: DeviceRange, backing: BackingId) -> Result<(), DeviceError> {
        let mut state = self.state.lock().expect("state");
        state.book.check_map(range, backing, self.granularity)?;
        self.bind()?;
        // SAFETY: the range is an aligned, unmapped part of a live reservation and the backing
        // is live with the same length (checked above under the lock).
        unsafe { result::mem_map(range.start.0, range.len as usize, backing.0, self.index()) }?;
        state.book.add_mapping(range, backing);
        Ok(())
    }

    fn unmap(&self, range: DeviceRange) -> Result<(), DeviceError> {
        let mut state = self.state.lock().expect("state");
        state.book.check_unmap(range)?;
        self.bind()?;
        // SAFETY: exactly one mapping of this device; the caller (the arena) has proven with a
        // fence that no enqueued work uses it.
        unsafe { result::mem_unmap(range.start.0, range.len as usize) }?;
        state.book.remove_mapping(range.start.0);
        Ok(())
    }

    fn release_backing(&self, backing: BackingId) -> Result<(), DeviceError> {
        let mut state = self.state.lock().expect("state");
        state.book.check_release_backing(backing)?;
        self.bind()?;
        // SAFETY: a live allocation of this device mapped nowhere (checked above).
        unsafe { result::mem_release(backing.0) }?;
        state.book.remove_backing(backing);
        Ok(())
    }

    fn create_stream(&self) -> Result<StreamId, DeviceError> {
        self.bind()?;
        let s = result::stream_create()? as u64;
        self.state.lock().expect("state").streams.insert(s, true);
        Ok(StreamId(s))
    }

    fn copy_to_device(
        &self,
        src: HostSlice,
        dst: DeviceRange,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        AddressBook::check_lengths("copy", src.len(), dst.len)?;
        let mut state = self.state.lock().expect("state");
        state.book.check_mapped(dst)?;
        let raw = Self::known_stream(&state, stream)?;
        self.bind()?;
        // SAFETY: `dst` is inside a live mapping (checked); `src` is kept alive in `pending`
        // until a fence recorded after this copy on `stream` completes; the stream is known.
        unsafe {
            result::memcpy_htod_async(
                dst.start.0,
                src.as_bytes().as_ptr() as *const c_void,
                src.len(),
                raw,
            )
        }?;
        state.pending.push((stream.0, src));
        Ok(())
    }

    fn read_back(&self, src: DeviceRange, dst: &mut [u8]) -> Result<(), DeviceError> {
        AddressBook::check_lengths("read", dst.len(), src.len)?;
        let state = self.state.lock().expect("state");
        state.book.check_mapped(src)?;
        self.bind()?;
        result::ctx_synchronize()?;
        // SAFETY: `src` is inside a live mapping (checked, held by the lock); `dst` has its length.
        unsafe { result::memcpy_dtoh(dst.as_mut_ptr() as *mut c_void, src.start.0, dst.len()) }?;
        Ok(())
    }

    fn register_host(
        &self,
        slice: HostSlice,
        read_only: bool,
    ) -> Result<Registration, DeviceError> {
        let ptr = slice.as_bytes().as_ptr() as u64;
        let mut state = self.state.lock().expect("state");
        if state.registrations.contains_key(&ptr) {
            return Err(DeviceError::InvalidUse(format!(
                "host memory at {ptr:#x} is already registered"
            )));
        }
        self.bind()?;
        // SAFETY: the slice's region stays alive as long as the returned Registration holds it;
        // unregistration happens before that (or never, which only keeps pages locked).
        unsafe { result::mem_host_register(ptr as *mut c_void, slice.len(), read_only) }?;
        state.registrations.insert(ptr, slice.len());
        Ok(Registration { slice, handle: ptr })
    }

    fn unregister_host(&self, registration: &Registration) -> Result<(), DeviceError> {
        let mut state = self.state.lock().expect("state");
        if !state.registrations.contains_key(&registration.handle) {
            return Err(DeviceError::InvalidUse(format!(
                "registration {:#x} is not live",
                registration.handle
            )));
        }
        self.bind()?;
        // SAFETY: registered by this device (checked).
        unsafe { result::mem_host_unregister(registration.handle as *mut c_void) }?;
        state.registrations.remove(&registration.handle);
        Ok(())
    }
}

impl Fence for CudaDevice {
    fn record(&self, stream: StreamId) -> Result<FenceValue, DeviceError> {
        let mut state = self.state.lock().expect("state");
        let raw = Self::known_stream(&state, stream)?;
        self.bind()?;
        if state.events.len() > RETIRE_AFTER {
            let oldest: Vec<(u64, usize)> =
                state.events.iter().take(16).map(|(&v, (e, _))| (v, *e)).collect();
            for (value, event) in oldest {
                // SAFETY: a live event of this device.
                if unsafe { result::event_query(event as sys::CUevent) }? {
                    Self::retire(&mut state, value);
                } else {
                    break;
                }
            }
        }
        let event = match state.free_events.pop() {
            Some(e) => e,
            None => result::event_create()? as usize,
        };
        // SAFETY: live event and known stream of this context.
        if let Err(e) = unsafe { result::event_record(event as sys::CUevent, raw) } {
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

    fn query(&self, value: FenceValue) -> Result<bool, DeviceError> {
        let mut state = self.state.lock().expect("state");
        if value.0 >= state.next_value || value.0 == 0 {
            return Err(DeviceError::InvalidUse(format!(
                "fence value {} was never recorded",
                value.0
            )));
        }
        let Some(&(event, _)) = state.events.get(&value.0) else { return Ok(true) };
        self.bind()?;
        // SAFETY: a live event of this device.
        let done = unsafe { result::event_query(event as sys::CUevent) }?;
        if done {
            Self::retire(&mut state, value.0);
        }
        Ok(done)
    }

    fn wait(&self, value: FenceValue) -> Result<(), DeviceError> {
        let event = {
            let state = self.state.lock().expect("state");
            if value.0 >= state.next_value || value.0 == 0 {
                return Err(DeviceError::InvalidUse(format!(
                    "fence value {} was never recorded",
                    value.0
                )));
            }
            match state.events.get(&value.0) {
                Some(&(event, _)) => event,
                None => return Ok(()),
            }
        };
        self.bind()?;
        // SAFETY: a live event: events are recycled only after their value retires, which
        // happens under the lock after completion, so a recycled event is re-recorded only
        // for a later value and synchronizing on it waits no less than needed.
        unsafe { result::event_synchronize(event as sys::CUevent) }?;
        Self::retire(&mut self.state.lock().expect("state"), value.0);
        Ok(())
    }

    fn stream_wait(&self, stream: StreamId, value: FenceValue) -> Result<(), DeviceError> {
        let state = self.state.lock().expect("state");
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
        unsafe { result::stream_wait_event(raw, event as sys::CUevent) }?;
        Ok(())
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if self.bind().is_err() || result::ctx_synchronize().is_err() {
            // Completion cannot be proven: keep every allocation (never force-free).
            return;
        }
        let state = self.state.get_mut().expect("state");
        // SAFETY: (all calls below) the context is synchronized, so no work uses these handles;
        // each was created by this device and is released exactly once here.
        unsafe {
            for (ptr, len) in state.book.mappings() {
                let _ = result::mem_unmap(ptr, len as usize);
            }
            for handle in state.book.backings() {
                let _ = result::mem_release(handle.0);
            }
            for (ptr, len) in state.book.reservations() {
                let _ = result::mem_address_free(ptr, len as usize);
            }
            for &ptr in state.registrations.keys() {
                let _ = result::mem_host_unregister(ptr as *mut c_void);
            }
            for (event, _) in std::mem::take(&mut state.events).into_values() {
                let _ = result::event_destroy(event as sys::CUevent);
            }
            for event in state.free_events.drain(..) {
                let _ = result::event_destroy(event as sys::CUevent);
            }
            for (&s, &owned) in &state.streams {
                if owned {
                    let _ = result::stream_destroy(s as sys::CUstream);
                }
            }
            let _ = result::primary_ctx_release(self.dev);
        }
    }
}
