//! Opening a checkpoint folder never panics or hangs: files named by the input (safetensors
//! shards, an index, anything else, names that are not UTF-8), with contents from the input,
//! links to each other and to missing targets, folders, and FIFOs (which must never be opened
//! for reading: that would block). Errors are fine; a panic or a hang is a finding.
#![no_main]

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use libfuzzer_sys::fuzz_target;

const NAMES: &[&[u8]] = &[
    b"a.safetensors",
    b"b.safetensors",
    b"model.safetensors.index.json",
    b"other.safetensors.index.json",
    b"config.json",
    b"x",
    b"\xff\xfe.safetensors",
    b"model-\xc3(.safetensors",
    b"c.gguf",
];

fn name(byte: u8) -> &'static OsStr {
    OsStr::from_bytes(NAMES[byte as usize % NAMES.len()])
}

fuzz_target!(|data: &[u8]| {
    let Ok(dir) = tempfile::tempdir() else { return };
    // Records: [kind, name, len, bytes...]; kind 0 = file, 1 = link to a name, 2 = folder,
    // 3 = FIFO.
    let mut rest = data;
    while rest.len() >= 3 {
        let (kind, name_byte, len) = (rest[0] % 4, rest[1], rest[2] as usize);
        let body = &rest[3..(3 + len).min(rest.len())];
        rest = &rest[(3 + len).min(rest.len())..];
        let path = dir.path().join(name(name_byte));
        if path.symlink_metadata().is_ok() {
            // One node per name: writing into a FIFO made earlier would block the target itself.
            continue;
        }
        let _ = match kind {
            0 => std::fs::write(&path, body),
            1 => std::os::unix::fs::symlink(
                dir.path().join(name(body.first().copied().unwrap_or(0))),
                &path,
            ),
            2 => std::fs::create_dir(&path),
            _ => {
                let c = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("no NUL");
                // SAFETY: `c` is a NUL-terminated path; mkfifo only creates a file system node.
                if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            }
        };
    }
    if let Ok(c) = ddo_source::Checkpoint::open(dir.path()) {
        let _ = c.check_unchanged();
        let _ = c.total_bytes();
    }
    for &n in NAMES {
        let _ = ddo_source::Checkpoint::open(dir.path().join(OsStr::from_bytes(n)));
    }
});
