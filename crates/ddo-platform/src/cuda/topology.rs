//! This host's GPUs, which pairs have peer access, and the speed of the copy paths a weight store
//! can stream over: from another GPU's memory, and from pinned host memory.
//!
//! Each call retains the primary contexts it needs and releases them, with every allocation,
//! stream and event, before it returns (also on an error).

use std::ffi::c_void;

use cudarc::driver::result as driver;
use ddo_core::{DeviceError, DeviceInfo, DeviceTopology, LinkMeasurement, PeerAccess};

use super::error::{CudaError, Named};
use super::result::peer;
use super::sys;

/// Bytes of each small copy timed for latency.
const SMALL: usize = 4096;

/// The devices the driver enumerates and peer access for every ordered pair. Fails with
/// [`DeviceError::DriverNotFound`] when no driver library exists.
pub fn topology() -> Result<DeviceTopology, DeviceError> {
    let handles = devices()?;
    let mut topology = DeviceTopology::default();
    for (ordinal, &dev) in handles.iter().enumerate() {
        let name = driver::device::get_name(dev).named("cuDeviceGetName")?;
        // SAFETY: `dev` came from cuDeviceGet.
        let total = unsafe { driver::device::total_mem(dev) }.named("cuDeviceTotalMem")?;
        topology.devices.push(DeviceInfo {
            ordinal: ordinal as u32,
            name,
            total_bytes: total as u64,
        });
    }
    for (from, &a) in handles.iter().enumerate() {
        for (to, &b) in handles.iter().enumerate().filter(|&(to, _)| to != from) {
            let allowed = peer::can_access(a, b).named("cuDeviceCanAccessPeer")?;
            topology.peers.push(PeerAccess { from: from as u32, to: to as u32, allowed });
        }
    }
    Ok(topology)
}

/// Times copies of `bytes` from device `src`'s memory into device `dst`'s, on a stream of `dst`:
/// over peer access where the driver allows it (enabled for the measurement), else over the
/// driver's own path. The copied bytes are checked at the end.
pub fn measure_peer_link(dst: u32, src: u32, bytes: usize) -> Result<LinkMeasurement, DeviceError> {
    let handles = devices()?;
    let (dst_dev, src_dev) = (handle(&handles, dst)?, handle(&handles, src)?);
    if dst == src {
        return Err(DeviceError::InvalidUse(format!(
            "a peer link joins two devices; both are device {dst}"
        )));
    }
    let bytes = bytes.max(SMALL);
    let dst_ctx = Context::retain(dst_dev)?;
    let src_ctx = Context::retain(src_dev)?;
    let from = DeviceBuffer::new(&src_ctx, bytes)?;
    src_ctx.bind()?;
    // SAFETY: `from` is a live allocation of `bytes` in the current context.
    unsafe { driver::memset_d8_sync(from.ptr, 0x5a, bytes) }.named("cuMemsetD8")?;
    let to = DeviceBuffer::new(&dst_ctx, bytes)?;
    dst_ctx.bind()?;
    if peer::can_access(dst_dev, src_dev).named("cuDeviceCanAccessPeer")? {
        // SAFETY: the source's context is retained until the end of this call.
        unsafe { peer::enable(src_ctx.raw) }.named("cuCtxEnablePeerAccess")?;
    }
    let timer = Timer::new()?;
    let copy = |len: usize| {
        // SAFETY: both allocations are live and at least `len` bytes; the stream belongs to the
        // destination's context, which is current.
        unsafe {
            driver::memcpy_peer_async(dst_ctx.raw, to.ptr, src_ctx.raw, from.ptr, len, timer.stream)
        }
        .named("cuMemcpyPeerAsync")
    };
    let measurement = timer.measure(bytes, copy)?;
    to.check_pattern(bytes)?;
    Ok(measurement)
}

/// Times copies of `bytes` from pinned host memory into device `dst`'s memory.
pub fn measure_host_link(dst: u32, bytes: usize) -> Result<LinkMeasurement, DeviceError> {
    let handles = devices()?;
    let dst_dev = handle(&handles, dst)?;
    let bytes = bytes.max(SMALL);
    let ctx = Context::retain(dst_dev)?;
    let host = PinnedBuffer::new(&ctx, bytes)?;
    let to = DeviceBuffer::new(&ctx, bytes)?;
    ctx.bind()?;
    let timer = Timer::new()?;
    let copy = |len: usize| {
        // SAFETY: `host` is pinned and `to` is a device allocation, both of at least `len` bytes,
        // alive until the timer synchronized; the stream is of the current context.
        unsafe { driver::memcpy_htod_async(to.ptr, &host.bytes()[..len], timer.stream) }
            .named("cuMemcpyHtoDAsync")
    };
    let measurement = timer.measure(bytes, copy)?;
    to.check_pattern(bytes)?;
    Ok(measurement)
}

/// Every device's handle, after initializing the driver.
fn devices() -> Result<Vec<sys::CUdevice>, DeviceError> {
    if !super::driver_present() {
        return Err(DeviceError::DriverNotFound);
    }
    driver::init().named("cuInit")?;
    let count = driver::device::get_count().named("cuDeviceGetCount")?;
    (0..count).map(|i| Ok(driver::device::get(i).named("cuDeviceGet")?)).collect()
}

fn handle(handles: &[sys::CUdevice], ordinal: u32) -> Result<sys::CUdevice, DeviceError> {
    handles
        .get(ordinal as usize)
        .copied()
        .ok_or(DeviceError::InvalidDevice { ordinal, count: handles.len() as u32 })
}

/// A retained primary context, released on drop.
struct Context {
    dev: sys::CUdevice,
    raw: sys::CUcontext,
}

impl Context {
    fn retain(dev: sys::CUdevice) -> Result<Context, CudaError> {
        // SAFETY: `dev` came from cuDeviceGet; released in drop.
        let raw = unsafe { driver::primary_ctx::retain(dev) }.named("cuDevicePrimaryCtxRetain")?;
        Ok(Context { dev, raw })
    }

    fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: the context is retained until drop.
        unsafe { driver::ctx::set_current(self.raw) }.named("cuCtxSetCurrent")
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: balances the retain; everything allocated in it was freed first (fields and
        // locals drop before the context they were made in).
        let _ = unsafe { driver::primary_ctx::release(self.dev) };
    }
}

/// A device allocation in one context, freed on drop.
struct DeviceBuffer<'a> {
    ctx: &'a Context,
    ptr: sys::CUdeviceptr,
}

impl<'a> DeviceBuffer<'a> {
    fn new(ctx: &'a Context, bytes: usize) -> Result<DeviceBuffer<'a>, DeviceError> {
        ctx.bind()?;
        // SAFETY: a current context; the allocation is freed in drop.
        let ptr = unsafe { driver::malloc_sync(bytes) }
            .named("cuMemAlloc")
            .map_err(|e| e.into_device(bytes as u64))?;
        Ok(DeviceBuffer { ctx, ptr })
    }
}

impl DeviceBuffer<'_> {
    /// Checks that the last 64 of the first `len` bytes hold the copies' pattern (every copy
    /// has landed: the timer synchronized its stream).
    fn check_pattern(&self, len: usize) -> Result<(), DeviceError> {
        let mut tail = [0u8; 64];
        let at = self.ptr + (len - tail.len()) as u64;
        self.ctx.bind()?;
        // SAFETY: a live allocation of at least `len` >= 4096 bytes in the current context.
        unsafe { driver::memcpy_dtoh_sync(&mut tail, at) }.named("cuMemcpyDtoH")?;
        if tail.iter().all(|&b| b == 0x5a) {
            return Ok(());
        }
        Err(DeviceError::Platform(ddo_core::PlatformError::new(
            "check a measured copy",
            "the destination does not hold the copied bytes",
        )))
    }
}

impl Drop for DeviceBuffer<'_> {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: allocated in this context; the streams that used it were synchronized.
            let _ = unsafe { driver::free_sync(self.ptr) };
        }
    }
}

/// Page-locked host memory, filled with the pattern the copies carry, freed on drop.
struct PinnedBuffer<'a> {
    ctx: &'a Context,
    ptr: *mut c_void,
    len: usize,
}

impl<'a> PinnedBuffer<'a> {
    fn new(ctx: &'a Context, len: usize) -> Result<PinnedBuffer<'a>, DeviceError> {
        ctx.bind()?;
        // SAFETY: a current context; freed in drop.
        let ptr = unsafe { driver::malloc_host(len, 0) }
            .named("cuMemAllocHost")
            .map_err(|e| e.into_device(len as u64))?;
        // SAFETY: `ptr` is a fresh allocation of `len` bytes, not shared.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0x5a, len) };
        Ok(PinnedBuffer { ctx, ptr, len })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: a live allocation of `len` bytes, written only in `new`.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>(), self.len) }
    }
}

impl Drop for PinnedBuffer<'_> {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: allocated by cuMemAllocHost; the copies from it were synchronized.
            let _ = unsafe { driver::free_host(self.ptr) };
        }
    }
}

/// A stream of the current context and two timing events, destroyed on drop.
struct Timer {
    stream: sys::CUstream,
    start: sys::CUevent,
    end: sys::CUevent,
}

impl Timer {
    fn new() -> Result<Timer, CudaError> {
        let stream = driver::stream::create(driver::stream::StreamKind::NonBlocking)
            .named("cuStreamCreate")?;
        let mut timer = Timer { stream, start: std::ptr::null_mut(), end: std::ptr::null_mut() };
        timer.start =
            driver::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).named("cuEventCreate")?;
        timer.end =
            driver::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).named("cuEventCreate")?;
        Ok(timer)
    }

    /// Seconds per copy of the fastest of three rounds of `n` copies of `len` bytes.
    fn seconds_each(
        &self,
        n: usize,
        len: usize,
        copy: &impl Fn(usize) -> Result<(), CudaError>,
    ) -> Result<f64, CudaError> {
        let mut best = f64::MAX;
        for _ in 0..3 {
            // SAFETY: live events and stream of the current context.
            unsafe { driver::event::record(self.start, self.stream) }.named("cuEventRecord")?;
            for _ in 0..n {
                copy(len)?;
            }
            // SAFETY: as above.
            unsafe { driver::event::record(self.end, self.stream) }.named("cuEventRecord")?;
            // SAFETY: as above.
            unsafe { driver::event::synchronize(self.end) }.named("cuEventSynchronize")?;
            // SAFETY: both events recorded and complete.
            let ms = unsafe { driver::event::elapsed(self.start, self.end) }
                .named("cuEventElapsedTime")?;
            best = best.min(f64::from(ms) / 1e3 / n as f64);
        }
        Ok(best)
    }

    /// Bandwidth of copies of `bytes` (after one warm-up copy) and latency of small ones.
    fn measure(
        &self,
        bytes: usize,
        copy: impl Fn(usize) -> Result<(), CudaError>,
    ) -> Result<LinkMeasurement, DeviceError> {
        copy(bytes)?;
        // About 2 GiB a round, at least four copies.
        let n = ((2usize << 30) / bytes).clamp(4, 256);
        let large = self.seconds_each(n, bytes, &copy)?;
        let small = self.seconds_each(200, SMALL, &copy)?;
        // The last large copy must land too, before the pattern is checked.
        copy(bytes)?;
        // SAFETY: a live stream.
        unsafe { driver::stream::synchronize(self.stream) }.named("cuStreamSynchronize")?;
        Ok(LinkMeasurement {
            copy_bytes: bytes as u64,
            bytes_per_second: bytes as f64 / large,
            latency_seconds: small,
        })
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        // SAFETY: created in `new` (null ones skipped); nothing is pending after `measure`, and
        // destroying a stream with work in flight lets that work finish first.
        unsafe {
            if !self.start.is_null() {
                let _ = driver::event::destroy(self.start);
            }
            if !self.end.is_null() {
                let _ = driver::event::destroy(self.end);
            }
            let _ = driver::stream::destroy(self.stream);
        }
    }
}
