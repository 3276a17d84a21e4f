//! One mapping per file per process: sources of the same checkpoint (several GPUs, several
//! sessions) share it, so the file's pages are mapped, counted and page-locked once.

mod common;

use std::sync::Arc;

use common::*;
use ddo_core::WeightSource;
use ddo_source::{Checkpoint, CheckpointSource, MappedFile};

fn mapped(path: &std::path::Path) -> CheckpointSource {
    let checkpoint = Arc::new(Checkpoint::open(path).unwrap());
    // SAFETY: the test's files are not modified while mapped (the replacement below is a new file).
    unsafe { CheckpointSource::with_mmap(checkpoint, 1) }.unwrap()
}

fn address(source: &CheckpointSource) -> usize {
    source.host_bytes(0).unwrap().as_bytes().as_ptr() as usize
}

#[test]
fn two_sources_of_one_checkpoint_share_its_mapping() {
    let dir = scratch();
    let path = write_blocks(&dir.path().join("model.safetensors"), 2, 64);
    let (a, b) = (mapped(&path), mapped(&path));
    assert_eq!(address(&a), address(&b), "the second source maps the file again");
    assert!(Arc::ptr_eq(a.mapping(0).unwrap(), b.mapping(0).unwrap()));
    // The mapping lives while either source does.
    let first = address(&a);
    drop(a);
    assert_eq!(b.host_bytes(0).unwrap().as_bytes().as_ptr() as usize, first);
    let t = &b.slices()[0];
    assert_eq!(b.host_bytes(0).unwrap().as_bytes(), &pattern(&t.name, t.len as usize)[..]);
}

#[test]
fn a_replaced_file_gets_a_mapping_of_its_own() {
    let dir = scratch();
    let path = write_blocks(&dir.path().join("model.safetensors"), 2, 64);
    let old = mapped(&path);
    // Written elsewhere and renamed over the old file: a new inode, the old mapping keeps the
    // old bytes for the source that holds it.
    let tmp = write_blocks(&dir.path().join("new.safetensors"), 2, 64);
    std::fs::rename(&tmp, &path).unwrap();
    let new = mapped(&path);
    assert!(!Arc::ptr_eq(old.mapping(0).unwrap(), new.mapping(0).unwrap()));
    // SAFETY: as above.
    let again = unsafe { MappedFile::shared(&path) }.unwrap();
    assert!(Arc::ptr_eq(&again, new.mapping(0).unwrap()));
}
