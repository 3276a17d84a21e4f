//! Parsers of the `/proc` files the probe reads. Each returns `Err(reason)` on malformed input.

use std::collections::HashMap;

use ddo_core::{KIB, OvercommitMode};

/// `/proc/meminfo` as `field -> bytes` (values given in kB are converted).
pub(crate) fn parse_meminfo(text: &str) -> HashMap<String, u64> {
    text.lines()
        .filter_map(|line| {
            let (key, rest) = line.split_once(':')?;
            let mut parts = rest.split_whitespace();
            let value: u64 = parts.next()?.parse().ok()?;
            let bytes = match parts.next() {
                Some("kB") => value.checked_mul(KIB)?,
                _ => value,
            };
            Some((key.trim().to_owned(), bytes))
        })
        .collect()
}

/// `/proc/sys/vm/overcommit_memory`.
pub(crate) fn parse_overcommit(text: &str) -> Result<OvercommitMode, String> {
    match text.trim() {
        "0" => Ok(OvercommitMode::Heuristic),
        "1" => Ok(OvercommitMode::Always),
        "2" => Ok(OvercommitMode::Strict),
        other => Err(format!("unexpected value {other:?}")),
    }
}

/// The fields of `/proc/self/status` the probe uses.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Status {
    pub(crate) vm_size: Option<u64>,
    pub(crate) vm_rss: Option<u64>,
    pub(crate) vm_hwm: Option<u64>,
    pub(crate) vm_lck: Option<u64>,
    pub(crate) cap_eff: Option<u64>,
}

impl Status {
    /// Whether the effective capabilities include CAP_IPC_LOCK (bit 14), which lifts
    /// RLIMIT_MEMLOCK.
    pub(crate) fn can_lock_without_limit(&self) -> bool {
        self.cap_eff.is_some_and(|caps| caps & (1 << 14) != 0)
    }
}

pub(crate) fn parse_status(text: &str) -> Status {
    let fields = parse_meminfo(text);
    let cap_eff = text.lines().find_map(|l| {
        let v = l.strip_prefix("CapEff:")?;
        u64::from_str_radix(v.trim(), 16).ok()
    });
    Status {
        vm_size: fields.get("VmSize").copied(),
        vm_rss: fields.get("VmRSS").copied(),
        vm_hwm: fields.get("VmHWM").copied(),
        vm_lck: fields.get("VmLck").copied(),
        cap_eff,
    }
}

/// Soft limits from `/proc/self/limits`: `None` = unlimited.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub(crate) address_space: Option<u64>,
    pub(crate) locked_memory: Option<u64>,
}

pub(crate) fn parse_limits(text: &str) -> Result<Limits, String> {
    let soft = |name: &str| -> Result<Option<u64>, String> {
        let line = text
            .lines()
            .find(|l| l.starts_with(name))
            .ok_or_else(|| format!("no {name:?} line"))?;
        let value = line[name.len()..]
            .split_whitespace()
            .next()
            .ok_or_else(|| format!("{name:?} has no soft limit"))?;
        match value {
            "unlimited" => Ok(None),
            v => v
                .parse()
                .map(Some)
                .map_err(|_| format!("{name:?} soft limit {v:?} is not a number")),
        }
    };
    Ok(Limits {
        address_space: soft("Max address space")?,
        locked_memory: soft("Max locked memory")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_files() {
        let m = parse_meminfo(
            "MemTotal:       16384 kB\nMemAvailable:    8192 kB\nHugePages_Total:       0\n",
        );
        assert_eq!(m["MemAvailable"], 8192 * 1024);
        assert_eq!(m["HugePages_Total"], 0);
        assert_eq!(parse_overcommit("2\n"), Ok(OvercommitMode::Strict));
        assert!(parse_overcommit("7").is_err());
        let s = parse_status("VmSize:\t  100 kB\nVmLck:\t 4 kB\nCapEff:\t0000000000004000\n");
        assert_eq!(s.vm_size, Some(102400));
        assert!(s.can_lock_without_limit());
        assert!(!parse_status("CapEff:\t0000000000000000\n").can_lock_without_limit());
        let l = parse_limits(
            "Limit                     Soft Limit           Hard Limit           Units\nMax address space         unlimited            unlimited            bytes\nMax locked memory         8388608              8388608              bytes\n",
        )
        .unwrap();
        assert_eq!(l, Limits { address_space: None, locked_memory: Some(8388608) });
        assert!(
            parse_limits("Max address space  x  y bytes\nMax locked memory 1 1 bytes").is_err()
        );
    }
}
