//! Opening and validating checkpoints: files, folders, indexes, and every corruption.

mod common;

use std::path::Path;

use common::*;
use ddo_core::SourceError;
use ddo_source::Checkpoint;

fn open_err(path: &Path) -> String {
    Checkpoint::open(path).expect_err("open should fail").to_string()
}

#[test]
fn a_file_lists_every_tensor_with_its_slice() {
    let dir = scratch();
    let path = write(&dir.path().join("m.safetensors"), &[("a", vec![4, 4]), ("b", vec![3])]);
    let c = Checkpoint::open(&path).unwrap();
    let a = &c.slices()[c.find("a").unwrap()];
    assert_eq!((a.dtype, a.shape.clone(), a.len), (ddo_core::Dtype::BF16, vec![4, 4], 32));
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[a.offset as usize..(a.offset + a.len) as usize], pattern("a", 32).as_slice());
    assert_eq!(c.total_bytes(), 38);
    assert_eq!(c.files()[0].identity.size, bytes.len() as u64);
}

#[test]
fn a_diffusers_folder_with_and_without_index() {
    let dir = scratch();
    write(&dir.path().join("diffusion_pytorch_model.safetensors"), &[("x", vec![2])]);
    std::fs::write(dir.path().join("config.json"), "{}").unwrap();
    assert_eq!(Checkpoint::open(dir.path()).unwrap().slices().len(), 1);

    let sharded = scratch();
    let d = sharded.path();
    write(
        &d.join("diffusion_pytorch_model-00001-of-00002.safetensors"),
        &[("a", vec![2]), ("b", vec![2])],
    );
    write(&d.join("diffusion_pytorch_model-00002-of-00002.safetensors"), &[("c", vec![2])]);
    std::fs::write(
        d.join("diffusion_pytorch_model.safetensors.index.json"),
        r#"{"metadata":{"total_size":12},"weight_map":{"a":"diffusion_pytorch_model-00001-of-00002.safetensors","b":"diffusion_pytorch_model-00001-of-00002.safetensors","c":"diffusion_pytorch_model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let c = Checkpoint::open(d).unwrap();
    assert_eq!(c.files().len(), 2);
    assert_eq!(c.slices()[c.find("c").unwrap()].file.0, 1);
    // The index itself opens the same checkpoint (how a variant's index is chosen).
    let by_index =
        Checkpoint::open(d.join("diffusion_pytorch_model.safetensors.index.json")).unwrap();
    assert_eq!(by_index.slices().len(), 3);
}

#[test]
fn variant_files_are_skipped_beside_the_plain_ones() {
    let dir = scratch();
    let d = dir.path();
    write(&d.join("model.safetensors"), &[("x", vec![2])]);
    write(&d.join("model.fp16.safetensors"), &[("x", vec![2])]);
    write(&d.join("model.bf16-00001-of-00002.safetensors"), &[("x", vec![2])]);
    let c = Checkpoint::open(d).unwrap();
    assert_eq!(c.files().len(), 1);
    assert!(c.files()[0].path.ends_with("model.safetensors"));
    // Shards without a variant are plain files.
    let sharded = scratch();
    let s = sharded.path();
    write(&s.join("model-00001-of-00002.safetensors"), &[("a", vec![2])]);
    write(&s.join("model-00002-of-00002.safetensors"), &[("b", vec![2])]);
    write(&s.join("model.fp16-00001-of-00001.safetensors"), &[("a", vec![2]), ("b", vec![2])]);
    assert_eq!(Checkpoint::open(s).unwrap().files().len(), 2);
    // One variant alone is the checkpoint; two variants alone are refused by name.
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    std::fs::remove_file(d.join("model.bf16-00001-of-00002.safetensors")).unwrap();
    assert_eq!(Checkpoint::open(d).unwrap().files().len(), 1);
    write(&d.join("model.bf16.safetensors"), &[("x", vec![2])]);
    let e = open_err(d);
    assert!(e.contains("variants bf16, fp16"), "{e}");
}

fn index_folder(weight_map: &str) -> tempfile::TempDir {
    let dir = scratch();
    write(&dir.path().join("s1.safetensors"), &[("a", vec![2])]);
    write(&dir.path().join("s2.safetensors"), &[("b", vec![2])]);
    std::fs::write(
        dir.path().join("m.safetensors.index.json"),
        format!(r#"{{"weight_map":{weight_map}}}"#),
    )
    .unwrap();
    dir
}

#[test]
fn an_index_pointing_nowhere() {
    let d = index_folder(r#"{"a":"s1.safetensors","b":"gone.safetensors"}"#);
    assert_eq!(
        open_err(d.path()),
        format!(
            "invalid checkpoint {}: tensor \"b\": index points to missing file \"gone.safetensors\"",
            d.path().join("m.safetensors.index.json").display()
        )
    );
    let d = index_folder(r#"{"a":"s1.safetensors","b":"s2.safetensors","z":"s2.safetensors"}"#);
    assert!(
        open_err(d.path()).ends_with(
            "tensor \"z\": index maps it to \"s2.safetensors\", which has no such tensor"
        )
    );
    let d = index_folder(r#"{"a":"s2.safetensors","b":"s2.safetensors"}"#);
    assert!(
        open_err(d.path()).ends_with(
            "tensor \"a\": index maps it to \"s2.safetensors\", which has no such tensor"
        )
    );
    // The index defines the checkpoint: a file it does not name is not part of it.
    let d = index_folder(r#"{"a":"s1.safetensors"}"#);
    assert_eq!(Checkpoint::open(d.path()).unwrap().slices().len(), 1);
    let d = index_folder(r#"{"a":"../s1.safetensors","b":"s2.safetensors"}"#);
    assert!(open_err(d.path()).contains("index names \"../s1.safetensors\", not a file name"));
    let d = index_folder(r#"[1]"#);
    assert!(open_err(d.path()).ends_with("index has no weight_map object"));
}

#[test]
fn folders_without_files_or_with_several_indexes() {
    let d = scratch();
    assert!(open_err(d.path()).ends_with(
        "the folder has no .safetensors files; pass a safetensors file or a model folder"
    ));
    let d = index_folder(r#"{"a":"s1.safetensors","b":"s2.safetensors"}"#);
    std::fs::write(d.path().join("other.safetensors.index.json"), "{}").unwrap();
    assert!(open_err(d.path()).contains("the folder has 2 index files (m.safetensors.index.json, other.safetensors.index.json); pass the one to use"));
    assert!(open_err(&d.path().join("missing.safetensors")).starts_with("reading"));
}

#[test]
fn a_truncated_file() {
    let d = scratch();
    let p = write(&d.path().join("m.safetensors"), &[("a", vec![8])]);
    let len = std::fs::metadata(&p).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(len - 4).unwrap();
    assert!(
        open_err(&p)
            .ends_with("tensor \"a\": data range [0, 16) goes beyond the data section (12 bytes)"),
        "{}",
        open_err(&p)
    );
    f.set_len(5).unwrap();
    assert!(open_err(&p).ends_with("file is 5 bytes, shorter than the 8-byte header length"));
}

#[test]
fn header_length_beyond_the_file() {
    let d = scratch();
    let p = raw(&d.path().join("m.safetensors"), b"{}", 4096, 0);
    assert_eq!(
        open_err(&p),
        format!(
            "invalid checkpoint {}: header length 4096 goes beyond the end of the file (10 bytes)",
            p.display()
        )
    );
}

#[test]
fn overlapping_tensors() {
    let d = scratch();
    let h = br#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}}"#;
    let p = raw(&d.path().join("m.safetensors"), h, h.len() as u64, 12);
    assert!(
        open_err(&p).ends_with("tensor \"b\": data range [4, 12) overlaps tensor \"a\" at [0, 8)")
    );
}

#[test]
fn a_gap_between_tensors_is_refused() {
    // Two tensors with 4 unindexed bytes between them: safetensors forbids it, although every
    // range lies inside the file.
    let d = scratch();
    let h = br#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[8],"data_offsets":[12,20]}}"#;
    let p = raw(&d.path().join("m.safetensors"), h, h.len() as u64, 20);
    let data_start = 8 + h.len();
    let e = Checkpoint::open(&p).unwrap_err();
    assert!(
        matches!(&e, SourceError::InvalidCheckpoint { file, tensor: Some(t), .. } if file == &p && t == "b")
    );
    assert_eq!(
        e.to_string(),
        format!(
            "invalid checkpoint {}: tensor \"b\": data range [12, 20) leaves a gap after tensor \"a\" at [0, 8): bytes [8, 12) of the data section (file offsets [{}, {})) belong to no tensor; safetensors requires the tensors to cover the data section exactly, without gaps",
            p.display(),
            data_start + 8,
            data_start + 12
        )
    );
    assert!(safetensors::SafeTensors::deserialize(&std::fs::read(&p).unwrap()).is_err());
}

#[test]
fn bytes_after_the_last_tensor_are_refused() {
    let d = scratch();
    let p = write(&d.path().join("m.safetensors"), &[("a", vec![4])]);
    let len = std::fs::metadata(&p).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(len + 3).unwrap();
    assert_eq!(
        open_err(&p),
        format!(
            "invalid checkpoint {}: bytes [8, 11) at the end of the 11-byte data section (file offsets [{}, {})) belong to no tensor: the last one, \"a\" at [0, 8), ends at 8; safetensors requires the tensors to cover the data section exactly, without gaps",
            p.display(),
            len,
            len + 3
        )
    );
}

#[test]
fn tensors_with_zero_elements_are_valid() {
    let d = scratch();
    let p = write(
        &d.path().join("m.safetensors"),
        &[("a", vec![3]), ("empty", vec![0, 4]), ("b", vec![2, 0]), ("c", vec![2])],
    );
    let c = Checkpoint::open(&p).unwrap();
    assert_eq!(c.slices().len(), 4);
    let empty = &c.slices()[c.find("empty").unwrap()];
    assert_eq!((empty.shape.clone(), empty.len), (vec![0, 4], 0));
    assert!(c.slices().iter().all(|s| s.is_consistent()));
    assert_eq!(c.total_bytes(), 10);
    let only = write(&d.path().join("only.safetensors"), &[("e", vec![0])]);
    assert_eq!(Checkpoint::open(&only).unwrap().total_bytes(), 0);
}

#[test]
fn unknown_dtype_shape_mismatch_and_non_utf8() {
    let d = scratch();
    let h = br#"{"a":{"dtype":"Q4","shape":[8],"data_offsets":[0,8]}}"#;
    let p = raw(&d.path().join("m.safetensors"), h, h.len() as u64, 8);
    assert!(open_err(&p).contains("tensor \"a\": unknown dtype \"Q4\""));
    let h = br#"{"a":{"dtype":"F16","shape":[8],"data_offsets":[0,8]}}"#;
    let p = raw(&d.path().join("m.safetensors"), h, h.len() as u64, 8);
    assert!(
        open_err(&p)
            .ends_with("tensor \"a\": shape [8] of F16 needs 16 bytes but data_offsets give 8")
    );
    let mut h = br#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#.to_vec();
    h[3] = 0xC3;
    h[4] = 0x28;
    let p = raw(&d.path().join("m.safetensors"), &h, h.len() as u64, 8);
    assert!(open_err(&p).ends_with("header is not UTF-8 (invalid byte at 3)"), "{}", open_err(&p));
}

#[test]
fn duplicate_names_in_a_file_and_across_files() {
    let d = scratch();
    let h = br#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
    let p = raw(&d.path().join("m.safetensors"), h, h.len() as u64, 2);
    assert!(open_err(&p).contains("duplicate tensor name \"a\""));
    let a = write(&d.path().join("a.safetensors"), &[("w", vec![2])]);
    let b = write(&d.path().join("b.safetensors"), &[("w", vec![2])]);
    let e = Checkpoint::open_files(&[a.clone(), b.clone()]).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "invalid checkpoint {}: tensor \"w\": duplicate tensor name: also in {}",
            b.display(),
            a.display()
        )
    );
}

#[test]
fn a_file_modified_during_use() {
    let d = scratch();
    let p = write(&d.path().join("m.safetensors"), &[("a", vec![8])]);
    let c = Checkpoint::open(&p).unwrap();
    c.check_unchanged().unwrap();
    // Rewrite with the same size: the modification time (or inode) changes.
    std::thread::sleep(std::time::Duration::from_millis(20));
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes).unwrap();
    let e = c.check_unchanged().unwrap_err();
    assert!(matches!(e, SourceError::CheckpointChanged { .. }));
    // The open descriptor sees the same write, with no path lookup.
    assert_eq!(c.check_open().unwrap_err().to_string(), e.to_string());
    assert_eq!(
        e.to_string(),
        format!(
            "checkpoint file {} changed while in use (modification time changed); checkpoint files must not be modified while ddo reads them: unload and reload the component (from Python: unload(), then reload(), on its offload result), which takes the file as it is now",
            p.display()
        )
    );
    // Replacing the file (a new inode) and truncation are caught too.
    let c = Checkpoint::open(&p).unwrap();
    let tmp = d.path().join("new");
    std::fs::write(&tmp, &bytes).unwrap();
    std::fs::rename(&tmp, &p).unwrap();
    assert!(c.check_unchanged().unwrap_err().to_string().contains("(the file was replaced)"));
    // The open descriptor sees that no path names its file any more.
    assert!(c.check_open().unwrap_err().to_string().contains("(the file was replaced or deleted)"));
    let c = Checkpoint::open(&p).unwrap();
    std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(9).unwrap();
    for e in [c.check_unchanged().unwrap_err(), c.check_open().unwrap_err()] {
        assert!(e.to_string().contains(&format!("(size {} -> 9)", bytes.len())), "{e}");
    }
}

#[test]
fn a_fifo_named_like_a_checkpoint_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo only creates the node.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let err = ddo_source::Checkpoint::open(&path).unwrap_err().to_string();
    assert!(err.contains("not a regular file"), "{err}");
    let err = ddo_source::Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("not a regular file"), "{err}");
}

#[test]
fn a_file_rewritten_in_place_with_its_modification_time_restored_is_noticed() {
    use std::io::{Seek, Write};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    ddo_source_test_file(&path);
    let checkpoint = ddo_source::Checkpoint::open(&path).unwrap();
    checkpoint.check_unchanged().unwrap();
    let modified = std::fs::metadata(&path).unwrap().modified().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.seek(std::io::SeekFrom::End(-1)).unwrap();
    f.write_all(&[0xAB]).unwrap();
    f.set_modified(modified).unwrap();
    drop(f);
    assert_eq!(std::fs::metadata(&path).unwrap().modified().unwrap(), modified);
    let err = checkpoint.check_unchanged().unwrap_err().to_string();
    assert!(err.contains("rewritten in place"), "{err}");
}

/// A one-tensor safetensors file.
fn ddo_source_test_file(path: &std::path::Path) {
    let header = br#"{"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[1; 8]);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn checkpoints_of_one_unchanged_file_hold_one_descriptor_of_it() {
    let d = scratch();
    let p = write(&d.path().join("m.safetensors"), &[("a", vec![8])]);
    let (a, b) = (Checkpoint::open(&p).unwrap(), Checkpoint::open(&p).unwrap());
    assert!(std::ptr::eq(a.opened(0).unwrap(), b.opened(0).unwrap()));
    // Another file at the path: a descriptor of its own.
    let tmp = d.path().join("new");
    std::fs::copy(&p, &tmp).unwrap();
    std::fs::rename(&tmp, &p).unwrap();
    let c = Checkpoint::open(&p).unwrap();
    assert!(!std::ptr::eq(a.opened(0).unwrap(), c.opened(0).unwrap()));
    c.check_open().unwrap();
    assert!(a.check_open().is_err());
}
