//! The host tier chosen from what host memory admits, on the host backend with host memory
//! observed through a fixture tree (`/proc` and a cgroup v2 limit): the mapping when the host
//! holds the checkpoint, retained windows and disk reads when it holds part of it, the disk alone
//! when it holds staging only. Every tier serves the checkpoint's bytes; the profile says why.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ddo_core::{Dtype, StreamId, WeightSource};
use ddo_platform::LinuxAdmissionProbe;
use ddo_session::{ComponentSession, SessionError, SessionSpec, Weights, testing};
use ddo_source::{Checkpoint, CheckpointSource, MmapChoice, ReadOptions};

const S: StreamId = StreamId(0);
const MIB: u64 = 1 << 20;
/// A block is 1024 x 1024 BF16 (2 MiB) plus a norm; 12 blocks are about 24 MiB.
const W: u64 = 1024;
const BLOCKS: usize = 12;
/// One staging buffer of 4 MiB.
const STAGING_GB: &str = "0.00390625";

/// A fake `/`: plenty of MemAvailable, no rlimits, the process in cgroup `/ddo` whose
/// `memory.max` leaves `room` bytes (none when `room` is `None`).
fn host(dir: &Path, room: Option<u64>) -> LinuxAdmissionProbe {
    let write = |rel: &str, text: String| {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    let kib = 1u64 << 40 >> 10;
    write(
        "proc/meminfo",
        format!(
            "MemTotal: {kib} kB\nMemAvailable: {kib} kB\nCommitLimit: {kib} kB\nCommitted_AS: 0 kB\n"
        ),
    );
    write("proc/sys/vm/overcommit_memory", "0\n".into());
    write("proc/self/status", "VmSize:\t1024 kB\nVmLck:\t0 kB\nCapEff:\t0000000000000000\n".into());
    write(
        "proc/self/limits",
        "Limit Soft Hard Units\nMax address space unlimited unlimited bytes\nMax locked memory unlimited unlimited bytes\n"
            .into(),
    );
    write("proc/self/cgroup", "0::/ddo\n".into());
    write("proc/self/mountinfo", "24 1 0:22 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n".into());
    let current = 100 * MIB;
    let max = room.map_or("max".to_owned(), |r| (current + r).to_string());
    write("sys/fs/cgroup/ddo/memory.max", format!("{max}\n"));
    write("sys/fs/cgroup/ddo/memory.current", format!("{current}\n"));
    LinuxAdmissionProbe::with_root(dir).with_safety_margin(0)
}

fn checkpoint(dir: &Path) -> PathBuf {
    let path = dir.join("model.safetensors");
    testing::write_blocks(&path, BLOCKS, W).unwrap();
    path
}

fn open(
    path: &Path,
    probe: LinuxAdmissionProbe,
    args: &[(&str, &str)],
) -> Result<ComponentSession, SessionError> {
    open_tree(path, probe, args, None)
}

fn open_tree(
    path: &Path,
    probe: LinuxAdmissionProbe,
    args: &[(&str, &str)],
    tree: Option<ddo_arena::ModuleTree>,
) -> Result<ComponentSession, SessionError> {
    let mut all = vec![
        ("execution_device", "cpu"),
        ("backend", "vmm"),
        ("vmm_resident_weight_budget_gb", "0.02"),
        ("vmm_staging_buffer_gb", STAGING_GB),
    ];
    all.extend_from_slice(args);
    // SAFETY: the test's checkpoint is not modified while the session lives.
    let mmap = unsafe { MmapChoice::auto() };
    ddo_compose::open_with_admission(
        SessionSpec {
            plan: testing::resolve_plan(&all).unwrap(),
            weights: Weights::Checkpoint { path: path.to_owned(), mmap },
            tree,
        },
        Arc::new(probe),
    )
}

/// Two passes reading every streamed tensor under its lease, compared with the checkpoint.
fn passes_serve_the_checkpoint(session: &ComponentSession) {
    for _ in 0..2 {
        session.begin_pass(S).unwrap();
        for unit in session.units().unwrap().iter().filter(|u| !u.pinned) {
            let lease = session.acquire(unit.id, S).unwrap();
            for suffix in ["attn.weight", "norm.weight"] {
                let name = format!("{}.{suffix}", unit.name);
                assert_eq!(
                    session.read_tensor(&name).unwrap(),
                    session.source_tensor(&name).unwrap(),
                    "{name}"
                );
            }
            session.release(lease, S).unwrap();
        }
        session.end_pass(S).unwrap();
    }
}

#[test]
fn a_host_that_holds_the_checkpoint_maps_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path());
    let session = open(&path, host(dir.path(), None), &[]).unwrap();
    passes_serve_the_checkpoint(&session);
    let m = session.metrics(None);
    m.validate().unwrap();
    assert_eq!(m.setup.host_source.as_deref(), Some("mapping"));
    let why = m.setup.host_tier_reason.clone().unwrap();
    assert!(why.starts_with("mapping: the host can hold the checkpoint's"), "{why}");
    assert!(m.format_profile().contains(&format!("host_tier: {why}")));
}

#[test]
fn a_host_that_holds_part_of_the_checkpoint_retains_that_part_and_reads_the_rest_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path());
    let session = open(&path, host(dir.path(), Some(20 * MIB)), &[]).unwrap();
    passes_serve_the_checkpoint(&session);
    let m = session.metrics(None);
    m.validate().unwrap();
    let s = &m.setup;
    assert_eq!(s.host_source.as_deref(), Some("retained"), "{s:?}");
    let why = s.host_tier_reason.clone().unwrap();
    assert!(why.starts_with("retained windows of"), "{why}");
    assert!(why.contains("cgroup /ddo allows"), "the bound is named: {why}");
    let retained = s.retained_bytes.unwrap();
    // Room 20 MiB: two staging buffers (4 MiB each) and the slack (3 MiB) stay free.
    assert!(retained > 0 && retained <= 9 * MIB, "{retained}");
    assert!(s.unretained_bytes.unwrap() > 0, "{s:?}");
    assert!(s.staging_bytes.unwrap() <= 8 * MIB, "{s:?}");
    let disk = m.runtime.disk_bytes_per_pass.unwrap();
    assert!(disk > 0, "the rest is read from disk every pass: {}", m.format_profile());
}

#[test]
fn a_host_that_holds_staging_only_reads_every_pass_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path());
    let model = std::fs::metadata(&path).unwrap().len();
    let session = open(&path, host(dir.path(), Some(10 * MIB)), &[]).unwrap();
    passes_serve_the_checkpoint(&session);
    let m = session.metrics(None);
    m.validate().unwrap();
    let s = &m.setup;
    assert_eq!(s.host_source.as_deref(), Some("disk"), "{s:?}");
    let why = s.host_tier_reason.clone().unwrap();
    assert!(why.starts_with("disk: page-locking the checkpoint's"), "{why}");
    assert!(s.staging_bytes.unwrap() <= 8 * MIB, "{s:?}");
    assert!(s.retained_bytes.is_none(), "{s:?}");
    let disk = m.runtime.disk_bytes_per_pass.unwrap();
    assert!(disk > model / 2, "most of the checkpoint is read every pass: {disk} of {model}");
}

#[test]
fn a_host_that_cannot_hold_staging_refuses_with_what_to_change() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path());
    let err = open(&path, host(dir.path(), Some(MIB)), &[]).unwrap_err().to_string();
    assert!(err.contains("vmm_staging_buffer_gb") && err.contains("cgroup /ddo"), "{err}");
    assert!(err.contains("raise the cgroup's memory limit"), "{err}");
}

#[test]
fn a_setting_that_names_the_tier_keeps_it_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path());
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a str, &'a str);
    let cases: [Case; 3] = [
        (&[("vmm_source_cache_gb", "1")], "retained", "retained: vmm_source_cache_gb = 1"),
        (
            &[("load_safetensors_backend", "mmap")],
            "mapping",
            "mapping: load_safetensors_backend = mmap",
        ),
        (
            &[("load_safetensors_backend", "pread")],
            "reads",
            "reads: load_safetensors_backend = pread",
        ),
    ];
    for (args, source, why) in cases {
        // A host with room for the whole checkpoint: only the setting decides.
        let session = open(&path, host(dir.path(), Some(1 << 30)), args).unwrap();
        passes_serve_the_checkpoint(&session);
        let s = session.metrics(None).setup;
        assert_eq!(s.host_source.as_deref(), Some(source), "{args:?}");
        assert!(s.host_tier_reason.unwrap().starts_with(why), "{args:?}");
    }
}

#[test]
fn a_peer_store_the_host_backend_would_hold_in_host_memory_asks_the_host_first() {
    // The host backend stands in host memory for a peer GPU's: a host without room for the
    // store streams from the mapping as before, and says why.
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path());
    let args = [("load_safetensors_backend", "mmap"), ("vmm_peer_store_device", "cuda:1")];
    let session = open(&path, host(dir.path(), Some(4 * MIB)), &args).unwrap();
    passes_serve_the_checkpoint(&session);
    let s = session.metrics(None).setup;
    assert_eq!(s.peer_store_units, None, "{s:?}");
    let warnings = s.warnings.unwrap_or_default();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("no peer weight store on cuda:1") && w.contains("host memory")),
        "{warnings:?}"
    );
    session.close().unwrap();
    let session = open(&path, host(dir.path(), Some(1 << 30)), &args).unwrap();
    passes_serve_the_checkpoint(&session);
    let s = session.metrics(None).setup;
    assert_eq!(s.peer_store_units, s.streamed_units, "{s:?}");
    session.close().unwrap();
}

#[test]
fn a_host_whose_memory_cannot_be_observed_keeps_the_mapping_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path());
    let probe = host(dir.path(), Some(10 * MIB));
    std::fs::remove_file(dir.path().join("proc/meminfo")).unwrap();
    let session = open(&path, probe, &[]).unwrap();
    passes_serve_the_checkpoint(&session);
    let s = session.metrics(None).setup;
    assert_eq!(s.host_source.as_deref(), Some("mapping"));
    let why = s.host_tier_reason.unwrap();
    assert!(why.contains("cannot be observed") && why.contains("/proc/meminfo"), "{why}");
}

#[test]
fn a_host_short_of_memory_converts_on_the_device_and_reads_the_checkpoint_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f32.safetensors");
    let mut names = vec![("embed.weight".to_owned(), vec![W, 8])];
    for b in 0..8 {
        names.push((format!("blocks.{b}.attn.weight"), vec![W, W / 2]));
        names.push((format!("blocks.{b}.norm.weight"), vec![W]));
    }
    names.push(("norm_out.weight".into(), vec![W]));
    testing::write_dtype(&path, Dtype::F32, &names, |t, i| ((t as u64 * 31 + i) % 251) as u8)
        .unwrap();
    // Loaded as bf16: parameters declare the module's dtype.
    let c = Checkpoint::open(&path).unwrap();
    let mut tree =
        ddo_arena::ModuleTree::from_tensor_names(c.slices().iter().map(|s| s.name.as_str()));
    for p in &mut tree.parameters {
        p.dtype = Some(Dtype::BF16);
        p.shape = Some(c.slices()[c.find(&p.name).unwrap()].shape.clone());
    }
    // 6 MiB of room: not the converted copy (8 MiB), nor the mapping (16 MiB), but two staging
    // buffers of a unit (2 MiB) each.
    let args = [("vmm_staging_buffer_gb", "0.00205")];
    let session =
        open_tree(&path, host(dir.path(), Some(6 * MIB)), &args, Some(tree.clone())).unwrap();
    let s = session.metrics(None).setup;
    assert_eq!(s.conversion.as_deref(), Some("device"), "{s:?}");
    assert_eq!(s.host_source.as_deref(), Some("disk"), "{s:?}");
    assert!(s.warnings.unwrap().iter().any(|w| w.contains("the host could not hold")));
    let source = CheckpointSource::new(c.into(), ReadOptions::default()).unwrap();
    for _ in 0..2 {
        session.begin_pass(S).unwrap();
        for unit in session.units().unwrap().iter().filter(|u| !u.pinned) {
            let lease = session.acquire(unit.id, S).unwrap();
            let name = format!("{}.attn.weight", unit.name);
            let i = source.slices().iter().position(|t| t.name == name).unwrap();
            let mut raw = vec![0; source.slices()[i].len as usize];
            source.read(i, &mut raw).unwrap();
            let mut want = vec![0; raw.len() / 2];
            ddo_source::convert(Dtype::F32, Dtype::BF16, &raw, &mut want);
            assert_eq!(session.read_tensor(&name).unwrap(), want, "{name}");
            session.release(lease, S).unwrap();
        }
        session.end_pass(S).unwrap();
    }
    // Asked to convert on the host only, the same host refuses clearly.
    let args = [args[0], ("dtype_conversion", "host")];
    let e = open_tree(&path, host(dir.path(), Some(6 * MIB)), &args, Some(tree)).unwrap_err();
    assert!(e.to_string().contains("needs host memory"), "{e}");
}

#[test]
fn the_chosen_tier_stages_units_larger_than_the_staging_setting() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path());
    // A buffer of 1 MiB holds no 2 MiB unit: the tier sizes staging to the largest unit.
    let args = [("vmm_staging_buffer_gb", "0.0009765625")];
    let session = open(&path, host(dir.path(), Some(20 * MIB)), &args).unwrap();
    passes_serve_the_checkpoint(&session);
    let m = session.metrics(None);
    let s = &m.setup;
    assert_eq!(s.host_source.as_deref(), Some("retained"), "{s:?}");
    assert!(s.staging_bytes.unwrap() >= 4 * MIB, "two buffers of a unit: {s:?}");
    assert!(s.warnings.is_none(), "no unit is read on demand: {:?}", s.warnings);
    assert!(m.runtime.disk_bytes_per_pass.unwrap() > 0);
}
