//! Errors of the ports: small closed enums, plus one message-and-source error for failures that
//! only a platform can describe.

use std::error::Error as StdError;
use std::path::PathBuf;

/// A platform-specific failure: which call failed, what it said, and the underlying error.
/// Backend error types (driver codes, OS errors) are boxed here so the core never depends on
/// them.
#[derive(Debug, thiserror::Error)]
#[error("{call} failed: {message}")]
pub struct PlatformError {
    /// The platform call that failed (`cuMemMap`, `open /proc/meminfo`).
    pub call: String,
    /// What went wrong, in words.
    pub message: String,
    /// The underlying error, when there is one.
    #[source]
    pub source: Option<Box<dyn StdError + Send + Sync + 'static>>,
}

impl PlatformError {
    /// A failure of `call` described by `message`, with no underlying error.
    pub fn new(call: impl Into<String>, message: impl Into<String>) -> Self {
        PlatformError { call: call.into(), message: message.into(), source: None }
    }

    /// Attaches the underlying error.
    pub fn with_source(mut self, source: impl StdError + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }
}

/// Errors of the device ports ([`crate::Residency`], [`crate::Fence`]).
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// No CUDA driver library could be loaded on this machine.
    #[error(
        "no CUDA driver found (libcuda could not be loaded); install the NVIDIA driver, or use the host backend"
    )]
    DriverNotFound,
    /// The device has no memory for the request.
    #[error(
        "device out of memory allocating {requested} bytes; lower the GPU budget or free device memory"
    )]
    OutOfMemory {
        /// Bytes requested.
        requested: u64,
    },
    /// The device or its context is lost; nothing on it can be trusted.
    #[error("device lost: {0}")]
    Lost(String),
    /// The ordinal does not name a device on this machine.
    #[error("device {ordinal} does not exist; this machine has {count} device(s)")]
    InvalidDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// Devices present.
        count: u32,
    },
    /// A caller broke a port's contract (an address outside a mapping, a stale handle).
    #[error("invalid use of the device port: {0}")]
    InvalidUse(String),
    /// The device or driver lacks a needed capability.
    #[error("unsupported by this device or driver: {0}")]
    Unsupported(String),
    /// Any other platform failure.
    #[error(transparent)]
    Platform(#[from] PlatformError),
}

/// Errors of a [`crate::WeightSource`].
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The checkpoint is malformed; `reason` says how.
    #[error("invalid checkpoint {}: {}{reason}", file.display(), tensor.as_deref().map(|t| format!("tensor {t:?}: ")).unwrap_or_default())]
    InvalidCheckpoint {
        /// The file at fault.
        file: PathBuf,
        /// The tensor at fault, when the problem is one tensor.
        tensor: Option<String>,
        /// What is wrong.
        reason: String,
    },
    /// A checkpoint file changed (identity differs from the one recorded at open).
    #[error(
        "checkpoint file {} changed while in use ({what}); checkpoint files must not be modified while ddo reads them: unload and reload the component (from Python: unload(), then reload(), on its offload result), which takes the file as it is now",
        file.display()
    )]
    CheckpointChanged {
        /// The file that changed.
        file: PathBuf,
        /// Which part of its identity differs.
        what: String,
    },
    /// A read failed.
    #[error("reading {}: {source}", file.display())]
    Io {
        /// The file being read.
        file: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A destination buffer does not have the slice's length.
    #[error("destination of {got} bytes for tensor {tensor:?} of {expected} bytes")]
    LengthMismatch {
        /// The tensor.
        tensor: String,
        /// Its length.
        expected: u64,
        /// The buffer's length.
        got: u64,
    },
    /// A tensor index outside the source.
    #[error("tensor index {index} is out of range; the source has {count} tensors")]
    NoSuchTensor {
        /// The index asked for.
        index: usize,
        /// Tensors in the source.
        count: usize,
    },
    /// A batch whose destination ranges overlap or leave the buffer.
    #[error("invalid read batch: {0}")]
    InvalidBatch(String),
    /// A host ceiling would be exceeded.
    #[error(
        "{what} ceiling of {} would be exceeded: {} in use, {} requested; raise the ceiling or lower what is kept",
        crate::ByteSize(*ceiling), crate::ByteSize(*used), crate::ByteSize(*requested)
    )]
    CeilingExceeded {
        /// Which ceiling (`retained storage`, `registration`).
        what: &'static str,
        /// The ceiling in bytes.
        ceiling: u64,
        /// Bytes in use.
        used: u64,
        /// Bytes requested.
        requested: u64,
    },
    /// The read path is not available here (O_DIRECT on a filesystem without it).
    #[error("{0}")]
    Unsupported(String),
    /// A device call failed (host registration).
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// Host growth refused by admission.
    #[error("host memory growth refused: {0}")]
    Refused(#[from] crate::Refusal),
}
