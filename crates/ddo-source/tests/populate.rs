//! `MappedFile::populate`: a file evicted from the page cache is resident in the mapping after
//! it, in parallel chunks; a truncated file stops it without a fault.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::Path;

use ddo_source::{MappedFile, POPULATE_CHUNK};

const LEN: usize = 3 * POPULATE_CHUNK + 12345;

fn written(path: &Path, len: usize) {
    let mut f = File::create(path).unwrap();
    let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    f.write_all(&bytes).unwrap();
    f.sync_all().unwrap();
}

/// Drops the file's clean pages from the page cache.
fn evicted(path: &Path) {
    let f = File::open(path).unwrap();
    // SAFETY: a plain advisory call on an open descriptor.
    assert_eq!(unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) }, 0);
}

/// Pages of the mapping resident in memory, of all its pages.
fn resident(map: &MappedFile) -> (usize, usize) {
    let bytes = map.as_bytes();
    let pages = bytes.len().div_ceil(4096);
    let mut v = vec![0u8; pages];
    // SAFETY: `v` has one byte per page of the mapping, which is page-aligned.
    let rc =
        unsafe { libc::mincore(bytes.as_ptr() as *mut libc::c_void, bytes.len(), v.as_mut_ptr()) };
    assert_eq!(rc, 0);
    (v.iter().filter(|b| **b & 1 == 1).count(), pages)
}

#[test]
fn an_evicted_file_is_resident_after_populating_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    written(&path, LEN);
    evicted(&path);
    // SAFETY: the test's file is not modified while mapped.
    let map = unsafe { MappedFile::map(&path) }.unwrap();
    let (before, pages) = resident(&map);
    assert!(before < pages / 2, "the file was evicted: {before} of {pages} pages resident");
    assert_eq!(map.populate(0, LEN, 4), LEN);
    let (after, pages) = resident(&map);
    assert_eq!(after, pages, "every page is resident after populating");
    assert_eq!(map.as_bytes()[LEN - 1], ((LEN - 1) * 7 % 251) as u8);
}

#[test]
fn populating_part_of_a_file_brings_in_that_part() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    written(&path, LEN);
    evicted(&path);
    // SAFETY: the test's file is not modified while mapped.
    let map = unsafe { MappedFile::map(&path) }.unwrap();
    let (offset, len) = (POPULATE_CHUNK + 100, POPULATE_CHUNK);
    assert_eq!(map.populate(offset, len, 3), len + 100);
    let (after, pages) = resident(&map);
    assert!(after >= len / 4096 && after < pages, "{after} of {pages}");
    assert_eq!(map.populate(LEN, 1, 2), 0, "a range past the end populates nothing");
}

#[test]
fn a_file_truncated_while_mapped_stops_populating_without_a_fault() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    written(&path, LEN);
    // SAFETY: the file is truncated on purpose: populate must not fault on the lost range.
    let map = unsafe { MappedFile::map(&path) }.unwrap();
    File::options().write(true).open(&path).unwrap().set_len(POPULATE_CHUNK as u64).unwrap();
    let got = map.populate(0, LEN, 1);
    assert!(got < LEN, "the lost range is not populated: {got}");
    assert!(!map.faulted(), "no read went past the end");
}

/// Pages of `path` in the page cache, of all its pages (through a mapping that touches none).
fn cached(path: &Path) -> (usize, usize) {
    // SAFETY: the test's file is not modified while mapped.
    let map = unsafe { MappedFile::map(path) }.unwrap();
    resident(&map)
}

#[test]
fn reading_ahead_brings_an_evicted_file_into_the_page_cache() {
    let dir = tempfile::tempdir().unwrap();
    let paths = [dir.path().join("a.safetensors"), dir.path().join("b.safetensors")];
    for p in &paths {
        written(p, LEN);
        evicted(p);
    }
    let (before, _) = cached(&paths[1]);
    let ahead = ddo_source::ReadAhead::start(&paths, 3).unwrap();
    assert_eq!(ahead.total(), 2 * LEN as u64);
    // Every evicted chunk of both files is read in (a partial last page may stay cached).
    let read = ahead.wait();
    assert!(read >= 6 * POPULATE_CHUNK as u64 && read <= 2 * LEN as u64, "{read}");
    // The kernel reads asynchronously: wait for the pages to land.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    for p in &paths {
        loop {
            let (now, pages) = cached(p);
            if now == pages {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} of {pages} pages cached (before: {before})",
                now
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

#[test]
fn reading_ahead_a_missing_file_names_it_and_starts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let there = dir.path().join("a.safetensors");
    written(&there, 4096);
    let missing = dir.path().join("gone.safetensors");
    let err = ddo_source::ReadAhead::start(&[there, missing.clone()], 2).unwrap_err();
    assert!(err.to_string().contains("gone.safetensors"), "{err}");
}

#[test]
fn dropping_a_read_ahead_stops_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.safetensors");
    written(&path, LEN);
    let ahead = ddo_source::ReadAhead::start(std::slice::from_ref(&path), 1).unwrap();
    drop(ahead);
    // The worker ended (joined in drop); a new read ahead of the same file still works.
    evicted(&path);
    let again = ddo_source::ReadAhead::start(&[path], 1).unwrap();
    // Every evicted chunk is read in again (a file's partial last page may stay cached).
    let read = again.wait();
    assert!(read >= 3 * POPULATE_CHUNK as u64 && read <= LEN as u64, "{read}");
}
