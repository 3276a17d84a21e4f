//! The disk route (`vmm_runtime`, preset `nvme_baseline`) on the host backend: every unit read
//! from the checkpoint into registered staging each pass, host memory within the staging ceiling.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use ddo_core::StreamId;
use ddo_session::{ComponentSession, SessionError, SessionRoute, SessionSpec, Weights, testing};
use ddo_source::MmapChoice;

const S: StreamId = StreamId(0);
/// A block is 1024 x 1024 BF16 (2 MiB) plus a norm.
const W: u64 = 1024;
/// One staging buffer of 4 MiB: the ceiling (two buffers) holds a third of a 12-block model.
const STAGING_GB: &str = "0.00390625";

fn checkpoint(dir: &Path, blocks: usize) -> PathBuf {
    let path = dir.join("model.safetensors");
    testing::write_blocks(&path, blocks, W).unwrap();
    path
}

fn request(args: &[(&str, &str)]) -> Result<ddo_policy::Plan, ddo_policy::ConfigError> {
    let mut all =
        vec![("execution_device", "cpu"), ("backend", "vmm"), ("preset", "nvme_baseline")];
    all.extend_from_slice(args);
    testing::resolve_plan(&all)
}

fn disk(path: &Path, args: &[(&str, &str)]) -> Result<ComponentSession, SessionError> {
    let mut all =
        vec![("vmm_resident_weight_budget_gb", "0.02"), ("vmm_staging_buffer_gb", STAGING_GB)];
    all.extend_from_slice(args);
    // SAFETY: the promise is not needed (the disk route never maps), and the tests that change
    // the file expect the change to be refused.
    let mmap = unsafe { MmapChoice::auto() };
    ddo_compose::open(SessionSpec {
        plan: request(&all).unwrap(),
        weights: Weights::Checkpoint { path: path.to_owned(), mmap },
        tree: None,
    })
}

fn expected(blocks: usize) -> impl Fn(&str) -> Vec<u8> {
    let mut names = vec![("embed.weight".to_owned(), W * 8 * 2)];
    for b in 0..blocks {
        names.push((format!("blocks.{b}.attn.weight"), W * W * 2));
        names.push((format!("blocks.{b}.norm.weight"), W * 2));
    }
    names.push(("norm_out.weight".into(), W * 2));
    move |name: &str| {
        let t = names.iter().position(|(n, _)| n == name).unwrap();
        testing::expected_bytes(t, names[t].1)
    }
}

/// One pass checking every streamed tensor's bytes under its lease.
fn pass(session: &ComponentSession, expect: &dyn Fn(&str) -> Vec<u8>) -> Result<(), SessionError> {
    session.begin_pass(S)?;
    for unit in session.units()?.iter().filter(|u| !u.pinned) {
        let lease = session.acquire(unit.id, S)?;
        for suffix in ["attn.weight", "norm.weight"] {
            let name = format!("{}.{suffix}", unit.name);
            assert_eq!(session.read_tensor(&name)?, expect(&name), "{name}");
        }
        session.release(lease, S)?;
    }
    session.end_pass(S)
}

#[test]
fn the_disk_route_uploads_the_checkpoint_bytes_every_pass_within_the_staging_ceiling() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = 12;
    let path = checkpoint(dir.path(), blocks);
    let model = std::fs::metadata(&path).unwrap().len();
    let session = disk(&path, &[]).unwrap();
    assert_eq!(session.route(), SessionRoute::Disk);
    let expect = expected(blocks);
    for _ in 0..3 {
        pass(&session, &expect).unwrap();
    }
    let m = session.metrics(None);
    m.validate().unwrap();
    assert_eq!(m.runtime_route(), "vmm_runtime");
    let s = &m.setup;
    assert_eq!(s.host_source.as_deref(), Some("disk"));
    let ceiling = 2 * (4u64 << 20);
    let staging = s.staging_bytes.unwrap();
    assert!(staging <= ceiling, "staging {staging} within the ceiling {ceiling}");
    assert!(staging < model / 2, "the model ({model} B) is larger than the staging");
    assert!(s.staging_buffers.unwrap() >= 1);
    assert_eq!(s.retained_bytes, None, "nothing retained");
    assert_eq!(s.registered_bytes, Some(staging), "the staging buffers are registered");
    let streamed = s.streamed_bytes_per_pass.unwrap();
    assert!(streamed > 0);
    let rt = &m.runtime;
    assert_eq!(rt.passes, Some(3));
    let per_pass = rt.disk_bytes_per_pass.unwrap();
    assert!(
        per_pass >= streamed,
        "every streamed byte read from disk each pass: {per_pass} < {streamed}"
    );
    assert!(rt.read_stall_seconds.is_some() && rt.disk_read_seconds.is_some());
    let uploads = rt.uploads.unwrap();
    let on_demand = rt.disk_reads_on_demand.unwrap();
    assert!(on_demand * 4 < uploads, "uploads read ahead, {on_demand} of {uploads} on demand");
    let profile = m.format_profile();
    assert!(profile.contains("disk=gib_per_pass="), "{profile}");
    session.close().unwrap();
}

#[test]
fn routes_that_do_not_read_the_disk_have_no_disk_counters() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 4);
    // SAFETY: the test's checkpoint is not modified while the session lives.
    let mmap = unsafe { MmapChoice::auto() };
    let plan = ddo_session::resolve(
        "transformer",
        &[
            ("backend", "vmm"),
            ("execution_device", "cpu"),
            ("vmm_resident_weight_budget_gb", "0.02"),
        ],
    )
    .unwrap();
    let session = ddo_compose::open(SessionSpec {
        plan,
        weights: Weights::Checkpoint { path, mmap },
        tree: None,
    })
    .unwrap();
    pass(&session, &expected(4)).unwrap();
    let m = session.metrics(None);
    assert_eq!(m.runtime.disk_bytes, None);
    assert_eq!(m.runtime.read_stall_seconds, None);
    assert_eq!(m.setup.staging_bytes, None);
    assert!(!m.format_profile().contains("disk="));
}

#[test]
fn a_checkpoint_written_underneath_is_refused_and_never_delivers_other_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = 8;
    let path = checkpoint(dir.path(), blocks);
    let session = disk(&path, &[]).unwrap();
    let expect = expected(blocks);
    pass(&session, &expect).unwrap();
    // Rewrite a block's bytes in place (same size, other contents).
    std::thread::sleep(std::time::Duration::from_millis(20));
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let len = file.metadata().unwrap().len();
    file.write_all_at(&vec![0xAB; 1 << 20], len / 2).unwrap();
    drop(file);
    // `pass` checks the bytes of every unit it gets: none may differ.
    let err = (0..3).find_map(|_| pass(&session, &expect).err()).expect("the change is noticed");
    let text = err.to_string();
    assert!(text.contains("changed"), "{text}");
}

/// Opens `path` with `args`, `vmm_staging_buffer_gb` 1 KiB but counted as not the caller's (a
/// default smaller than the model's units, as 0.625 GiB is for a Flux-12B block).
fn with_small_default_staging(
    device: &str,
    path: &Path,
    args: &[(&str, &str)],
) -> Result<ComponentSession, SessionError> {
    let mut all = vec![("execution_device", device), ("backend", "vmm")];
    all.extend_from_slice(args);
    all.push(("vmm_staging_buffer_gb", "0.0000009765625"));
    let mut plan = testing::resolve_plan(&all).unwrap();
    plan.origins.insert("vmm_staging_buffer_gb".into(), ddo_policy::Origin::Default);
    // SAFETY: the test's checkpoint is not modified while the session lives.
    let mmap = unsafe { MmapChoice::auto() };
    ddo_compose::open(SessionSpec {
        plan,
        weights: Weights::Checkpoint { path: path.to_owned(), mmap },
        tree: None,
    })
}

#[test]
fn staging_not_set_by_the_caller_grows_to_hold_the_largest_unit() {
    staging_grows("cpu");
}

/// The staged routes on the GPU: copies in flight hold their staging buffers until the device
/// retires them, and the reads still run ahead.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn on_cuda_staging_not_set_by_the_caller_grows_to_hold_the_largest_unit() {
    staging_grows("cuda:0");
}

fn staging_grows(device: &str) {
    let dir = tempfile::tempdir().unwrap();
    let blocks = 6;
    let path = checkpoint(dir.path(), blocks);
    let expect = expected(blocks);
    let unit = W * W * 2;
    // The disk route: two buffers, each a whole unit, instead of a refusal.
    let session = with_small_default_staging(
        device,
        &path,
        &[("preset", "nvme_baseline"), ("vmm_resident_weight_budget_gb", "0.02")],
    )
    .unwrap();
    assert_eq!(session.route(), SessionRoute::Disk);
    for _ in 0..2 {
        pass(&session, &expect).unwrap();
    }
    let m = session.metrics(None);
    assert!(m.setup.staging_bytes.unwrap() >= 2 * unit, "{:?}", m.setup);
    session.close().unwrap();
    // Part of the checkpoint retained: the rest read ahead into two such buffers, not read
    // on demand.
    let session = with_small_default_staging(
        device,
        &path,
        &[("vmm_resident_weight_budget_gb", "0.02"), ("vmm_source_cache_gb", "0.005")],
    )
    .unwrap();
    for _ in 0..2 {
        pass(&session, &expect).unwrap();
    }
    let m = session.metrics(None);
    assert_eq!(m.setup.staging_buffers, Some(2), "{:?}", m.setup);
    assert!(m.setup.staging_bytes.unwrap() >= 2 * unit, "{:?}", m.setup);
    assert!(m.setup.warnings.is_none(), "{:?}", m.setup.warnings);
    let rt = &m.runtime;
    assert!(
        rt.disk_reads_on_demand.unwrap() * 4 < rt.uploads.unwrap(),
        "the unretained bytes were read ahead: {rt:?}"
    );
    session.close().unwrap();
}

#[test]
fn a_staging_buffer_smaller_than_the_largest_unit_names_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 4);
    let err = disk(&path, &[("vmm_staging_buffer_gb", "0.001")]).unwrap_err();
    match &err {
        SessionError::Config { setting, message } => {
            assert_eq!(*setting, "vmm_staging_buffer_gb");
            assert!(message.contains("largest unit") && message.contains("at least"), "{message}");
        }
        other => panic!("{other}"),
    }
    for bad in ["nan", "0", "-1"] {
        let request = ddo_policy::Request {
            component: "transformer",
            environment: ddo_policy::Environment::from_pairs([
                ("DDO_BACKEND", "vmm"),
                ("DDO_PRESET", "nvme_baseline"),
                ("DDO_VMM_STAGING_BUFFER_GB", bad),
            ]),
            ..ddo_policy::Request::default()
        };
        let err = ddo_policy::resolve(&request).unwrap_err().to_string();
        assert!(err.starts_with("vmm_staging_buffer_gb = "), "{bad}: {err}");
    }
}

#[test]
fn explicit_settings_beat_the_disk_preset() {
    let plan = request(&[("prefetch_depth", "2"), ("vmm_staging_buffer_gb", "1.5")]).unwrap();
    assert_eq!(plan.settings.prefetch_depth, 2, "the preset sets 1");
    assert_eq!(plan.settings.vmm_staging_buffer_gb, 1.5);
    assert_eq!(plan.route.name(), "vmm_runtime");
}

#[test]
fn the_native_route_reads_the_unretained_rest_ahead_into_staging() {
    let dir = tempfile::tempdir().unwrap();
    // 40 blocks of 2 MiB: one 64 MiB window is retained, the rest is read from disk.
    let blocks = 40;
    let path = checkpoint(dir.path(), blocks);
    // SAFETY: the test's checkpoint is not modified while the session lives.
    let mmap = unsafe { MmapChoice::auto() };
    let plan = ddo_session::resolve(
        "transformer",
        &[
            ("backend", "vmm"),
            ("execution_device", "cpu"),
            ("vmm_resident_weight_budget_gb", "0.02"),
            ("vmm_source_cache_gb", "0.07"),
            ("vmm_staging_buffer_gb", "0.01"),
        ],
    )
    .unwrap();
    let session = ddo_compose::open(SessionSpec {
        plan,
        weights: Weights::Checkpoint { path, mmap },
        tree: None,
    })
    .unwrap();
    let expect = expected(blocks);
    for _ in 0..2 {
        pass(&session, &expect).unwrap();
    }
    let m = session.metrics(None);
    m.validate().unwrap();
    let s = &m.setup;
    assert_eq!(s.host_source.as_deref(), Some("retained"));
    assert!(s.retained_bytes.unwrap() > 0 && s.unretained_bytes.unwrap() > 0, "{s:?}");
    assert!(s.staging_bytes.unwrap() <= 10 * (1 << 30) / 1000, "{s:?}");
    let disk = m.runtime.disk_bytes_per_pass.unwrap();
    assert!(disk >= s.unretained_bytes.unwrap() / 2, "the rest is read each pass: {disk}");
}
