//! Fixture checkpoints written with the reference safetensors serializer.

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;

/// Where tests write files: `DDO_TEST_TMPDIR` when set (bundles run where the build's target
/// folder does not exist), else the build's own temporary folder.
pub fn test_tmpdir() -> std::path::PathBuf {
    let dir = std::env::var_os("DDO_TEST_TMPDIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A directory on the target's disk (O_DIRECT needs a real filesystem).
pub fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("ddo-source-").tempdir_in(test_tmpdir()).unwrap()
}

/// Deterministic bytes for tensor `name`.
pub fn pattern(name: &str, len: usize) -> Vec<u8> {
    let seed = name.bytes().fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    (0..len)
        .map(|i| (seed.wrapping_add(i as u32).wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

/// Writes a safetensors file of BF16 tensors `(name, shape)` filled with [`pattern`].
pub fn write(path: &Path, tensors: &[(&str, Vec<usize>)]) -> PathBuf {
    let data: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(n, shape)| {
            let len = shape.iter().product::<usize>() * 2;
            (n.to_string(), pattern(n, len), shape.clone())
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = data
        .iter()
        .map(|(n, bytes, shape)| {
            (n.clone(), TensorView::new(safetensors::Dtype::BF16, shape.clone(), bytes).unwrap())
        })
        .collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    std::fs::write(path, bytes).unwrap();
    path.to_owned()
}

/// A Flux-like block layout: `blocks` blocks of a few tensors each.
pub fn block_tensors(blocks: usize, width: usize) -> Vec<(String, Vec<usize>)> {
    let mut out = vec![("proj_in.weight".to_owned(), vec![width, 64])];
    for b in 0..blocks {
        for part in ["attn.to_q.weight", "attn.to_k.weight", "ff.net.0.weight", "norm.weight"] {
            let shape = if part == "norm.weight" { vec![width] } else { vec![width, width] };
            out.push((format!("transformer_blocks.{b}.{part}"), shape));
        }
    }
    out
}

pub fn write_blocks(path: &Path, blocks: usize, width: usize) -> PathBuf {
    let tensors = block_tensors(blocks, width);
    let refs: Vec<(&str, Vec<usize>)> =
        tensors.iter().map(|(n, s)| (n.as_str(), s.clone())).collect();
    write(path, &refs)
}

/// Writes a raw file: header JSON with the given length field, then `data` bytes.
pub fn raw(path: &Path, header: &[u8], len_field: u64, data: usize) -> PathBuf {
    let mut v = len_field.to_le_bytes().to_vec();
    v.extend_from_slice(header);
    v.extend(std::iter::repeat_n(7u8, data));
    std::fs::write(path, v).unwrap();
    path.to_owned()
}

/// An admission probe that grants everything, or refuses everything for lack of memory.
#[allow(dead_code)]
pub fn probe(grant: bool) -> std::sync::Arc<ddo_core::MockAdmissionProbe> {
    use ddo_core::{Admission, Refusal, RefusalReason};
    let mut p = ddo_core::MockAdmissionProbe::new();
    p.expect_admit().returning(move |r| {
        if grant {
            Admission::Granted { headroom: 1 << 40 }
        } else {
            Admission::Refused(Refusal {
                request: *r,
                reason: RefusalReason::MemAvailable { available: 1 << 20, margin: 1 << 30 },
            })
        }
    });
    std::sync::Arc::new(p)
}
