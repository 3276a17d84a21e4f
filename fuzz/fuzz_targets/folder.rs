//! Opening a checkpoint folder never panics or hangs: files named by the input (safetensors
//! shards, an index, anything else), with contents from the input, links to each other and to
//! missing targets. Errors are fine; a panic is a finding.
#![no_main]

use libfuzzer_sys::fuzz_target;

const NAMES: &[&str] = &[
    "a.safetensors",
    "b.safetensors",
    "model.safetensors.index.json",
    "other.safetensors.index.json",
    "config.json",
    "x",
];

fuzz_target!(|data: &[u8]| {
    let Ok(dir) = tempfile::tempdir() else { return };
    // Records: [kind, name, len, bytes...]; kind 0 = file, 1 = link to a name, 2 = folder.
    let mut rest = data;
    while rest.len() >= 3 {
        let (kind, name, len) =
            (rest[0] % 3, NAMES[rest[1] as usize % NAMES.len()], rest[2] as usize);
        let body = &rest[3..(3 + len).min(rest.len())];
        rest = &rest[(3 + len).min(rest.len())..];
        let path = dir.path().join(name);
        let _ = match kind {
            0 => std::fs::write(&path, body),
            1 => std::os::unix::fs::symlink(
                dir.path().join(NAMES[body.first().copied().unwrap_or(0) as usize % NAMES.len()]),
                &path,
            ),
            _ => std::fs::create_dir(&path),
        };
    }
    if let Ok(c) = ddo_source::Checkpoint::open(dir.path()) {
        let _ = c.check_unchanged();
        let _ = c.total_bytes();
    }
    for name in NAMES {
        let _ = ddo_source::Checkpoint::open(dir.path().join(name));
    }
});
