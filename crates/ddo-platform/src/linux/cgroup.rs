//! cgroup memory accounting of this process, from `/proc/self/cgroup`, `/proc/self/mountinfo`
//! and each level's memory files: cgroup v2 (`memory.max`, `memory.high`, `memory.current`,
//! `memory.stat`) or, on a host whose memory controller sits in a v1 hierarchy,
//! `memory.limit_in_bytes`, `memory.usage_in_bytes` and `memory.stat`.

use std::io;
use std::path::{Path, PathBuf};

use ddo_core::CgroupMemory;

/// A v1 limit at or above this is the kernel's "no limit" (`PAGE_COUNTER_MAX` pages).
const V1_UNLIMITED: u64 = 1 << 62;

#[derive(Clone, Copy)]
enum Version {
    V2,
    V1,
}

/// Every level of this process's cgroup hierarchy that has a memory controller, innermost
/// first: the v2 levels, or the v1 memory hierarchy's when v2 has none. `Ok(vec![])` when no
/// hierarchy has a memory controller (no limit); `Err((what, why))` when a file that should
/// exist cannot be read.
pub(crate) fn memory_levels(root: &Path) -> Result<Vec<CgroupMemory>, (String, String)> {
    let cgroup_file = root.join("proc/self/cgroup");
    let text = match std::fs::read_to_string(&cgroup_file) {
        Ok(t) => t,
        // A kernel without cgroups has no such file: no cgroup limit.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(("/proc/self/cgroup".into(), e.to_string())),
    };
    let mounts = std::fs::read_to_string(root.join("proc/self/mountinfo")).ok();
    // cgroup v2 is the line with hierarchy id 0 and no controllers: "0::/path".
    if let Some(path) = text.lines().find_map(|l| l.strip_prefix("0::")) {
        let mount = match &mounts {
            // Without mountinfo the v2 hierarchy is where systemd mounts it.
            None => Some(Mount { point: root.join("sys/fs/cgroup"), root: "/".into() }),
            Some(m) => find_mount(root, m, |fs, _| fs == "cgroup2"),
        };
        if let Some(mount) = mount {
            let levels = walk(&mount, path.trim(), Version::V2)?;
            if !levels.is_empty() {
                return Ok(levels);
            }
        }
    }
    // cgroup v1: "id:controllers:/path" with "memory" among the controllers.
    let v1_path = text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == "memory").then_some(path)
    });
    let (Some(path), Some(mounts)) = (v1_path, &mounts) else {
        return Ok(Vec::new());
    };
    let Some(mount) = find_mount(root, mounts, |fs, options| {
        fs == "cgroup" && options.split(',').any(|o| o == "memory")
    }) else {
        return Ok(Vec::new());
    };
    walk(&mount, path.trim(), Version::V1)
}

/// A mounted hierarchy: where it is mounted, and which cgroup path its mount point shows.
struct Mount {
    point: PathBuf,
    root: String,
}

/// The first mountinfo entry whose file system type and super options `accept`.
fn find_mount(root: &Path, mountinfo: &str, accept: impl Fn(&str, &str) -> bool) -> Option<Mount> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mut right = right.split_whitespace();
        let (fs, _source, options) = (right.next()?, right.next()?, right.next().unwrap_or(""));
        if !accept(fs, options) {
            return None;
        }
        let mut left = left.split_whitespace();
        let mount_root = left.nth(3)?;
        let point = left.next()?;
        Some(Mount { point: root.join(point.trim_start_matches('/')), root: mount_root.to_owned() })
    })
}

/// The levels from `path` up to the mount's root, innermost first.
fn walk(
    mount: &Mount,
    path: &str,
    version: Version,
) -> Result<Vec<CgroupMemory>, (String, String)> {
    let mut levels = Vec::new();
    let mut current = PathBuf::from(path);
    let top = PathBuf::from(&mount.root);
    // A namespaced mount shows its root's subtree: paths are relative to that root.
    while let Ok(rel) = current.strip_prefix(&top) {
        let dir = mount.point.join(rel);
        let name = current.to_string_lossy().into_owned();
        let level = match version {
            Version::V2 => read_v2(&dir, &name)?,
            Version::V1 => read_v1(&dir, &name)?,
        };
        levels.extend(level);
        if current == top || !current.pop() || current.as_os_str().is_empty() {
            break;
        }
    }
    Ok(levels)
}

/// One v2 level: `None` if it has no memory controller (no `memory.max`).
fn read_v2(dir: &Path, name: &str) -> Result<Option<CgroupMemory>, (String, String)> {
    let Some(max) = read_optional(dir, name, "memory.max")? else {
        return Ok(None);
    };
    let max = parse_limit(&max).map_err(|e| (format!("{name}/memory.max"), e))?;
    let high = match read_optional(dir, name, "memory.high")? {
        Some(t) => parse_limit(&t).map_err(|e| (format!("{name}/memory.high"), e))?,
        None => None,
    };
    let current = read_u64(dir, name, "memory.current")?;
    let reclaimable = stat_field(dir, name, "inactive_file")?;
    Ok(Some(CgroupMemory { path: name.to_owned(), max, high, current, reclaimable }))
}

/// One v1 level of the memory hierarchy: `None` if the directory has no memory files.
fn read_v1(dir: &Path, name: &str) -> Result<Option<CgroupMemory>, (String, String)> {
    let Some(limit) = read_optional(dir, name, "memory.limit_in_bytes")? else {
        return Ok(None);
    };
    let limit = parse_u64(&limit).map_err(|e| (format!("{name}/memory.limit_in_bytes"), e))?;
    let max = (limit < V1_UNLIMITED).then_some(limit);
    let current = read_u64(dir, name, "memory.usage_in_bytes")?;
    let reclaimable = stat_field(dir, name, "inactive_file")?;
    Ok(Some(CgroupMemory { path: name.to_owned(), max, high: None, current, reclaimable }))
}

fn read_optional(dir: &Path, name: &str, file: &str) -> Result<Option<String>, (String, String)> {
    match std::fs::read_to_string(dir.join(file)) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err((format!("{name}/{file}"), e.to_string())),
    }
}

fn read_u64(dir: &Path, name: &str, file: &str) -> Result<u64, (String, String)> {
    std::fs::read_to_string(dir.join(file))
        .map_err(|e| e.to_string())
        .and_then(|t| parse_u64(&t))
        .map_err(|e| (format!("{name}/{file}"), e))
}

/// A field of `memory.stat`; 0 when the file or the field is missing (nothing known to be
/// reclaimable).
fn stat_field(dir: &Path, name: &str, field: &str) -> Result<u64, (String, String)> {
    let Some(text) = read_optional(dir, name, "memory.stat")? else {
        return Ok(0);
    };
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0))
}

fn parse_u64(text: &str) -> Result<u64, String> {
    text.trim().parse().map_err(|_| format!("unexpected value {:?}", text.trim()))
}

fn parse_limit(text: &str) -> Result<Option<u64>, String> {
    match text.trim() {
        "max" => Ok(None),
        v => parse_u64(v).map(Some),
    }
}
