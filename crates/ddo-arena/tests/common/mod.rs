//! Shared fixtures: a generated checkpoint, platforms, and a spying/fault-injecting device.

#![allow(dead_code, unreachable_pub)]

use ddo_core::{Copies, DeviceMemory, HostRegistration, PeerStore, Streams, Transforms};
use std::path::Path;
use std::sync::{Arc, Mutex};

use ddo_core::{
    BackingId, DeviceError, DeviceOrdinal, DeviceRange, Fence, FenceValue, HostSlice, Platform,
    Registration, Reservation, StreamId, WeightSource,
};
use ddo_platform::host::HostDevice;
use ddo_source::{Checkpoint, CheckpointSource};
use safetensors::tensor::TensorView;

pub const GRANULARITY: u64 = 64 * 1024;

/// Deterministic bytes for tensor `name`.
pub fn pattern(name: &str, len: usize) -> Vec<u8> {
    let seed = name.bytes().fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    (0..len)
        .map(|i| (seed.wrapping_add(i as u32).wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

/// A Flux-like checkpoint: `blocks` blocks of four BF16 tensors plus resident leftovers.
pub fn checkpoint(dir: &Path, blocks: usize, width: usize) -> Arc<dyn WeightSource> {
    let mut data: Vec<(String, Vec<usize>)> =
        vec![("proj_in.weight".into(), vec![width, 16]), ("norm_out.weight".into(), vec![width])];
    for b in 0..blocks {
        data.push((format!("blocks.{b}.attn.qkv.weight"), vec![3 * width, width]));
        data.push((format!("blocks.{b}.attn.out.weight"), vec![width, width]));
        data.push((format!("blocks.{b}.ff.weight"), vec![width, width]));
        data.push((format!("blocks.{b}.norm.weight"), vec![width]));
    }
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = data
        .into_iter()
        .map(|(n, shape)| {
            let len = shape.iter().product::<usize>() * 2;
            let b = pattern(&n, len);
            (n, b, shape)
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, b, s)| {
            (n.clone(), TensorView::new(safetensors::Dtype::BF16, s.clone(), b).unwrap())
        })
        .collect();
    let path = dir.join("model.safetensors");
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    let checkpoint = Arc::new(Checkpoint::open(&path).unwrap());
    // SAFETY: the test never modifies the file while mapped.
    Arc::new(unsafe { CheckpointSource::with_mmap(checkpoint, 2) }.unwrap())
}

/// Where tests write files: `DDO_TEST_TMPDIR` when set (bundles run where the build's target
/// folder does not exist), else the build's own temporary folder.
pub fn test_tmpdir() -> std::path::PathBuf {
    let dir = std::env::var_os("DDO_TEST_TMPDIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("ddo-arena-").tempdir_in(test_tmpdir()).unwrap()
}

/// The host platform with a small granularity.
pub fn host() -> (Platform, Arc<HostDevice>) {
    let device = Arc::new(HostDevice::with_granularity(GRANULARITY));
    (ddo_platform::host_platform(device.clone()), device)
}

/// Device calls the spy sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Reserve(u64),
    ReleaseReservation,
    CreateBacking(u64),
    Map(u64, BackingId),
    Unmap(u64),
    ReleaseBacking(BackingId),
    CreateStream(StreamId),
    Copy(u64, u64, StreamId),
    Record(StreamId, FenceValue),
    Query(FenceValue),
    Wait(FenceValue),
    StreamWait(StreamId, FenceValue),
}

/// Which port call to fail, and on which occurrence (0-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Reserve,
    ReleaseReservation,
    CreateBacking,
    Map,
    Unmap,
    ReleaseBacking,
    CreateStream,
    ReleaseStream,
    Copy,
    Record,
    Query,
    Wait,
    StreamWait,
}

/// A host device that logs every call and can fail chosen ones, or report fences incomplete.
#[derive(Debug)]
pub struct Spy {
    pub inner: Arc<HostDevice>,
    pub log: Mutex<Vec<Call>>,
    faults: Mutex<Vec<(Op, usize)>>,
    counts: Mutex<std::collections::HashMap<String, usize>>,
    /// When set, `query` answers this instead of the truth.
    pub query_answer: Mutex<Option<bool>>,
}

impl Spy {
    pub fn new() -> Arc<Spy> {
        Arc::new(Spy {
            inner: Arc::new(HostDevice::with_granularity(GRANULARITY)),
            log: Mutex::new(Vec::new()),
            faults: Mutex::new(Vec::new()),
            counts: Mutex::new(Default::default()),
            query_answer: Mutex::new(None),
        })
    }

    pub fn platform(self: &Arc<Self>) -> Platform {
        Platform {
            name: "spy",
            residency: self.clone(),
            fences: self.clone(),
            admission: Arc::new(ddo_platform::LinuxAdmissionProbe::system()),
        }
    }

    /// Fails the `nth` (0-based, counted from now) call of `op`.
    pub fn fail(&self, op: Op, nth: usize) {
        let seen = *self.counts.lock().unwrap().get(&format!("{op:?}")).unwrap_or(&0);
        self.faults.lock().unwrap().push((op, seen + nth));
    }

    pub fn calls(&self) -> Vec<Call> {
        self.log.lock().unwrap().clone()
    }

    fn enter(&self, op: Op) -> Result<(), DeviceError> {
        let mut counts = self.counts.lock().unwrap();
        let n = counts.entry(format!("{op:?}")).or_insert(0);
        let this = *n;
        *n += 1;
        if self.faults.lock().unwrap().contains(&(op, this)) {
            return Err(DeviceError::Lost(format!("injected failure of {op:?}")));
        }
        Ok(())
    }

    fn push(&self, c: Call) {
        self.log.lock().unwrap().push(c);
    }
}

impl DeviceMemory for Spy {
    fn device(&self) -> DeviceOrdinal {
        self.inner.device()
    }

    fn granularity(&self) -> Result<u64, DeviceError> {
        self.inner.granularity()
    }

    fn reserve(&self, len: u64) -> Result<Reservation, DeviceError> {
        self.enter(Op::Reserve)?;
        self.push(Call::Reserve(len));
        self.inner.reserve(len)
    }

    fn release_reservation(&self, r: Reservation) -> Result<(), DeviceError> {
        self.enter(Op::ReleaseReservation)?;
        self.push(Call::ReleaseReservation);
        self.inner.release_reservation(r)
    }

    fn create_backing(&self, len: u64) -> Result<BackingId, DeviceError> {
        self.enter(Op::CreateBacking)?;
        self.push(Call::CreateBacking(len));
        self.inner.create_backing(len)
    }

    fn map(&self, range: DeviceRange, b: BackingId) -> Result<(), DeviceError> {
        self.enter(Op::Map)?;
        self.push(Call::Map(range.start.0, b));
        self.inner.map(range, b)
    }

    fn unmap(&self, range: DeviceRange) -> Result<(), DeviceError> {
        self.enter(Op::Unmap)?;
        self.push(Call::Unmap(range.start.0));
        self.inner.unmap(range)
    }

    fn release_backing(&self, b: BackingId) -> Result<(), DeviceError> {
        self.enter(Op::ReleaseBacking)?;
        self.push(Call::ReleaseBacking(b));
        self.inner.release_backing(b)
    }

    fn read_back(&self, src: DeviceRange, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.inner.read_back(src, dst)
    }
}

impl Streams for Spy {
    fn create_stream(&self) -> Result<StreamId, DeviceError> {
        self.enter(Op::CreateStream)?;
        let s = self.inner.create_stream()?;
        self.push(Call::CreateStream(s));
        Ok(s)
    }

    fn release_stream(&self, s: StreamId) -> Result<(), DeviceError> {
        self.enter(Op::ReleaseStream)?;
        self.inner.release_stream(s)
    }
}

impl Copies for Spy {
    fn copy_to_device(
        &self,
        src: HostSlice,
        dst: DeviceRange,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        self.enter(Op::Copy)?;
        self.push(Call::Copy(dst.start.0, dst.len, stream));
        self.inner.copy_to_device(src, dst, stream)
    }
}

impl HostRegistration for Spy {
    fn register_host(
        &self,
        slice: HostSlice,
        read_only: bool,
    ) -> Result<Registration, DeviceError> {
        self.inner.register_host(slice, read_only)
    }

    fn unregister_host(&self, r: &Registration) -> Result<(), DeviceError> {
        self.inner.unregister_host(r)
    }
}

impl PeerStore for Spy {}

impl Transforms for Spy {}

impl Fence for Spy {
    fn record(&self, stream: StreamId) -> Result<FenceValue, DeviceError> {
        self.enter(Op::Record)?;
        let f = self.inner.record(stream)?;
        self.push(Call::Record(stream, f));
        Ok(f)
    }
    fn query(&self, value: FenceValue) -> Result<bool, DeviceError> {
        self.enter(Op::Query)?;
        self.push(Call::Query(value));
        let truth = self.inner.query(value)?;
        Ok(self.query_answer.lock().unwrap().unwrap_or(truth))
    }
    fn wait(&self, value: FenceValue) -> Result<(), DeviceError> {
        self.enter(Op::Wait)?;
        self.push(Call::Wait(value));
        self.inner.wait(value)
    }
    fn stream_wait(&self, stream: StreamId, value: FenceValue) -> Result<(), DeviceError> {
        self.enter(Op::StreamWait)?;
        self.push(Call::StreamWait(stream, value));
        self.inner.stream_wait(stream, value)
    }
}
