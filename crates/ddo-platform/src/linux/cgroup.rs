//! cgroup v2 memory accounting of this process, from `/proc/self/cgroup`, `/proc/self/mountinfo`
//! and the `memory.max`, `memory.high`, `memory.current` files of each level.

use std::io;
use std::path::{Path, PathBuf};

use ddo_core::CgroupMemory;

/// Every level of this process's cgroup v2 hierarchy that has a memory controller, innermost
/// first. `Ok(vec![])` when there is no cgroup v2 or no memory controller (no limit);
/// `Err((what, why))` when a file that should exist cannot be read.
pub(crate) fn memory_levels(root: &Path) -> Result<Vec<CgroupMemory>, (String, String)> {
    let cgroup_file = root.join("proc/self/cgroup");
    let text = match std::fs::read_to_string(&cgroup_file) {
        Ok(t) => t,
        // A kernel without cgroups has no such file: no cgroup limit.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(("/proc/self/cgroup".into(), e.to_string())),
    };
    // cgroup v2 is the line with hierarchy id 0 and no controllers: "0::/path".
    let Some(path) = text.lines().find_map(|l| l.strip_prefix("0::")) else {
        return Ok(Vec::new());
    };
    let Some(mount) = cgroup2_mount(root) else {
        return Ok(Vec::new());
    };
    let mut levels = Vec::new();
    let mut current = PathBuf::from(path.trim());
    loop {
        let rel = current.strip_prefix("/").unwrap_or(&current);
        let dir = mount.join(rel);
        if let Some(level) = read_level(&dir, &current.to_string_lossy())? {
            levels.push(level);
        }
        if !current.pop() || current.as_os_str().is_empty() {
            break;
        }
    }
    Ok(levels)
}

/// The cgroup2 mount point under `root`, from mountinfo; `/sys/fs/cgroup` when mountinfo is
/// missing; `None` when mountinfo shows no cgroup2 mount.
fn cgroup2_mount(root: &Path) -> Option<PathBuf> {
    let Ok(text) = std::fs::read_to_string(root.join("proc/self/mountinfo")) else {
        return Some(root.join("sys/fs/cgroup"));
    };
    text.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        if right.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let mount_point = left.split_whitespace().nth(4)?;
        Some(root.join(mount_point.trim_start_matches('/')))
    })
}

/// One level: `None` if it has no memory controller (no `memory.max`).
fn read_level(dir: &Path, name: &str) -> Result<Option<CgroupMemory>, (String, String)> {
    let read = |file: &str| std::fs::read_to_string(dir.join(file));
    let max = match read("memory.max") {
        Ok(t) => parse_limit(&t).map_err(|e| (format!("{name}/memory.max"), e))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err((format!("{name}/memory.max"), e.to_string())),
    };
    let high = match read("memory.high") {
        Ok(t) => parse_limit(&t).map_err(|e| (format!("{name}/memory.high"), e))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err((format!("{name}/memory.high"), e.to_string())),
    };
    let current = read("memory.current")
        .map_err(|e| e.to_string())
        .and_then(|t| {
            t.trim().parse::<u64>().map_err(|_| format!("unexpected value {:?}", t.trim()))
        })
        .map_err(|e| (format!("{name}/memory.current"), e))?;
    Ok(Some(CgroupMemory { path: name.to_owned(), max, high, current }))
}

fn parse_limit(text: &str) -> Result<Option<u64>, String> {
    match text.trim() {
        "max" => Ok(None),
        v => v.parse().map(Some).map_err(|_| format!("unexpected value {v:?}")),
    }
}
