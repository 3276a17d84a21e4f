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

#[test]
fn a_mapping_made_from_a_descriptor_is_of_the_file_it_reads_whatever_the_path_names_by_now() {
    let dir = scratch();
    let a = write_blocks(&dir.path().join("a.safetensors"), 2, 64);
    let mut other = std::fs::read(&a).unwrap();
    let n = other.len();
    other[n - 64..].iter_mut().for_each(|b| *b ^= 0xff);
    let b = dir.path().join("b.safetensors");
    std::fs::write(&b, &other).unwrap();
    let link = dir.path().join("model.safetensors");
    std::os::unix::fs::symlink(&a, &link).unwrap();
    let checkpoint = Checkpoint::open(&link).unwrap();
    // The link repointed after the checkpoint read its header: a mapping made now, from the
    // descriptor the checkpoint read, holds the file the checkpoint describes.
    std::fs::remove_file(&link).unwrap();
    std::os::unix::fs::symlink(&b, &link).unwrap();
    // SAFETY: neither file is modified while mapped.
    let map = unsafe { MappedFile::shared_open(checkpoint.opened(0).unwrap(), &link) }.unwrap();
    // SAFETY: as above.
    let by_path = unsafe { MappedFile::shared(&link) }.unwrap();
    assert_eq!(map.as_bytes(), &std::fs::read(&a).unwrap()[..]);
    assert_eq!(by_path.as_bytes(), &other[..], "the path names the other file now");
    checkpoint.check_open().unwrap();
    assert!(
        checkpoint.check_unchanged().unwrap_err().to_string().contains("(the file was replaced)")
    );
}
