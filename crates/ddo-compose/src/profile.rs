//! The machine's measured speeds (the host-to-device link, the device's decoding), measured
//! once and cached per machine in a small JSON file, measured again when stale or when the
//! machine's key (its device, driver and host) changed.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use ddo_session::{ExecutionDevice, SessionError};

use crate::Machine;

/// A cached profile older than this is measured again.
pub const PROFILE_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);

/// The speeds of one machine, as measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MachineProfile {
    /// What identifies the machine (the host names its device, driver and host).
    pub key: String,
    /// Host-to-device bytes per second (`None`: the host backend, or the probe failed).
    pub link_bytes_per_second: Option<f64>,
    /// Bytes of bf16 the device decodes per second (`None`: it cannot decode).
    pub decode_bytes_per_second: Option<f64>,
    /// When it was measured, seconds since the Unix epoch.
    pub measured_at: u64,
    /// Whether it came from the cache file.
    #[serde(default)]
    pub cached: bool,
}

impl MachineProfile {
    /// Measures `device` now: its link and its decoding, each `None` where it fails.
    pub fn measure(device: ExecutionDevice, key: &str) -> Result<MachineProfile, SessionError> {
        let machine = Machine::open(device, crate::host_admission(None))?;
        let target = machine.target();
        let decode = match device {
            ExecutionDevice::Cuda(_) => ddo_session::measure_decode_rate(&target.platform).ok(),
            ExecutionDevice::Host => None,
        };
        Ok(MachineProfile {
            key: key.to_owned(),
            link_bytes_per_second: target.link_bytes_per_second,
            decode_bytes_per_second: decode,
            measured_at: now(),
            cached: false,
        })
    }

    /// The profile cached at `file` for `key` when fresh, else measured and written there (a
    /// cache that cannot be written is left as it is: the measurement stands).
    pub fn cached_or_measured(
        device: ExecutionDevice,
        key: &str,
        file: &Path,
        refresh: bool,
    ) -> Result<MachineProfile, SessionError> {
        if let Some(profile) = read_fresh(file, key, now()).filter(|_| !refresh) {
            return Ok(profile);
        }
        let profile = Self::measure(device, key)?;
        let _ = write(file, &profile);
        Ok(profile)
    }
}

/// ddo's cache folder as this process's environment names it
/// ([`ddo_policy::encoded_cache::ddo_cache_dir`]).
pub fn cache_dir() -> Option<std::path::PathBuf> {
    ddo_policy::encoded_cache::ddo_cache_dir(|v| std::env::var(v).ok())
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The profile in `file` when it is a regular file of this `key` measured less than
/// [`PROFILE_MAX_AGE`] before `now`.
fn read_fresh(file: &Path, key: &str, now: u64) -> Option<MachineProfile> {
    if !std::fs::symlink_metadata(file).ok()?.is_file() {
        return None;
    }
    let mut profile: MachineProfile = serde_json::from_slice(&std::fs::read(file).ok()?).ok()?;
    let fresh = now.saturating_sub(profile.measured_at) < PROFILE_MAX_AGE.as_secs();
    let usable = |v: Option<f64>| v.is_none_or(|v| v.is_finite() && v > 0.0);
    (profile.key == key
        && fresh
        && profile.measured_at <= now
        && usable(profile.link_bytes_per_second)
        && usable(profile.decode_bytes_per_second))
    .then(|| {
        profile.cached = true;
        profile
    })
}

/// Writes `profile` to `file` through a temporary file renamed over it.
fn write(file: &Path, profile: &MachineProfile) -> std::io::Result<()> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = file.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, serde_json::to_vec_pretty(profile).map_err(std::io::Error::other)?)?;
    std::fs::rename(&tmp, file).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_profile_is_measured_once_then_read_until_stale_or_the_machine_changes() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("machine.json");
        let first =
            MachineProfile::cached_or_measured(ExecutionDevice::Host, "host-a", &file, false)
                .unwrap();
        assert!(!first.cached);
        let again =
            MachineProfile::cached_or_measured(ExecutionDevice::Host, "host-a", &file, false)
                .unwrap();
        assert!(again.cached);
        assert_eq!(again.measured_at, first.measured_at);
        // Another machine's key, a refresh, or an old measurement: measured again.
        assert!(
            !MachineProfile::cached_or_measured(ExecutionDevice::Host, "host-b", &file, false)
                .unwrap()
                .cached
        );
        assert!(
            !MachineProfile::cached_or_measured(ExecutionDevice::Host, "host-b", &file, true)
                .unwrap()
                .cached
        );
        let stale = now() + PROFILE_MAX_AGE.as_secs() + 1;
        assert!(read_fresh(&file, "host-b", stale).is_none());
        assert!(read_fresh(&file, "host-b", now()).is_some());
    }

    #[test]
    fn a_corrupt_or_hostile_cache_is_measured_over() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("machine.json");
        std::fs::write(&file, b"{not json").unwrap();
        assert!(read_fresh(&file, "k", now()).is_none());
        let bad = format!(
            r#"{{"key":"k","link_bytes_per_second":-1.0,"decode_bytes_per_second":null,"measured_at":{}}}"#,
            now()
        );
        std::fs::write(&file, bad).unwrap();
        assert!(read_fresh(&file, "k", now()).is_none(), "a negative speed is not used");
        std::fs::remove_file(&file).unwrap();
        std::fs::create_dir(&file).unwrap();
        assert!(read_fresh(&file, "k", now()).is_none(), "a folder is not a profile");
        let p =
            MachineProfile::cached_or_measured(ExecutionDevice::Host, "k", &file, false).unwrap();
        assert!(!p.cached);
    }
}
