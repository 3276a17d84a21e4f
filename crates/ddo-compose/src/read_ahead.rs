//! Reading a checkpoint's files into the page cache while the module that will map them is
//! built: a head start the native route takes only where the host can hold the files.

use std::path::PathBuf;

use ddo_core::{Admission, GrowthKind, GrowthRequest, SourceError};
use ddo_policy::Plan;
use ddo_session::SessionError;
use ddo_session::source::ReadAhead;

/// Most reader threads: the page cache fills no faster with more.
const MAX_READERS: usize = 16;

/// Starts reading `files` in the background when `plan` maps them whole ([`Plan::reads_ahead`])
/// and the host admits their bytes the way the mapping tier will (this host's probe keeping the
/// plan's `system_ram_headroom_gb` free); `None` otherwise, and the load reads them as its tier
/// does. A file that cannot be read is an error naming it.
pub fn read_ahead(plan: &Plan, files: &[PathBuf]) -> Result<Option<ReadAhead>, SessionError> {
    if !plan.reads_ahead() {
        return Ok(None);
    }
    let mut bytes = 0u64;
    for file in files {
        let io = |source| SourceError::Io { file: file.clone(), source };
        bytes = bytes.saturating_add(std::fs::metadata(file).map_err(io)?.len());
    }
    let margin =
        crate::machine::gib("system_ram_headroom_gb", plan.settings.system_ram_headroom_gb)?;
    let request = GrowthRequest { kind: GrowthKind::Retained, bytes, registered_bytes: 0 };
    if !matches!(crate::host_admission(Some(margin)).admit(&request), Admission::Granted { .. }) {
        return Ok(None);
    }
    let readers = std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_READERS);
    Ok(Some(ReadAhead::start(files, readers)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(pairs: &[(&str, &str)]) -> Plan {
        ddo_session::resolve("transformer", pairs).expect("resolves")
    }

    #[test]
    fn only_a_mapped_checkpoint_the_host_can_hold_is_read_ahead() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("model.safetensors");
        std::fs::write(&file, vec![7u8; 1 << 20]).unwrap();
        let native = [("backend", "vmm"), ("execution_device", "cpu")];
        let started = read_ahead(&plan(&native), std::slice::from_ref(&file)).unwrap();
        assert!(started.is_some(), "a small mapped checkpoint is read ahead");
        // The linear route streams the module's own tensors: nothing to map.
        assert!(
            read_ahead(&plan(&[("execution_device", "cpu")]), std::slice::from_ref(&file))
                .unwrap()
                .is_none()
        );
        // A host that keeps more free than it has admits nothing.
        let short = [native[0], native[1], ("system_ram_headroom_gb", "1000000")];
        assert!(read_ahead(&plan(&short), std::slice::from_ref(&file)).unwrap().is_none());
        let missing = dir.path().join("missing.safetensors");
        let e = read_ahead(&plan(&native), &[missing]).unwrap_err().to_string();
        assert!(e.contains("missing.safetensors"), "{e}");
    }
}
