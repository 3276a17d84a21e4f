//! A checkpoint served from retained windows as far as the storage ceiling allows.

mod common;

use std::sync::Arc;

use common::*;
use ddo_core::{ReadRequest, SourceError, WeightSource};
use ddo_source::{Checkpoint, CheckpointSource, ReadOptions, RetainedSource, RetainedStore};

const WIDTH: usize = 64; // a block: 3 * 64*64*2 + 128 = 24.7 KiB

fn inner(dir: &std::path::Path, mapped: bool) -> Arc<dyn WeightSource> {
    let path = write_blocks(&dir.join("m.safetensors"), 8, WIDTH);
    let c = Arc::new(Checkpoint::open(&path).unwrap());
    if mapped {
        // SAFETY: the test's file is not modified while mapped.
        Arc::new(unsafe { CheckpointSource::with_mmap(c, 2) }.unwrap())
    } else {
        Arc::new(CheckpointSource::new(c, ReadOptions::default()).unwrap())
    }
}

/// Every tensor through each way of getting its bytes.
fn check_every_tensor(src: &RetainedSource) {
    for (i, s) in src.slices().iter().enumerate() {
        let want = pattern(&s.name, s.len as usize);
        let mut got = vec![0; s.len as usize];
        src.read(i, &mut got).unwrap();
        assert_eq!(got, want, "read {}", s.name);
        let mut batch = vec![0; s.len as usize + 16];
        src.read_batch(&[ReadRequest { slice: i, dst_offset: 16 }], &mut batch).unwrap();
        assert_eq!(&batch[16..], want.as_slice(), "read_batch {}", s.name);
        if let Some(h) = src.host_bytes(i) {
            assert_eq!(h.as_bytes(), want.as_slice(), "host_bytes {}", s.name);
        }
    }
}

/// The file's tensor range `[start, end)` and its bytes as the checkpoint holds them.
fn data_range(src: &dyn WeightSource) -> (u64, u64, Vec<u8>) {
    let start = src.slices().iter().map(|s| s.offset).min().unwrap();
    let end = src.slices().iter().map(|s| s.offset + s.len).max().unwrap();
    let mut bytes = vec![0; (end - start) as usize];
    for s in src.slices() {
        let at = (s.offset - start) as usize;
        bytes[at..at + s.len as usize].copy_from_slice(&pattern(&s.name, s.len as usize));
    }
    (start, end, bytes)
}

#[test]
fn everything_fits_and_is_served_from_windows() {
    let dir = scratch();
    let store = RetainedStore::new(1 << 30, probe(true));
    let (src, report) = RetainedSource::retain(inner(dir.path(), false), &store, 64 << 10).unwrap();
    assert_eq!(report.unretained_bytes, 0);
    assert_eq!(report.stopped, None);
    assert!(report.windows >= 3, "{report:?}");
    assert_eq!(store.used(), report.retained_bytes);
    check_every_tensor(&src);
    // A range over every window comes back in pieces split at window boundaries.
    let (start, end, want) = data_range(&src);
    let file = src.slices()[0].file;
    let pieces = src.host_pieces(file, start, end - start).expect("all retained");
    assert_eq!(pieces.len(), report.windows);
    let mut got = Vec::new();
    for (at, h) in &pieces {
        assert_eq!(*at as usize, got.len());
        got.extend_from_slice(h.as_bytes());
    }
    assert_eq!(got, want);
    // Each window starts on its own page, so registering one never locks another's page.
    let windows = src.windows();
    assert_eq!(windows.len(), report.windows);
    assert!(windows.iter().all(|w| (w.as_bytes().as_ptr() as usize).is_multiple_of(4096)));
    drop(windows);
    drop(pieces);
    drop(src);
    assert_eq!(store.used(), 0, "dropping the source releases its windows");
}

#[test]
fn the_ceiling_keeps_part_and_the_rest_is_read() {
    let dir = scratch();
    let store = RetainedStore::new(100 << 10, probe(true));
    let (src, report) = RetainedSource::retain(inner(dir.path(), false), &store, 32 << 10).unwrap();
    assert!(report.retained_bytes > 0 && report.retained_bytes <= 100 << 10, "{report:?}");
    assert!(report.unretained_bytes > 0);
    assert!(report.stopped.as_deref().unwrap().contains("retained storage ceiling"), "{report:?}");
    check_every_tensor(&src);
    // Without a mapping, a range reaching unretained bytes is not in host memory.
    let (start, end, _) = data_range(&src);
    let file = src.slices()[0].file;
    assert!(src.host_pieces(file, start, end - start).is_none());
    let last = src.slices().len() - 1;
    assert!(src.host_bytes(last).is_none(), "the last tensor is past the ceiling");
}

#[test]
fn with_a_mapping_unretained_bytes_come_from_it() {
    let dir = scratch();
    let store = RetainedStore::new(100 << 10, probe(true));
    let (src, report) = RetainedSource::retain(inner(dir.path(), true), &store, 32 << 10).unwrap();
    assert!(report.unretained_bytes > 0);
    let (start, end, want) = data_range(&src);
    let file = src.slices()[0].file;
    let pieces = src.host_pieces(file, start, end - start).expect("mapping covers the rest");
    assert_eq!(pieces.len(), report.windows + 1);
    let got: Vec<u8> = pieces.iter().flat_map(|(_, h)| h.as_bytes().to_vec()).collect();
    assert_eq!(got, want);
    check_every_tensor(&src);
}

#[test]
fn a_refusing_host_retains_nothing_and_says_why() {
    let dir = scratch();
    let store = RetainedStore::new(1 << 30, probe(false));
    let (src, report) = RetainedSource::retain(inner(dir.path(), false), &store, 64 << 10).unwrap();
    assert_eq!((report.retained_bytes, report.windows), (0, 0));
    assert!(report.stopped.as_deref().unwrap().contains("MemAvailable"), "{report:?}");
    assert_eq!(store.used(), 0);
    check_every_tensor(&src);
}

#[test]
fn a_changed_file_fails_reads_of_retained_bytes_too() {
    let dir = scratch();
    let store = RetainedStore::new(1 << 30, probe(true));
    let (src, _) = RetainedSource::retain(inner(dir.path(), false), &store, 64 << 10).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    write_blocks(&dir.path().join("m.safetensors"), 9, WIDTH);
    let mut buf = vec![0; src.slices()[0].len as usize];
    let e = src.read_batch(&[ReadRequest { slice: 0, dst_offset: 0 }], &mut buf).unwrap_err();
    assert!(matches!(e, SourceError::CheckpointChanged { .. }), "{e}");
    assert!(src.check_unchanged().is_err());
}
