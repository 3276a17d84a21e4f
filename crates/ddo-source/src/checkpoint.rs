//! Checkpoints: one or more safetensors files, validated and turned into immutable tensor slices.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ddo_core::{CheckpointFileId, FileIdentity, SourceError, TensorSlice};

use crate::header::{MAX_HEADER_LEN, header_len, parse_header};
use crate::shared::Registry;

/// One file of a checkpoint, with the identity recorded when it was opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointFile {
    /// The file's path.
    pub path: PathBuf,
    /// Its identity at open.
    pub identity: FileIdentity,
    /// Absolute offset of its data section.
    pub data_start: u64,
}

/// A validated checkpoint: its files (safetensors, or GGUF) and every tensor's immutable slice.
///
/// Every tensor name is unique across the files, no two ranges overlap, a safetensors file's
/// ranges cover its data section exactly (no gap, nothing after the last tensor; a GGUF file's
/// are aligned and may leave padding), and each length equals the shape's bytes. Opening reads
/// only headers.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    files: Vec<CheckpointFile>,
    // The files as opened (the identities were taken from these descriptors): their status is
    // checked without a path lookup, and mappings are made of them. Shared per process with
    // every checkpoint that opened the same unchanged file.
    open: Vec<Arc<File>>,
    slices: Vec<TensorSlice>,
    by_name: HashMap<String, usize>,
}

fn invalid(path: &Path, tensor: Option<&str>, reason: impl Into<String>) -> SourceError {
    SourceError::InvalidCheckpoint {
        file: path.to_owned(),
        tensor: tensor.map(str::to_owned),
        reason: reason.into(),
    }
}

fn io(path: &Path, source: std::io::Error) -> SourceError {
    SourceError::Io { file: path.to_owned(), source }
}

/// The identity of the file at `path` now.
pub fn file_identity(path: &Path) -> Result<FileIdentity, std::io::Error> {
    identity_of(&std::fs::metadata(path)?)
}

fn identity_of(m: &std::fs::Metadata) -> Result<FileIdentity, std::io::Error> {
    Ok(FileIdentity {
        device: m.dev(),
        inode: m.ino(),
        size: m.len(),
        mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        ctime_ns: i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec()),
    })
}

/// The process's descriptor of the file `file` reads: one opened earlier for the same unchanged
/// file when a checkpoint still holds it (sessions of one checkpoint on several GPUs hold one
/// descriptor per file between them), else `file`.
fn shared_descriptor(file: File, identity: FileIdentity) -> Arc<File> {
    static OPEN: Registry<FileIdentity, File> = Registry::new();
    OPEN.get_or_make(identity, |_| true, || Ok::<_, std::convert::Infallible>(file))
        .unwrap_or_else(|never| match never {})
}

/// Refuses anything but a regular file (following links) without opening it.
fn regular_file(path: &Path) -> Result<(), SourceError> {
    let meta = std::fs::metadata(path).map_err(|e| io(path, e))?;
    if meta.is_file() {
        Ok(())
    } else {
        Err(invalid(
            path,
            None,
            "not a regular file (a FIFO, device or folder cannot be a checkpoint)",
        ))
    }
}

impl Checkpoint {
    /// Opens a safetensors file, an index (`*.json`), or a directory: with exactly one
    /// `*.safetensors.index.json`
    /// the files it names, otherwise every `*.safetensors` file in it (a Diffusers model folder
    /// or its `transformer/` subfolder). Variant files (`model.fp16.safetensors`) are skipped
    /// when files without a variant are there, as Diffusers and transformers load them.
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint, SourceError> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| io(path, e))?;
        if !meta.is_dir() {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if name.ends_with(".json") {
                return Checkpoint::open_index(path);
            }
            return Checkpoint::open_files(&[path]);
        }
        let mut indexes = Vec::new();
        let mut shards = Vec::new();
        for entry in std::fs::read_dir(path).map_err(|e| io(path, e))? {
            let p = entry.map_err(|e| io(path, e))?.path();
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if name.ends_with(".safetensors.index.json") {
                indexes.push(p);
            } else if name.ends_with(".safetensors") {
                shards.push(p);
            }
        }
        indexes.sort();
        shards.sort();
        match indexes.as_slice() {
            [index] => Checkpoint::open_index(index),
            [] if shards.is_empty() => Err(invalid(
                path,
                None,
                "the folder has no .safetensors files; pass a safetensors file or a model folder",
            )),
            [] => Checkpoint::open_files(&without_variants(path, shards)?),
            many => Err(invalid(
                path,
                None,
                format!(
                    "the folder has {} index files ({}); pass the one to use",
                    many.len(),
                    many.iter()
                        .filter_map(|p| p.file_name()?.to_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
        }
    }

    /// Opens a sharded checkpoint through its `*.safetensors.index.json`; every index entry must
    /// name an existing file that holds the tensor, and every tensor of those files must be in
    /// the index.
    pub fn open_index(index: impl AsRef<Path>) -> Result<Checkpoint, SourceError> {
        let index = index.as_ref();
        regular_file(index)?;
        let text = std::fs::read_to_string(index).map_err(|e| io(index, e))?;
        let weight_map = parse_index(&text, index)?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut files: Vec<&str> = weight_map.values().map(String::as_str).collect();
        files.sort();
        files.dedup();
        let mut paths = Vec::with_capacity(files.len());
        for f in &files {
            if Path::new(f).components().count() != 1 {
                return Err(invalid(index, None, format!("index names {f:?}, not a file name")));
            }
            let p = dir.join(f);
            if !p.is_file() {
                let tensor = weight_map.iter().find(|(_, v)| v == f).map(|(k, _)| k.as_str());
                return Err(invalid(index, tensor, format!("index points to missing file {f:?}")));
            }
            paths.push(p);
        }
        let checkpoint = Checkpoint::open_files(&paths)?;
        for (tensor, file) in &weight_map {
            let found = checkpoint.by_name.get(tensor).map(|&i| &checkpoint.slices[i]);
            match found {
                Some(s) if s.path.file_name().and_then(|n| n.to_str()) == Some(file.as_str()) => {}
                Some(s) => {
                    return Err(invalid(
                        index,
                        Some(tensor),
                        format!("index maps it to {file:?} but it is in {}", s.path.display()),
                    ));
                }
                None => {
                    return Err(invalid(
                        index,
                        Some(tensor),
                        format!("index maps it to {file:?}, which has no such tensor"),
                    ));
                }
            }
        }
        if let Some(s) = checkpoint.slices.iter().find(|s| !weight_map.contains_key(&s.name)) {
            return Err(invalid(
                &s.path,
                Some(&s.name),
                format!("tensor is missing from the index {}", index.display()),
            ));
        }
        Ok(checkpoint)
    }

    /// Opens the given safetensors files as one checkpoint.
    pub fn open_files<P: AsRef<Path>>(paths: &[P]) -> Result<Checkpoint, SourceError> {
        let mut files = Vec::with_capacity(paths.len());
        let mut open = Vec::with_capacity(paths.len());
        let mut slices = Vec::new();
        let mut by_name: HashMap<String, usize> = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let path = path.as_ref();
            // Checked before opening: opening a FIFO or a device could block forever.
            regular_file(path)?;
            let mut file = File::open(path).map_err(|e| io(path, e))?;
            let meta = file.metadata().map_err(|e| io(path, e))?;
            if !meta.is_file() {
                return Err(invalid(path, None, "not a regular file"));
            }
            let identity = identity_of(&meta).map_err(|e| io(path, e))?;
            let mut prefix = [0u8; 8];
            let got = read_up_to(&mut file, &mut prefix).map_err(|e| io(path, e))?;
            let is_gguf = prefix[..got].starts_with(&crate::gguf::GGUF_MAGIC);
            if !is_gguf && path.extension().is_some_and(|e| e == "gguf") {
                return Err(invalid(
                    path,
                    None,
                    "not a GGUF file (it does not start with \"GGUF\")",
                ));
            }
            let header = if is_gguf {
                gguf_header(&mut file, identity.size, path)?
            } else {
                let n = header_len(&prefix[..got], identity.size, path)?;
                debug_assert!(n <= MAX_HEADER_LEN);
                let mut bytes = prefix.to_vec();
                bytes.resize(8 + n as usize, 0);
                file.read_exact(&mut bytes[8..]).map_err(|e| io(path, e))?;
                parse_header(&bytes, identity.size, path)?
            };
            let id = CheckpointFileId(u32::try_from(i).expect("fewer than 2^32 files"));
            for e in header.entries {
                if let Some(&other) = by_name.get(&e.name) {
                    let first: &TensorSlice = &slices[other];
                    return Err(invalid(
                        path,
                        Some(&e.name),
                        format!("duplicate tensor name: also in {}", first.path.display()),
                    ));
                }
                by_name.insert(e.name.clone(), slices.len());
                slices.push(TensorSlice {
                    name: e.name,
                    dtype: e.dtype,
                    shape: e.shape,
                    file: id,
                    path: path.to_owned(),
                    offset: e.offset,
                    len: e.len,
                });
            }
            files.push(CheckpointFile {
                path: path.to_owned(),
                identity,
                data_start: header.data_start,
            });
            open.push(shared_descriptor(file, identity));
        }
        Ok(Checkpoint { files, open, slices, by_name })
    }

    /// The files.
    pub fn files(&self) -> &[CheckpointFile] {
        &self.files
    }

    /// File `index` as opened: the file its identity was taken from, whatever its path names
    /// by now.
    pub fn opened(&self, index: usize) -> Option<&File> {
        self.open.get(index).map(|f| &**f)
    }

    /// Every tensor, file by file in offset order.
    pub fn slices(&self) -> &[TensorSlice] {
        &self.slices
    }

    /// The index of the tensor called `name`.
    pub fn find(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// Bytes of all tensors.
    pub fn total_bytes(&self) -> u64 {
        self.slices.iter().map(|s| s.len).sum()
    }

    /// Checks every file's identity against the one recorded at open.
    pub fn check_unchanged(&self) -> Result<(), SourceError> {
        for f in &self.files {
            let now = file_identity(&f.path)
                .map_err(|e| Self::changed(f, format!("it cannot be read: {e}")))?;
            Self::compare(f, now)?;
        }
        Ok(())
    }

    /// Checks every file's status on the descriptors held since it was opened, without a path
    /// lookup: a file written, truncated or extended in place is noticed, and so is one no path
    /// names any more (another file renamed over it, or deleted). Whether the path still names
    /// this file is [`check_unchanged`](Self::check_unchanged)'s to say.
    pub fn check_open(&self) -> Result<(), SourceError> {
        for (f, file) in self.files.iter().zip(self.open.iter()) {
            let m =
                file.metadata().map_err(|e| Self::changed(f, format!("it cannot be read: {e}")))?;
            if m.nlink() == 0 {
                return Err(Self::changed(f, "the file was replaced or deleted".into()));
            }
            let now =
                identity_of(&m).map_err(|e| Self::changed(f, format!("it cannot be read: {e}")))?;
            Self::compare(f, now)?;
        }
        Ok(())
    }

    fn changed(f: &CheckpointFile, what: String) -> SourceError {
        SourceError::CheckpointChanged { file: f.path.clone(), what }
    }

    fn compare(f: &CheckpointFile, now: FileIdentity) -> Result<(), SourceError> {
        let was = f.identity;
        if now.device != was.device || now.inode != was.inode {
            return Err(Self::changed(f, "the file was replaced".into()));
        }
        if now.size != was.size {
            return Err(Self::changed(f, format!("size {} -> {}", was.size, now.size)));
        }
        if now.mtime_ns != was.mtime_ns {
            return Err(Self::changed(f, "modification time changed".into()));
        }
        if now.ctime_ns != was.ctime_ns {
            return Err(Self::changed(
                f,
                "status-change time changed (rewritten in place, or its links or permissions changed)"
                    .into(),
            ));
        }
        Ok(())
    }
}

fn read_up_to(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read(&mut buf[got..])? {
            0 => break,
            n => got += n,
        }
    }
    Ok(got)
}

/// A GGUF file's header as a checkpoint header: read in growing pieces (the header's length is
/// known only once it is parsed), up to [`MAX_HEADER_LEN`] bytes.
fn gguf_header(file: &mut File, file_len: u64, path: &Path) -> Result<crate::Header, SourceError> {
    use std::io::{Seek, SeekFrom};
    let mut want = (4u64 << 20).min(file_len);
    loop {
        let mut bytes = vec![0u8; want as usize];
        file.seek(SeekFrom::Start(0)).map_err(|e| io(path, e))?;
        file.read_exact(&mut bytes).map_err(|e| io(path, e))?;
        match crate::gguf::parse_gguf(&bytes, file_len, path) {
            Ok(h) => return Ok(crate::Header { entries: h.entries, data_start: h.data_start }),
            Err(e) if want >= file_len.min(MAX_HEADER_LEN) => return Err(e),
            Err(_) => want = (want * 4).min(file_len).min(MAX_HEADER_LEN),
        }
    }
}

/// The variant of a checkpoint file: `fp16` for `model.fp16.safetensors` or
/// `model.fp16-00001-of-00002.safetensors`; `None` for `model.safetensors`.
fn variant_of(file: &Path) -> Option<String> {
    let digits = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_digit());
    let mut stem = file.file_name()?.to_str()?.strip_suffix(".safetensors")?;
    if let Some((head, total)) = stem.rsplit_once("-of-")
        && let Some((base, index)) = head.rsplit_once('-')
        && digits(total)
        && digits(index)
    {
        stem = base;
    }
    stem.rsplit_once('.').map(|(_, variant)| variant.to_owned())
}

/// `files` without variant files when files without a variant are among them; one variant's
/// files when only that variant is; several variants alone are refused.
fn without_variants(folder: &Path, files: Vec<PathBuf>) -> Result<Vec<PathBuf>, SourceError> {
    let (plain, variants): (Vec<PathBuf>, Vec<PathBuf>) =
        files.into_iter().partition(|f| variant_of(f).is_none());
    if !plain.is_empty() {
        return Ok(plain);
    }
    let mut names: Vec<String> = variants.iter().filter_map(|f| variant_of(f)).collect();
    names.sort();
    names.dedup();
    if names.len() > 1 {
        return Err(invalid(
            folder,
            None,
            format!("the folder holds variants {}; pass the file(s) of one", names.join(", ")),
        ));
    }
    Ok(variants)
}

/// Parses a `*.safetensors.index.json`: its `weight_map` of tensor name to file name.
pub fn parse_index(text: &str, path: &Path) -> Result<BTreeMap<String, String>, SourceError> {
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| invalid(path, None, format!("index is not valid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| invalid(path, None, "index has no weight_map object"))?;
    map.iter()
        .map(|(k, v)| match v.as_str() {
            Some(f) => Ok((k.clone(), f.to_owned())),
            None => Err(invalid(path, Some(k), "weight_map value is not a file name")),
        })
        .collect()
}
