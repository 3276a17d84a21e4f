//! Where host memory comes from: the process's memory mappings (`/proc/self/maps`) and whether
//! pages of a private file mapping still hold the file's bytes (`/proc/self/pagemap`).
//!
//! A framework that loads a checkpoint lazily (safetensors' mmap) leaves its tensors in a private
//! mapping of the file. Page-locking such memory makes the kernel copy every page (a private page
//! may not stay shared with the page cache once pinned): slow, and the copy doubles host memory.
//! The same bytes are in the file, which a shared read-only mapping serves and pins at full speed
//! as long as no page was written since (a written page is a private copy).

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

/// One mapping of the process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// Offset in the file of `start`.
    pub file_offset: u64,
    /// Shared (`s`) rather than private (`p`).
    pub shared: bool,
    /// The mapped file, for file-backed mappings.
    pub path: Option<PathBuf>,
    /// The file's device (`major:minor` as the kernel encodes it in `st_dev`) and inode.
    pub file: Option<(u64, u64)>,
}

/// The process's mappings, in address order, parsed from `text` (`/proc/self/maps`).
pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines().filter_map(parse_line).collect()
}

/// One line: five space-separated fields, then (after padding) the path, whose own spaces are
/// kept as they are.
fn parse_line(line: &str) -> Option<Mapping> {
    let mut rest = line;
    let mut field = || {
        let r = rest.trim_start_matches(' ');
        let end = r.find(' ').unwrap_or(r.len());
        let (f, tail) = r.split_at(end);
        rest = tail;
        Some(f).filter(|f| !f.is_empty())
    };
    let (range, perms, offset, dev, inode) = (field()?, field()?, field()?, field()?, field()?);
    let path = rest.strip_prefix(' ').unwrap_or(rest).trim_start_matches(' ');
    let (start, end) = range.split_once('-')?;
    let (major, minor) = dev.split_once(':')?;
    let inode: u64 = inode.parse().ok()?;
    let file = inode != 0 && path.starts_with('/') && !path.ends_with(" (deleted)");
    let (major, minor) =
        (u64::from_str_radix(major, 16).ok()?, u64::from_str_radix(minor, 16).ok()?);
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        file_offset: u64::from_str_radix(offset, 16).ok()?,
        shared: perms.as_bytes().get(3) == Some(&b's'),
        path: file.then(|| PathBuf::from(path)),
        // The kernel's new_encode_dev, as stat reports st_dev.
        file: file.then_some(((minor & 0xff) | (major << 8) | ((minor & !0xff) << 12), inode)),
    })
}

/// The process's mappings now.
pub fn process_maps() -> std::io::Result<Vec<Mapping>> {
    Ok(parse_maps(&std::fs::read_to_string("/proc/self/maps")?))
}

/// The private file mapping holding `[address, address + len)` entirely, if there is one.
pub fn private_file_mapping(maps: &[Mapping], address: u64, len: u64) -> Option<&Mapping> {
    let end = address.checked_add(len)?;
    maps.iter()
        .find(|m| m.start <= address && end <= m.end)
        .filter(|m| !m.shared && m.path.is_some())
}

/// Whether any part of `[address, address + len)` lies in a private file mapping.
pub fn touches_private_file_mapping(maps: &[Mapping], address: u64, len: u64) -> bool {
    let end = address.saturating_add(len.max(1));
    maps.iter().any(|m| m.start < end && address < m.end && !m.shared && m.path.is_some())
}

const PAGE: u64 = 4096;
/// Pagemap bits: the page is present; it is a file page or a shared anonymous page.
const PRESENT: u64 = 1 << 63;
const SWAPPED: u64 = 1 << 62;
const FILE_PAGE: u64 = 1 << 61;

/// Whether every page of `[address, address + len)` of a private file mapping still is the
/// file's page (never written: absent, or present as a page-cache page). Unreadable pagemap
/// entries count as written.
pub fn private_pages_unwritten(address: u64, len: u64) -> bool {
    let first = address / PAGE;
    let last = (address + len.max(1) - 1) / PAGE;
    let Ok(mut f) = std::fs::File::open("/proc/self/pagemap") else { return false };
    if f.seek(SeekFrom::Start(first * 8)).is_err() {
        return false;
    }
    let mut buf = vec![0u8; 8 * 4096];
    let mut left = last - first + 1;
    while left > 0 {
        let n = left.min(4096) as usize;
        if f.read_exact(&mut buf[..n * 8]).is_err() {
            return false;
        }
        for e in buf[..n * 8].chunks_exact(8) {
            let e = u64::from_le_bytes(e.try_into().expect("8 bytes"));
            // A private copy, present or swapped out, is not the file's page.
            if (e & PRESENT != 0 && e & FILE_PAGE == 0) || e & SWAPPED != 0 {
                return false;
            }
        }
        left -= n as u64;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines() {
        let text = "\
7fc6f6000000-7fc948ee7000 rw-p 00001000 fe:00 5308721    /m/a  b.safetensors
7fcb90800000-7fcb96268000 r--s 00000000 fe:00 5308755    /m/c.safetensors
7fcb96268000-7fcb96300000 rw-p 00000000 00:00 0 
7fff00000000-7fff00001000 rw-p 00000000 00:00 0          [stack]
";
        let m = parse_maps(text);
        assert_eq!(m.len(), 4);
        assert_eq!(m[0].path.as_deref(), Some(std::path::Path::new("/m/a  b.safetensors")));
        assert_eq!(m[0].file, Some((0xfe00, 5308721)));
        assert_eq!((m[0].file_offset, m[0].shared), (0x1000, false));
        assert!(m[1].shared);
        assert_eq!(m[2].path, None);
        assert_eq!(m[3].path, None);
        assert!(private_file_mapping(&m, 0x7fc6f6000010, 16).is_some());
        assert!(private_file_mapping(&m, 0x7fcb90800000, 16).is_none(), "shared");
        assert!(private_file_mapping(&m, 0x7fcb96268000, 16).is_none(), "anonymous");
        assert!(private_file_mapping(&m, 0x7fc948ee6ff0, 32).is_none(), "crosses the end");
    }

    #[test]
    fn written_private_pages_are_told_apart_from_file_pages() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::File::create(&path).unwrap().write_all(&vec![7u8; 4 * 4096]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: the test's file is not modified while mapped; the mapping is private.
        let mut map = unsafe { memmap2::MmapOptions::new().map_copy(&file) }.unwrap();
        let base = map.as_ptr() as u64;
        assert_eq!(std::hint::black_box(map[4096]), 7, "read: still the file's page");
        let maps = process_maps().unwrap();
        let m = private_file_mapping(&maps, base, 4 * 4096).expect("a private file mapping");
        assert_eq!(m.path.as_deref(), Some(path.as_path()));
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(
            m.file,
            Some((meta.dev(), meta.ino())),
            "the maps line names the file stat sees"
        );
        assert!(touches_private_file_mapping(&maps, base + 4 * 4096 - 8, 64));
        assert!(private_pages_unwritten(base, 4 * 4096));
        map[2 * 4096] = 1;
        assert!(!private_pages_unwritten(base, 4 * 4096), "a written page is a private copy");
        assert!(private_pages_unwritten(base, 2 * 4096), "the pages before it are not");
    }
}
