//! Checkpoint sources: safetensors files opened as immutable tensor slices whose bytes reach
//! the arena at full disk and link speed, within separate host ceilings.
//!
//! - [`Checkpoint`] validates one file, several, or a Diffusers model folder (with or without a
//!   `*.safetensors.index.json`) before anything is read, and records each file's identity.
//! - [`CheckpointSource`] implements [`ddo_core::WeightSource`] with three read paths:
//!   `pread` with a worker pool, O_DIRECT through aligned bounce buffers, and copies out of a
//!   memory mapping. Adjacent tensors coalesce into large reads that land in caller buffers.
//!   Mapping is an `unsafe` constructor: the caller promises the files do not change while
//!   mapped; the safe default reads.
//! - [`HostTensorSource`] serves tensors already in host memory (a module's own parameters) in
//!   place, small ones packed per unit so they upload in one copy.
//! - GGUF files open as checkpoints too ([`parse_gguf`]): quantized tensors as opaque bytes,
//!   shaped as their rows times the bytes of a row.
//! - [`EncodedSource`] also holds chosen bf16 and fp16 tensors entropy-coded, in one retained
//!   buffer, or mapped from an encoded file written by an earlier load
//!   ([`EncodedFileIdentity`] says which file serves).
//! - [`ConvertedSource`] serves tensors converted once at load to the module's dtypes (F32,
//!   F16, BF16), from retained memory, and every other tensor from the source it wraps.
//! - [`RetainedStore`] keeps host copies under a storage ceiling, admitted by the host first;
//!   [`Registrar`] page-locks host ranges under a separate ceiling of whole segments;
//!   [`RetainedSource`] serves a checkpoint from retained windows as far as the ceiling allows.
//! - [`StagingPool`] reads announced checkpoint ranges ahead into a fixed set of staging
//!   buffers (O_DIRECT or pread, several requests in flight) under a staging ceiling;
//!   [`StagedSource`] serves the ranges its inner source does not hold in memory from it.
//! - [`ReadAhead`] reads a checkpoint's files into the page cache in the background, so a cold
//!   file is being read while the host builds the module that maps it.
//!
//! Every failure is a [`ddo_core::SourceError`] naming the file, the tensor and the reason; no
//! input makes parsing panic.

mod checkpoint;
mod convert;
mod encoded_file;
mod encoded_mapping;
mod encoded_source;
mod fault;
mod gguf;
mod header;
mod host_tensors;
mod mapping;
mod plan;
mod read;
mod read_ahead;
mod registration;
mod retained;
mod retained_source;
mod shared;
mod source;
mod staged_source;
mod staging;

pub use checkpoint::{Checkpoint, CheckpointFile, file_identity, parse_index};
pub use convert::{ConversionReport, ConvertedSource, convert, convertible};
pub use encoded_file::{
    ABANDONED_AFTER, BODY_ALIGN, CachedFile, ENCODED_FILE_VERSION, EncodedFileIdentity,
    EncodedFileRefusal, cached_files, lower_thread_priority, mark_used, record_decision,
    recorded_decision, remove_cached,
};
pub use encoded_source::{EncodedSource, EncodingReport};
pub use gguf::{DEFAULT_ALIGNMENT, GGUF_MAGIC, GgufHeader, parse_gguf};
pub use header::{Header, HeaderEntry, MAX_HEADER_LEN, header_len, parse_header};
pub use host_tensors::{HostTensor, HostTensorSource, PackReport};
pub use mapping::{MappedFile, POPULATE_CHUNK};
pub use read::{DIRECT_ALIGN, ReadMethod, ReadOptions};
pub use read_ahead::ReadAhead;
pub use registration::{REGISTRATION_SEGMENT, RegisteredRange, Registrar};
pub use retained::{RetainedBuffer, RetainedStore};
pub use retained_source::{RetainedReport, RetainedSource};
pub use source::{CheckpointSource, MmapChoice};
pub use staged_source::StagedSource;
pub use staging::{StagingOptions, StagingPool, StagingStats};

/// Copies a tensor's host bytes into `dst`, which must be as long.
pub(crate) fn copy_host_bytes(
    name: &str,
    bytes: &ddo_core::HostSlice,
    dst: &mut [u8],
) -> Result<(), ddo_core::SourceError> {
    if bytes.len() != dst.len() {
        return Err(ddo_core::SourceError::InvalidBatch(format!(
            "tensor {name:?} has {} bytes, the destination {}",
            bytes.len(),
            dst.len()
        )));
    }
    dst.copy_from_slice(bytes.as_bytes());
    Ok(())
}
