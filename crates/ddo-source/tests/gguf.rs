//! GGUF files as checkpoints: tensor infos, alignment, quantized tensors as opaque bytes, and
//! every corrupt header refused by name.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use ddo_core::{Dtype, WeightSource};
use ddo_source::{Checkpoint, CheckpointSource, ReadOptions, parse_gguf};

/// A tensor to write: name, GGML type id, dimensions innermost first, payload bytes.
struct Tensor {
    name: &'static str,
    kind: u32,
    ne: Vec<u64>,
    bytes: usize,
}

fn gstr(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A GGUF v3 file: a string, an array and (when given) `general.alignment` in the metadata,
/// then `tensors` at aligned offsets, each filled with [`pattern`] bytes.
fn gguf(alignment: Option<u32>, tensors: &[Tensor]) -> Vec<u8> {
    let align = u64::from(alignment.unwrap_or(32));
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((2 + u64::from(alignment.is_some())).to_le_bytes());
    gstr(&mut out, "general.architecture");
    out.extend(8u32.to_le_bytes());
    gstr(&mut out, "flux");
    gstr(&mut out, "tokenizer.list");
    out.extend(9u32.to_le_bytes());
    out.extend(4u32.to_le_bytes()); // array of u32
    out.extend(3u64.to_le_bytes());
    for v in [1u32, 2, 3] {
        out.extend(v.to_le_bytes());
    }
    if let Some(a) = alignment {
        gstr(&mut out, "general.alignment");
        out.extend(4u32.to_le_bytes());
        out.extend(a.to_le_bytes());
    }
    let mut offset = 0u64;
    let mut offsets = Vec::new();
    for t in tensors {
        gstr(&mut out, t.name);
        out.extend((t.ne.len() as u32).to_le_bytes());
        for d in &t.ne {
            out.extend(d.to_le_bytes());
        }
        out.extend(t.kind.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offsets.push(offset);
        offset = (offset + t.bytes as u64).div_ceil(align) * align;
    }
    out.resize((out.len() as u64).div_ceil(align) as usize * align as usize, 0);
    let start = out.len();
    for (t, at) in tensors.iter().zip(offsets) {
        out.resize(start + at as usize, 0);
        out.extend(pattern(t.name, t.bytes));
    }
    out
}

fn tensors() -> Vec<Tensor> {
    vec![
        // Q8_0: blocks of 32 elements in 34 bytes; 3 rows of 64 elements = 3 x 68 bytes.
        Tensor { name: "blocks.0.attn.weight", kind: 8, ne: vec![64, 3], bytes: 204 },
        Tensor { name: "blocks.0.norm.weight", kind: 0, ne: vec![8], bytes: 32 },
        Tensor { name: "blocks.1.attn.weight", kind: 12, ne: vec![256, 2], bytes: 288 },
        Tensor { name: "blocks.1.norm.weight", kind: 30, ne: vec![8, 2], bytes: 32 },
    ]
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn a_gguf_file_opens_as_a_checkpoint_with_quantized_tensors_as_bytes() {
    let dir = scratch();
    for alignment in [None, Some(64)] {
        let path = write(dir.path(), "model.gguf", &gguf(alignment, &tensors()));
        let c = Checkpoint::open(&path).unwrap();
        let s = c.slices();
        assert_eq!(s.len(), 4);
        let q8 = &s[c.find("blocks.0.attn.weight").unwrap()];
        assert_eq!((q8.dtype, q8.shape.clone(), q8.len), (Dtype::U8, vec![3, 68], 204));
        let f32 = &s[c.find("blocks.0.norm.weight").unwrap()];
        assert_eq!((f32.dtype, f32.shape.clone(), f32.len), (Dtype::F32, vec![8], 32));
        let q4k = &s[c.find("blocks.1.attn.weight").unwrap()];
        assert_eq!((q4k.dtype, q4k.shape.clone()), (Dtype::U8, vec![2, 144]));
        let bf16 = &s[c.find("blocks.1.norm.weight").unwrap()];
        assert_eq!((bf16.dtype, bf16.shape.clone()), (Dtype::BF16, vec![2, 8]));
        let align = alignment.map_or(32, u64::from);
        assert!(s.iter().all(|t| (t.offset - c.files()[0].data_start).is_multiple_of(align)));
        // Every tensor's bytes, read and mapped.
        let c = std::sync::Arc::new(c);
        let read = CheckpointSource::new(c.clone(), ReadOptions::default()).unwrap();
        // SAFETY: the test's file is not modified while mapped.
        let mapped = unsafe { CheckpointSource::with_mmap(c.clone(), 1) }.unwrap();
        for (i, t) in c.slices().iter().enumerate() {
            let mut got = vec![0; t.len as usize];
            read.read(i, &mut got).unwrap();
            assert_eq!(got, pattern(&t.name, t.len as usize), "{}", t.name);
            assert_eq!(mapped.host_bytes(i).unwrap().as_bytes(), got.as_slice());
        }
    }
    let h = parse_gguf(&gguf(Some(64), &tensors()), u64::MAX, Path::new("x.gguf")).unwrap();
    assert_eq!((h.version, h.alignment), (3, 64));
    assert_eq!(h.types, ["Q8_0", "F32", "Q4_K", "BF16"]);
}

/// Replaces the first occurrence of `from` in `bytes` with `to` (same length).
fn patched(bytes: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let at = bytes.windows(from.len()).position(|w| w == from).expect("pattern present");
    let mut out = bytes.to_vec();
    out[at..at + to.len()].copy_from_slice(to);
    out
}

#[test]
fn every_corrupt_header_is_refused_by_name() {
    let dir = scratch();
    let good = gguf(None, &tensors());
    let q8_type = [8u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]; // type 8, offset 0
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("magic", patched(&good, b"GGUF", b"GGUG"), "not a GGUF file"),
        ("version", patched(&good, &[3, 0, 0, 0], &[1, 0, 0, 0]), "version 1"),
        ("truncated", good[..60].to_vec(), "ends inside"),
        (
            "type",
            patched(&good, &q8_type, &[99, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
            "unknown or retired GGML type 99",
        ),
        (
            "offset",
            patched(&good, &q8_type, &[8, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0]),
            "not a multiple of the alignment",
        ),
        ("beyond", good[..good.len() - 8].to_vec(), "leave the file"),
        ("name", patched(&good, b"blocks.1.attn.weight", b"blocks.0.attn.weight"), "written twice"),
        (
            "rows",
            patched(
                &good,
                &[64, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0],
                &[60, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0],
            ),
            "block of 32",
        ),
        (
            "count",
            patched(
                &good,
                &[4, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0],
                &[0, 0, 0, 0, 0, 0, 0, 64, 2, 0, 0, 0],
            ),
            "more than the",
        ),
    ];
    for (what, bytes, message) in cases {
        let path = write(dir.path(), "bad.gguf", &bytes);
        let e = Checkpoint::open(&path).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains(message), "{what}: {e}");
        assert!(e.contains("bad.gguf"), "{what}: the error names the file: {e}");
    }
    // Overlapping tensors: the second tensor's offset moved onto the first.
    let mut overlapping = tensors();
    overlapping.truncate(2);
    let bytes = gguf(None, &overlapping);
    let h = parse_gguf(&bytes, bytes.len() as u64, Path::new("x.gguf")).unwrap();
    assert_eq!(h.entries.len(), 2);
    let at = bytes
        .windows(8)
        .rposition(|w| w == (h.entries[1].offset - h.data_start).to_le_bytes())
        .unwrap();
    let mut moved = bytes.clone();
    moved[at..at + 8].copy_from_slice(&0u64.to_le_bytes());
    let e = parse_gguf(&moved, moved.len() as u64, Path::new("x.gguf")).unwrap_err().to_string();
    assert!(e.contains("overlap"), "{e}");
}

#[test]
fn sizes_that_overflow_are_refused() {
    // An F32 row of 2^63 elements (its bytes overflow), 2^40 x 2^40 rows of none, 2^66 elements.
    for (kind, ne) in [
        (0u32, vec![1u64 << 63]),
        (0, vec![0, 1 << 40, 1 << 40]),
        (0, vec![1 << 33, 1 << 33, 0]),
        (0, vec![0, 0, 1 << 62, 1 << 62]),
    ] {
        let t = Tensor { name: "x", kind, ne, bytes: 0 };
        let bytes = gguf(None, &[t]);
        let e =
            parse_gguf(&bytes, bytes.len() as u64, Path::new("x.gguf")).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
    }
}
