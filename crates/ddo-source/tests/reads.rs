//! The read paths deliver the checkpoint's exact bytes, coalesced, into caller buffers.

mod common;

use std::sync::Arc;

use common::*;
use ddo_core::{ReadRequest, SourceError, WeightSource};
use ddo_source::{Checkpoint, CheckpointSource, ReadMethod, ReadOptions};

fn sources(checkpoint: &Arc<Checkpoint>) -> Vec<(&'static str, CheckpointSource)> {
    let pread = ReadOptions { method: ReadMethod::Pread, workers: 3, chunk_bytes: 1000 };
    let direct = ReadOptions { method: ReadMethod::Direct, workers: 2, chunk_bytes: 5000 };
    vec![
        ("pread", CheckpointSource::new(checkpoint.clone(), pread).unwrap()),
        ("direct", CheckpointSource::new(checkpoint.clone(), direct).unwrap()),
        // SAFETY: the test does not modify the file while the source lives.
        ("mmap", unsafe { CheckpointSource::with_mmap(checkpoint.clone(), 2) }.unwrap()),
    ]
}

#[test]
fn every_path_reads_the_exact_bytes_of_each_tensor() {
    let dir = scratch();
    let path = write_blocks(&dir.path().join("m.safetensors"), 6, 48);
    let checkpoint = Arc::new(Checkpoint::open(&path).unwrap());
    for (name, source) in sources(&checkpoint) {
        for (i, s) in source.slices().iter().enumerate() {
            let mut dst = vec![0u8; s.len as usize];
            source.read(i, &mut dst).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(dst, pattern(&s.name, s.len as usize), "{name} {}", s.name);
        }
    }
}

#[test]
fn a_unit_batch_lands_at_aligned_offsets() {
    let dir = scratch();
    let path = write_blocks(&dir.path().join("m.safetensors"), 4, 40);
    let checkpoint = Arc::new(Checkpoint::open(&path).unwrap());
    // Pack block 2 at 256-byte aligned offsets, in reverse name order.
    let mut requests = Vec::new();
    let mut offset = 0u64;
    let mut names: Vec<&str> =
        checkpoint.slices().iter().map(|s| s.name.as_str()).filter(|n| n.contains(".2.")).collect();
    names.reverse();
    for n in &names {
        let i = checkpoint.find(n).unwrap();
        requests.push(ReadRequest { slice: i, dst_offset: offset });
        offset = (offset + checkpoint.slices()[i].len).div_ceil(256) * 256;
    }
    for (name, source) in sources(&checkpoint) {
        let mut dst = vec![0xAAu8; offset as usize];
        source.read_batch(&requests, &mut dst).unwrap();
        for r in &requests {
            let s = &checkpoint.slices()[r.slice];
            let got = &dst[r.dst_offset as usize..(r.dst_offset + s.len) as usize];
            assert_eq!(got, pattern(&s.name, s.len as usize).as_slice(), "{name} {}", s.name);
        }
        // Padding is untouched.
        let first = &checkpoint.slices()[requests[0].slice];
        if !first.len.is_multiple_of(256) {
            assert_eq!(dst[first.len as usize], 0xAA, "{name}");
        }
    }
}

#[test]
fn sharded_checkpoints_read_across_files() {
    let dir = scratch();
    write(&dir.path().join("a.safetensors"), &[("x", vec![1000]), ("y", vec![10])]);
    write(&dir.path().join("b.safetensors"), &[("z", vec![3000])]);
    let checkpoint = Arc::new(Checkpoint::open(dir.path()).unwrap());
    let total: u64 = checkpoint.total_bytes();
    let mut requests = Vec::new();
    let mut at = 0;
    for (i, s) in checkpoint.slices().iter().enumerate() {
        requests.push(ReadRequest { slice: i, dst_offset: at });
        at += s.len;
    }
    for (name, source) in sources(&checkpoint) {
        let mut dst = vec![0u8; total as usize];
        source.read_batch(&requests, &mut dst).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (r, s) in requests.iter().zip(checkpoint.slices()) {
            assert_eq!(
                &dst[r.dst_offset as usize..][..s.len as usize],
                pattern(&s.name, s.len as usize).as_slice()
            );
        }
    }
}

#[test]
fn mapped_sources_hand_out_host_bytes_without_copying() {
    let dir = scratch();
    let path = write(&dir.path().join("m.safetensors"), &[("w", vec![64])]);
    let checkpoint = Arc::new(Checkpoint::open(&path).unwrap());
    // SAFETY: the file is not modified while mapped.
    let mapped = unsafe { CheckpointSource::with_mmap(checkpoint.clone(), 1) }.unwrap();
    let bytes = mapped.host_bytes(0).unwrap();
    assert_eq!(bytes.as_bytes(), pattern("w", 128).as_slice());
    let read = CheckpointSource::new(checkpoint, ReadOptions::default()).unwrap();
    assert!(read.host_bytes(0).is_none());
}

#[test]
fn a_changed_file_fails_the_next_batch() {
    let dir = scratch();
    let path = write(&dir.path().join("m.safetensors"), &[("w", vec![64])]);
    let checkpoint = Arc::new(Checkpoint::open(&path).unwrap());
    for (name, source) in sources(&checkpoint).into_iter().filter(|(n, _)| *n != "mmap") {
        std::thread::sleep(std::time::Duration::from_millis(10));
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes).unwrap();
        let mut dst = vec![0u8; 128];
        let e = source.read(0, &mut dst).unwrap_err();
        assert!(matches!(e, SourceError::CheckpointChanged { .. }), "{name}: {e}");
        assert_eq!(dst, vec![0u8; 128], "{name}: nothing delivered");
    }
}

#[test]
fn bad_requests_are_errors() {
    let dir = scratch();
    let path = write(&dir.path().join("m.safetensors"), &[("w", vec![64])]);
    let checkpoint = Arc::new(Checkpoint::open(&path).unwrap());
    let source = CheckpointSource::new(checkpoint.clone(), ReadOptions::default()).unwrap();
    let mut small = vec![0u8; 10];
    assert_eq!(
        source.read(0, &mut small).unwrap_err().to_string(),
        "destination of 10 bytes for tensor \"w\" of 128 bytes"
    );
    assert!(matches!(
        source.read(9, &mut small),
        Err(SourceError::NoSuchTensor { index: 9, count: 1 })
    ));
    let mmap = ReadOptions { method: ReadMethod::Mmap, ..ReadOptions::default() };
    assert!(CheckpointSource::new(checkpoint, mmap).unwrap_err().to_string().contains("with_mmap"));
}

#[test]
fn an_index_whose_file_has_an_unlisted_tensor() {
    let dir = scratch();
    write(&dir.path().join("s1.safetensors"), &[("a", vec![2]), ("extra", vec![2])]);
    std::fs::write(
        dir.path().join("m.safetensors.index.json"),
        r#"{"weight_map":{"a":"s1.safetensors"}}"#,
    )
    .unwrap();
    let e = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(
        e.ends_with(&format!(
            "tensor \"extra\": tensor is missing from the index {}",
            dir.path().join("m.safetensors.index.json").display()
        )),
        "{e}"
    );
}

#[test]
fn tensors_with_zero_elements_read_as_nothing_on_every_path() {
    let dir = scratch();
    let path = write(
        &dir.path().join("m.safetensors"),
        &[("a", vec![3]), ("empty", vec![0, 4]), ("c", vec![2])],
    );
    let checkpoint = Arc::new(Checkpoint::open(&path).unwrap());
    let find = |n| checkpoint.find(n).unwrap();
    let requests: Vec<ReadRequest> = [("a", 0u64), ("empty", 6), ("c", 6)]
        .into_iter()
        .map(|(n, dst_offset)| ReadRequest { slice: find(n), dst_offset })
        .collect();
    for (name, source) in sources(&checkpoint) {
        source.read(find("empty"), &mut []).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut dst = vec![0u8; 10];
        source.read_batch(&requests, &mut dst).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(&dst[..6], pattern("a", 6).as_slice(), "{name}");
        assert_eq!(&dst[6..], pattern("c", 4).as_slice(), "{name}");
    }
}

#[test]
fn a_mapped_file_truncated_under_its_readers_reads_zeros_and_is_reported_instead_of_killing_the_process()
 {
    let dir = scratch();
    let path =
        write(&dir.path().join("m.safetensors"), &[("w", vec![64 * 1024]), ("x", vec![64 * 1024])]);
    let checkpoint = Arc::new(Checkpoint::open(&path).unwrap());
    // SAFETY: the file is truncated on purpose: what this test checks.
    let source = unsafe { CheckpointSource::with_mmap(checkpoint.clone(), 1) }.unwrap();
    let mapping = source.mapping(0).unwrap().clone();
    let len = mapping.as_bytes().len();
    assert!(!mapping.faulted());
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(4096).unwrap();
    // A read past the new end (what an upload's copy or a conversion does) completes with zeros.
    // SAFETY: inside the mapping; volatile, so the read is not optimized away.
    let last = unsafe { std::ptr::read_volatile(mapping.as_bytes().as_ptr().add(len - 1)) };
    assert_eq!(last, 0);
    assert!(mapping.faulted(), "the fault is noted");
    let err = source.check_unchanged().unwrap_err().to_string();
    assert!(err.contains("changed"), "{err}");
    let mut dst = vec![0u8; checkpoint.slices()[1].len as usize];
    assert!(matches!(source.read(1, &mut dst), Err(SourceError::CheckpointChanged { .. })));
    // Bytes before the new end still read as the file's.
    assert_eq!(mapping.as_bytes()[0], std::fs::read(&path).unwrap()[0]);
}
