//! The session on the host backend: both routes, every acting setting, lifecycle and errors.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ddo_core::{Dtype, HostBytes, HostRegion, HostSlice, StreamId};
use ddo_session::{ComponentSession, SessionError, SessionSpec, Weights, testing};
use ddo_source::{HostTensor, MmapChoice};

const S: StreamId = StreamId(0);
/// Block width: a block is 1024 x 1024 BF16 (2 MiB) plus a norm, so 4 MiB on the host backend.
const W: u64 = 1024;

fn checkpoint(dir: &Path, blocks: usize) -> PathBuf {
    let path = dir.join("model.safetensors");
    testing::write_blocks(&path, blocks, W).unwrap();
    path
}

fn resolve(extra: &[(&str, &str)]) -> ddo_policy::Plan {
    let mut args = vec![("execution_device", "cpu")];
    args.extend_from_slice(extra);
    testing::resolve_plan(&args).unwrap()
}

fn native(path: &Path, extra: &[(&str, &str)]) -> Result<ComponentSession, SessionError> {
    native_with(path, extra, None)
}

/// The native route over the mapped checkpoint at `path`, with the module `tree` when given.
fn native_with(
    path: &Path,
    extra: &[(&str, &str)],
    tree: Option<ddo_arena::ModuleTree>,
) -> Result<ComponentSession, SessionError> {
    let mut args = vec![("backend", "vmm"), ("vmm_resident_weight_budget_gb", "0.02")];
    args.extend_from_slice(extra);
    // SAFETY: the test's checkpoint is not modified while the session lives.
    let mmap = unsafe { MmapChoice::auto() };
    ddo_compose::open(SessionSpec {
        plan: resolve(&args),
        weights: Weights::Checkpoint { path: path.to_owned(), mmap },
        tree,
    })
}

/// Runs `passes` forward passes, checking every streamed tensor's bytes under its lease.
fn run_and_check(session: &ComponentSession, passes: usize, expect: &dyn Fn(&str) -> Vec<u8>) {
    run_and_compare(session, passes, expect, None);
}

/// As [`run_and_check`]; with `values` of a floating dtype, NaN equals NaN whatever its payload
/// (the one thing conversions may differ in).
fn run_and_compare(
    session: &ComponentSession,
    passes: usize,
    expect: &dyn Fn(&str) -> Vec<u8>,
    values: Option<Dtype>,
) {
    let same = |got: Vec<u8>, want: Vec<u8>, name: &str| match values {
        None => assert_eq!(got, want, "{name}"),
        Some(d) => {
            assert_eq!(got.len(), want.len(), "{name}");
            let w = d.size_bytes() as usize;
            for (i, (g, e)) in got.chunks(w).zip(want.chunks(w)).enumerate() {
                if g != e {
                    let wide = |b: &[u8]| {
                        let mut f = [0u8; 4];
                        if d == Dtype::F32 {
                            f.copy_from_slice(b)
                        } else {
                            ddo_core::convert(d, Dtype::F32, b, &mut f)
                        }
                        f32::from_le_bytes(f)
                    };
                    assert!(
                        wide(g).is_nan() && wide(e).is_nan(),
                        "{name}: element {i} is {g:?}, want {e:?}"
                    );
                }
            }
        }
    };
    for _ in 0..passes {
        session.begin_pass(S).unwrap();
        for unit in session.units().unwrap().iter().filter(|u| !u.pinned) {
            let lease = session.acquire(unit.id, S).unwrap();
            for suffix in ["attn.weight", "norm.weight"] {
                let name = format!("{}.{suffix}", unit.name);
                same(session.read_tensor(&name).unwrap(), expect(&name), &name);
            }
            session.release(lease, S).unwrap();
        }
        for name in ["embed.weight", "norm_out.weight"] {
            same(session.read_tensor(name).unwrap(), expect(name), name);
        }
        session.end_pass(S).unwrap();
    }
}

fn checkpoint_bytes(blocks: usize) -> impl Fn(&str) -> Vec<u8> {
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

/// Each tensor's bytes as the checkpoint at `path` stores them, by name.
fn stored_bytes(path: &Path) -> impl Fn(&str) -> Vec<u8> {
    use ddo_core::WeightSource;
    let source = ddo_source::CheckpointSource::new(
        ddo_source::Checkpoint::open(path).unwrap().into(),
        ddo_source::ReadOptions::default(),
    )
    .unwrap();
    move |name: &str| {
        let i = source.slices().iter().position(|t| t.name == name).unwrap();
        let mut raw = vec![0; source.slices()[i].len as usize];
        source.read(i, &mut raw).unwrap();
        raw
    }
}

fn setup(session: &ComponentSession) -> ddo_metrics::SetupSection {
    session.metrics(None).setup
}

#[test]
fn the_native_route_streams_every_block_from_the_mapping() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 6);
    let session = native(&path, &[]).unwrap();
    let units = session.units().unwrap();
    assert_eq!(units.len(), 7, "the resident rest and six blocks");
    assert!(units[0].pinned && units[0].name == "resident");
    run_and_check(&session, 3, &checkpoint_bytes(6));
    let m = session.metrics(Some("test"));
    m.validate().unwrap();
    assert_eq!(m.route, "dynamic_offload");
    assert_eq!(m.runtime_route(), "vmm_fast_runtime");
    assert_eq!(m.runtime.passes, Some(3));
    assert_eq!(m.setup.host_source.as_deref(), Some("mapping"));
    assert!(m.setup.streamed_units.unwrap() > 0);
    assert_eq!(m.host_memory.unwrap().phase.as_deref(), Some("test"));
    session.close().unwrap();
}

#[test]
fn read_backends_and_retained_windows_serve_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 4);
    for (args, kind) in [
        (vec![("load_safetensors_backend", "pread")], "reads"),
        (vec![("load_safetensors_backend", "direct")], "reads"),
        (vec![("vmm_source_cache_gb", "1")], "retained"),
    ] {
        let session = native(&path, &args).unwrap();
        assert_eq!(setup(&session).host_source.as_deref(), Some(kind), "{args:?}");
        run_and_check(&session, 2, &checkpoint_bytes(4));
        if kind == "retained" {
            assert!(setup(&session).retained_bytes.unwrap() > 0);
        }
    }
    // Read workers: pin_cpu_workers.
    for workers in [1u64, 3] {
        let w = workers.to_string();
        let session =
            native(&path, &[("vmm_source_cache_gb", "1"), ("pin_cpu_workers", &w)]).unwrap();
        assert_eq!(setup(&session).read_workers, Some(workers));
    }
    // Without the owner's promise nothing is mapped: the bytes are read.
    let session = ddo_compose::open(SessionSpec {
        plan: resolve(&[("backend", "vmm"), ("vmm_resident_weight_budget_gb", "0.02")]),
        weights: Weights::Checkpoint { path, mmap: MmapChoice::never() },
        tree: None,
    })
    .unwrap();
    assert_eq!(setup(&session).host_source.as_deref(), Some("reads"));
    run_and_check(&session, 1, &checkpoint_bytes(4));
}

#[test]
fn retained_bytes_beyond_the_registration_ceiling_are_copied_unregistered() {
    let dir = tempfile::tempdir().unwrap();
    // 40 blocks of 2 MiB: the retained windows need two 64 MiB segments.
    let path = checkpoint(dir.path(), 40);
    let all = native(&path, &[("vmm_source_cache_gb", "1")]).unwrap();
    let s = setup(&all);
    assert_eq!(s.unregistered_bytes, Some(0));
    assert!(s.registered_bytes.unwrap() > 64 << 20);
    drop(all);
    let one_segment =
        native(&path, &[("vmm_source_cache_gb", "1"), ("vmm_source_registered_gb", "0.0625")])
            .unwrap();
    let s = setup(&one_segment);
    assert!(s.registered_bytes.unwrap() > 0 && s.registered_bytes.unwrap() <= 64 << 20, "{s:?}");
    assert!(s.unregistered_bytes.unwrap() > 0, "{s:?}");
    assert!(s.unregistered_reason.clone().unwrap().contains("registration ceiling"), "{s:?}");
    run_and_check(&one_segment, 1, &checkpoint_bytes(40));
}

#[test]
fn a_retained_store_the_host_refuses_reads_on_demand() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 4);
    // A RAM margin no machine has: admission refuses every retained byte.
    let session =
        native(&path, &[("vmm_source_cache_gb", "1"), ("system_ram_headroom_gb", "100000")])
            .unwrap();
    let s = setup(&session);
    assert_eq!(s.retained_bytes, Some(0));
    assert!(s.unretained_bytes.unwrap() > 0);
    run_and_check(&session, 1, &checkpoint_bytes(4));
}

#[test]
fn budget_prefetch_and_headroom_shape_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 8);
    let small = native(&path, &[("prefetch_depth", "1")]).unwrap();
    let s = setup(&small);
    assert_eq!(s.execution_slots, Some(2));
    let deep = native(&path, &[("prefetch_depth", "3")]).unwrap();
    assert_eq!(setup(&deep).execution_slots, Some(4));
    let large = native(&path, &[("vmm_resident_weight_budget_gb", "1")]).unwrap();
    assert_eq!(setup(&large).streamed_units, Some(0), "a budget that holds everything");
    let err = native(&path, &[("auto_vram_headroom_gb", "0.019")]).unwrap_err();
    assert!(matches!(err, SessionError::Capacity { .. }), "{err}");
    assert!(err.to_string().contains("vmm_resident_weight_budget_gb"), "{err}");
}

#[test]
fn module_patterns_choose_what_streams() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 6);
    let only_late = native(&path, &[("vmm_module_pattern", r"blocks\.[45]")]).unwrap();
    let streamed: Vec<String> =
        only_late.units().unwrap().iter().filter(|u| !u.pinned).map(|u| u.name.clone()).collect();
    assert_eq!(streamed, vec!["blocks.4", "blocks.5"]);
    drop(only_late);
    let norms_resident = native(
        &path,
        &[
            ("vmm_resident_weight_budget_gb", "0.04"),
            ("always_resident_modules_pattern", r#"["\\.norm$"]"#),
        ],
    )
    .unwrap();
    let a = norms_resident.assignment();
    let norm = a.parameters.iter().find(|p| p.names[0] == "blocks.0.norm.weight").unwrap();
    assert_eq!(norm.unit, None);
    run_and_check(&norms_resident, 1, &checkpoint_bytes(6));
}

#[test]
fn an_interrupted_pass_leaves_the_session_usable() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 6);
    let session = native(&path, &[]).unwrap();
    session.begin_pass(S).unwrap();
    let units = session.units().unwrap();
    // A block raised between acquire and release: the pass is aborted, and the block's lease
    // stays its holder's (another stream's work may still read the unit).
    let lost = session.acquire(units[1].id, S).unwrap();
    let err = session.unload().unwrap_err();
    assert!(err.to_string().contains("during a forward pass"), "{err}");
    session.abort_pass(S).unwrap();
    let err = session.unload().unwrap_err();
    assert!(err.to_string().contains("1 lease(s) live"), "{err}");
    // Given back by its holder, the next passes run correctly.
    session.release(lost, S).unwrap();
    run_and_check(&session, 2, &checkpoint_bytes(6));
    // A teardown gives back what a holder never did.
    let _lost = session.acquire(units[1].id, S).unwrap();
    session.release_leases(S).unwrap();
    session.unload().unwrap();
    assert!(session.is_unloaded());
    let err = session.begin_pass(S).unwrap_err();
    assert!(err.to_string().contains("unloaded"), "{err}");
    session.reload().unwrap();
    run_and_check(&session, 1, &checkpoint_bytes(6));
    assert!(session.reload().is_err(), "reload of a loaded component");
}

/// Acquires `units` in turn (each released before the next): the error of the first refused.
/// Units still on the device from the last pass need no upload; the first that does refuses.
fn first_refused_upload(
    session: &ComponentSession,
    units: &[ddo_session::UnitInfo],
) -> SessionError {
    units
        .iter()
        .find_map(|u| match session.acquire(u.id, S) {
            Ok(lease) => session.release(lease, S).err(),
            Err(e) => Some(e),
        })
        .expect("an upload after the change")
}

#[test]
fn uploads_check_the_open_files_and_each_pass_checks_the_paths() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 6);
    let bytes = std::fs::read(&path).unwrap();
    let session = native(&path, &[]).unwrap();
    run_and_check(&session, 1, &checkpoint_bytes(6));
    let streamed: Vec<_> = session.units().unwrap().into_iter().filter(|u| !u.resident).collect();
    assert!(streamed.len() >= 3, "{streamed:?}");
    // Another file renamed over the path during a pass: the next upload refuses (its check
    // reads the open descriptor, whose file no path names any more), and so does the next
    // pass's start (which checks the path).
    session.begin_pass(S).unwrap();
    let tmp = dir.path().join("new");
    std::fs::write(&tmp, &bytes).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    let err = first_refused_upload(&session, &streamed);
    assert!(err.to_string().contains("the file was replaced or deleted"), "{err}");
    session.abort_pass(S).unwrap();
    session.release_leases(S).unwrap();
    let err = session.begin_pass(S).unwrap_err();
    assert!(err.to_string().contains("(the file was replaced)"), "{err}");
    session.close().unwrap();

    // The file opened written in place: the next upload refuses, within the pass.
    let path = checkpoint(dir.path(), 6);
    let session = native(&path, &[]).unwrap();
    run_and_check(&session, 1, &checkpoint_bytes(6));
    let streamed: Vec<_> = session.units().unwrap().into_iter().filter(|u| !u.resident).collect();
    session.begin_pass(S).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.write_all_at(&bytes[..8], 0).unwrap();
    // The same bytes written: a modification time a filesystem's coarse clock cannot miss.
    file.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5)).unwrap();
    let err = first_refused_upload(&session, &streamed);
    assert!(err.to_string().contains("changed while in use"), "{err}");
    session.abort_pass(S).unwrap();
    session.release_leases(S).unwrap();
}

#[test]
fn reclaim_releases_idle_slots_and_the_next_pass_uploads_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 6);
    let session = native(&path, &[]).unwrap();
    run_and_check(&session, 1, &checkpoint_bytes(6));
    let r = session.reclaim().unwrap();
    assert!(r.slots > 0 && r.bytes > 0, "{r:?}");
    run_and_check(&session, 1, &checkpoint_bytes(6));
}

#[test]
fn weights_that_do_not_fit_the_module_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 3);
    let mut tree =
        ddo_session::ModuleTree::from_tensor_names(["blocks.0.attn.weight", "missing.weight"]);
    tree.parameters[0].dtype = Some(Dtype::BF16);
    let open = |tree| {
        ddo_compose::open(SessionSpec {
            plan: resolve(&[("backend", "vmm")]),
            weights: Weights::Checkpoint { path: path.clone(), mmap: MmapChoice::never() },
            tree: Some(tree),
        })
    };
    let err = open(tree.clone()).unwrap_err().to_string();
    assert!(err.contains("parameter missing.weight has no tensor in the checkpoint"), "{err}");
    tree.parameters.pop();
    tree.parameters[0].dtype = Some(Dtype::I32);
    let err = open(tree.clone()).unwrap_err().to_string();
    assert!(err.contains("is I32 [] but the checkpoint stores BF16 [1024, 1024]"), "{err}");
    tree.parameters[0].dtype = Some(Dtype::F32);
    tree.parameters[0].shape = Some(vec![1024, 1023]);
    let err = open(tree).unwrap_err().to_string();
    assert!(err.contains("the checkpoint is not this model's"), "{err}");
    let err = open(ddo_session::ModuleTree::default()).unwrap_err().to_string();
    assert!(err.contains("has no parameters"), "{err}");
    let bad = ddo_compose::open(SessionSpec {
        plan: resolve(&[("backend", "linear")]),
        weights: Weights::Checkpoint { path: path.clone(), mmap: MmapChoice::never() },
        tree: None,
    })
    .unwrap_err();
    assert!(bad.to_string().contains("for a checkpoint use backend vmm"), "{bad}");
}

// ---- the linear route: host tensors in place ----------------------------------------------

/// The checkpoint's tensors as host tensors, one storage each.
fn host_weights(blocks: usize) -> Weights {
    let expect = checkpoint_bytes(blocks);
    let mut names = vec![("embed.weight".to_owned(), vec![W, 8])];
    for b in 0..blocks {
        names.push((format!("blocks.{b}.attn.weight"), vec![W, W]));
        names.push((format!("blocks.{b}.norm.weight"), vec![W]));
    }
    names.push(("norm_out.weight".into(), vec![W]));
    let storages = names
        .iter()
        .map(|(n, _)| HostSlice::whole(Arc::new(HostBytes::from(expect(n))) as Arc<dyn HostRegion>))
        .collect();
    let tensors = names
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| HostTensor {
            name,
            dtype: Dtype::BF16,
            shape,
            storage: i,
            offset: 0,
        })
        .collect();
    Weights::Host { storages, tensors, mmap: MmapChoice::never() }
}

fn linear(extra: &[(&str, &str)]) -> Result<ComponentSession, SessionError> {
    let mut args = vec![("backend", "linear")];
    args.extend_from_slice(extra);
    ddo_compose::open(SessionSpec { plan: resolve(&args), weights: host_weights(6), tree: None })
}

#[test]
fn the_linear_route_streams_host_tensors_through_the_arena() {
    let session = linear(&[]).unwrap();
    let m = session.metrics(None);
    assert_eq!(m.route, "dynamic_offload");
    assert_eq!(m.runtime_route(), "linear_runtime");
    assert_eq!(m.setup.host_source.as_deref(), Some("host_tensors"));
    assert_eq!(m.setup.streamed_units, Some(6), "no resident budget: every block streams");
    run_and_check(&session, 3, &checkpoint_bytes(6));
    let m = session.metrics(None);
    m.validate().unwrap();
    assert!(m.runtime.uploads.unwrap() >= 18);
}

#[test]
fn small_tensors_are_packed_per_unit_under_the_threshold() {
    // Each block's 2 KiB norm alone is small; the 2 MiB weight is not.
    let packed = linear(&[("small_tensor_threshold_kb", "4")]).unwrap();
    assert_eq!(setup(&packed).packed_bytes, Some(0), "one small tensor per unit: nothing to pack");
    let packed = linear(&[("small_tensor_threshold_kb", "4096")]).unwrap();
    let s = setup(&packed);
    assert!(s.packed_bytes.unwrap() > 6 * W * W * 2);
    // Packs are registered like the storages: no copy comes from pageable memory.
    assert_eq!(s.unregistered_bytes, Some(0), "{s:?}");
    assert!(s.registered_bytes.unwrap() >= s.packed_bytes.unwrap(), "{s:?}");
    run_and_check(&packed, 1, &checkpoint_bytes(6));
    let none = linear(&[("small_tensor_threshold_kb", "0")]).unwrap();
    assert_eq!(setup(&none).packed_bytes, Some(0));
}

#[test]
fn pinning_settings_decide_what_is_registered() {
    let pinned = linear(&[("pin_cpu_memory", "true")]).unwrap();
    let s = setup(&pinned);
    assert!(s.registered_bytes.unwrap() > 0);
    assert_eq!(s.unregistered_bytes, Some(0));
    let unpinned = linear(&[("pin_cpu_memory", "false")]).unwrap();
    let s = setup(&unpinned);
    assert_eq!(s.registered_bytes, Some(0));
    assert_eq!(s.unregistered_reason.as_deref(), Some("pin_cpu_memory is off"));
    run_and_check(&unpinned, 1, &checkpoint_bytes(6));
    // 64 MiB of registration for 40 blocks of 2 MiB: the first 31 storages fit (each charged
    // its pages), the rest are copied unregistered.
    let open = |extra: &[(&str, &str)]| {
        let mut args = vec![
            ("backend", "linear"),
            ("pin_cpu_memory", "true"),
            ("pin_weight_budget_gb", "0.0625"),
        ];
        args.extend_from_slice(extra);
        ddo_compose::open(SessionSpec {
            plan: resolve(&args),
            weights: host_weights(40),
            tree: None,
        })
    };
    let limited = open(&[]).unwrap();
    let s = setup(&limited);
    let (registered, unregistered) = (s.registered_bytes.unwrap(), s.unregistered_bytes.unwrap());
    assert!(registered > 60 << 20 && registered <= 64 << 20 && unregistered > 0, "{s:?}");
    assert!(s.unregistered_reason.unwrap().contains("registration"));
    let strict = open(&[("allow_pin_memory_fallback", "false")]).unwrap_err();
    assert!(strict.to_string().contains("registration"), "{strict}");
}

#[test]
fn the_resident_budget_keeps_blocks_on_the_device() {
    // Three slots of one 4 MiB block each, plus the resident budget.
    let three = ("prefetch_depth", "2");
    let none = linear(&[three]).unwrap();
    assert_eq!(setup(&none).resident_units, Some(1), "only the pinned rest");
    let some = linear(&[three, ("resident_module_budget_gb", "0.008")]).unwrap();
    assert_eq!(setup(&some).resident_units, Some(3), "two 4 MiB blocks beside the rest");
    run_and_check(&some, 2, &checkpoint_bytes(6));
    // Headroom is kept free inside the budget: one block fewer stays resident.
    let headroom = linear(&[
        three,
        ("resident_module_budget_gb", "0.008"),
        ("auto_vram_headroom_gb", "0.004"),
    ])
    .unwrap();
    assert_eq!(setup(&headroom).resident_units, Some(2));
    let s = setup(&headroom);
    assert_eq!(s.headroom_bytes, Some((0.004f64 * (1u64 << 30) as f64) as u64));
}

/// A checkpoint mapped privately, as frameworks load one lazily: tensors are views into it.
struct PrivateMapping(memmap2::MmapMut);
impl std::fmt::Debug for PrivateMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PrivateMapping")
    }
}
// SAFETY: the mapping is owned by the value, never moves, and is only written before it is
// shared (the test's framework write happens before the session sees it).
unsafe impl HostRegion for PrivateMapping {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

fn lazily_loaded(path: &Path, write: bool) -> Weights {
    let checkpoint = ddo_source::Checkpoint::open(path).unwrap();
    let file = std::fs::File::open(path).unwrap();
    // SAFETY: the test's checkpoint is not modified while mapped; the mapping is private.
    let mut map = unsafe { memmap2::MmapOptions::new().map_copy(&file) }.unwrap();
    if write {
        // A framework wrote into one weight (its page becomes a private copy).
        let s = &checkpoint.slices()[1];
        map[s.offset as usize] = 0xEE;
    }
    let storage = HostSlice::whole(Arc::new(PrivateMapping(map)) as Arc<dyn HostRegion>);
    let tensors = checkpoint
        .slices()
        .iter()
        .map(|s| HostTensor {
            name: s.name.clone(),
            dtype: s.dtype,
            shape: s.shape.clone(),
            storage: 0,
            offset: s.offset,
        })
        .collect();
    // SAFETY: the test's checkpoint is not modified while mapped.
    Weights::Host { storages: vec![storage], tensors, mmap: unsafe { MmapChoice::auto() } }
}

#[test]
fn a_block_adjacent_in_its_file_uploads_in_one_copy() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 6);
    // Each norm (2 KiB) is small, but it lies next to its block's weight in the file: moving it
    // into a pack would split the block's one copy in two.
    let session = ddo_compose::open(SessionSpec {
        plan: resolve(&[("backend", "linear"), ("small_tensor_threshold_kb", "4")]),
        weights: lazily_loaded(&path, false),
        tree: None,
    })
    .unwrap();
    assert_eq!(setup(&session).packed_bytes, Some(0));
    run_and_check(&session, 2, &checkpoint_bytes(6));
    let rt = session.metrics(None).runtime;
    assert!(rt.uploads.unwrap() >= 12, "{rt:?}");
    // One copy per block; the resident rest (embed first, norm_out last in the file) takes two.
    assert_eq!(rt.upload_copies, Some(rt.uploads.unwrap() + 1), "{rt:?}");
    // Separate storages hold nothing adjacent: there the norms are packed, two copies a block.
    let separate = linear(&[("small_tensor_threshold_kb", "4")]).unwrap();
    run_and_check(&separate, 2, &checkpoint_bytes(6));
    let rt = separate.metrics(None).runtime;
    assert_eq!(rt.upload_copies, Some(2 * rt.uploads.unwrap()), "{rt:?}");
}

#[test]
fn tensors_in_a_private_file_mapping_are_served_from_a_shared_mapping_of_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 6);
    let plan = || resolve(&[("backend", "linear"), ("small_tensor_threshold_kb", "0")]);
    let clean = ddo_compose::open(SessionSpec {
        plan: plan(),
        weights: lazily_loaded(&path, false),
        tree: None,
    })
    .unwrap();
    let s = setup(&clean);
    assert_eq!(s.host_source.as_deref(), Some("host_tensors+file"));
    assert!(s.registered_bytes.unwrap() > 0 && s.unregistered_bytes == Some(0), "{s:?}");
    run_and_check(&clean, 2, &checkpoint_bytes(6));
    // A written page stays private: served in place, never page-locked, bytes still right.
    let written = ddo_compose::open(SessionSpec {
        plan: plan(),
        weights: lazily_loaded(&path, true),
        tree: None,
    })
    .unwrap();
    let s = setup(&written);
    assert_eq!(s.registered_bytes, Some(0), "{s:?}");
    assert!(s.unregistered_reason.clone().unwrap().contains("private file mapping"), "{s:?}");
    // The written byte is what the device gets, not the file's.
    written.begin_pass(S).unwrap();
    let unit = written.units().unwrap().into_iter().find(|u| u.name == "blocks.0").unwrap();
    let lease = written.acquire(unit.id, S).unwrap();
    let got = written.read_tensor("blocks.0.attn.weight").unwrap();
    let mut want = checkpoint_bytes(6)("blocks.0.attn.weight");
    want[0] = 0xEE;
    assert_eq!(got, want);
    written.release(lease, S).unwrap();
    written.end_pass(S).unwrap();
}

#[test]
fn execution_device_is_validated() {
    let plan = resolve(&[("backend", "linear")]);
    let mut plan = plan;
    plan.settings.execution_device = "abc".into();
    let err =
        ddo_compose::open(SessionSpec { plan, weights: host_weights(2), tree: None }).unwrap_err();
    assert_eq!(
        err.to_string(),
        "execution_device: \"abc\" is not a device; use cuda, cuda:N or cpu"
    );
}

#[test]
fn a_view_handed_out_keeps_its_memory_after_unload() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 4);
    let session = native(&path, &[]).unwrap();
    run_and_check(&session, 1, &checkpoint_bytes(4));
    let view = session.tensor("embed.weight").unwrap();
    assert!(!session.unload().unwrap(), "the view holds the memory");
    assert!(session.is_unloaded());
    // SAFETY: `view.owner` keeps the attach's host-backend memory mapped; the resident unit's
    // bytes were uploaded before unload and nothing writes them.
    let bytes = unsafe { std::slice::from_raw_parts(view.address as *const u8, view.len as usize) };
    assert_eq!(bytes, &checkpoint_bytes(4)("embed.weight")[..]);
    drop(view);
    // The session attaches again with fresh memory; without views, unload frees at once.
    session.reload().unwrap();
    run_and_check(&session, 1, &checkpoint_bytes(4));
    assert!(session.unload().unwrap());
}

#[test]
fn the_budget_changes_between_passes_keeping_the_source_and_registrations() {
    budget_changes("cpu");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn on_cuda_the_budget_changes_between_passes_keeping_the_source_and_registrations() {
    budget_changes("cuda:0");
}

fn budget_changes(device: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 8);
    let session = native(&path, &[("execution_device", device)]).unwrap();
    let before = setup(&session);
    run_and_check(&session, 1, &checkpoint_bytes(8));
    let first = session.metrics(None).runtime;
    // Everything fits in 1 GiB: nothing streams any more, the bytes are the same.
    assert!(session.set_budget(1 << 30).unwrap());
    // The attach's counters go on across the new arena.
    let carried = session.metrics(None).runtime;
    assert_eq!(carried.passes, first.passes);
    // The new arena uploaded its resident units on top of the first pass's uploads.
    assert!(carried.uploads > first.uploads && carried.upload_bytes > first.upload_bytes);
    assert!(carried.peak_bytes >= first.peak_bytes);
    let large = setup(&session);
    assert_eq!((large.gpu_budget_bytes, large.headroom_bytes), (Some(1 << 30), Some(0)));
    assert_eq!(large.streamed_units, Some(0));
    assert_eq!(large.registered_bytes, before.registered_bytes, "registrations are kept");
    assert_eq!(session.units().unwrap().iter().filter(|u| u.resident).count(), 9);
    run_and_check(&session, 2, &checkpoint_bytes(8));
    assert_eq!(session.metrics(None).runtime.passes, first.passes.map(|p| p + 2));
    // A budget below two slots is refused, and the arena is planned again under the last one.
    let err = session.set_budget(1 << 20).unwrap_err();
    assert!(matches!(err, SessionError::Capacity { .. }), "{err}");
    assert_eq!(setup(&session).gpu_budget_bytes, Some(1 << 30));
    run_and_check(&session, 1, &checkpoint_bytes(8));
    // Refused inside a pass; a no-op while a view holds the arena's memory.
    session.begin_pass(S).unwrap();
    let err = session.set_budget(before.gpu_budget_bytes.unwrap()).unwrap_err();
    assert!(err.to_string().contains("between passes"), "{err}");
    session.end_pass(S).unwrap();
    let view = session.tensor("embed.weight").unwrap();
    assert!(!session.set_budget(before.gpu_budget_bytes.unwrap()).unwrap());
    drop(view);
    // Back to the first budget: blocks stream again, and a reload keeps the budget set.
    assert!(session.set_budget(before.gpu_budget_bytes.unwrap()).unwrap());
    assert_eq!(setup(&session).streamed_units, before.streamed_units);
    session.unload().unwrap();
    session.reload().unwrap();
    assert_eq!(setup(&session).gpu_budget_bytes, before.gpu_budget_bytes);
    assert_eq!(setup(&session).headroom_bytes, Some(0));
    run_and_check(&session, 2, &checkpoint_bytes(8));
    session.unload().unwrap();
    let err = session.set_budget(1 << 30).unwrap_err();
    assert!(err.to_string().contains("unloaded"), "{err}");
}

// ---- dtype conversion at load ----------------------------------------------------------------

/// The tree of [`testing::write_blocks`]'s tensors with every parameter declared `dtype`.
fn tree_of(path: &Path, dtype: Dtype) -> ddo_arena::ModuleTree {
    let c = ddo_source::Checkpoint::open(path).unwrap();
    let mut tree =
        ddo_arena::ModuleTree::from_tensor_names(c.slices().iter().map(|s| s.name.as_str()));
    for p in &mut tree.parameters {
        let s = &c.slices()[c.find(&p.name).unwrap()];
        p.dtype = Some(dtype);
        p.shape = Some(s.shape.clone());
    }
    tree
}

fn converted(
    path: &Path,
    dtype: Dtype,
    extra: &[(&str, &str)],
) -> Result<ComponentSession, SessionError> {
    native_with(path, extra, Some(tree_of(path, dtype)))
}

#[test]
fn a_checkpoint_in_another_dtype_streams_converted_to_the_parameters_dtype() {
    conversion_streams_converted_bytes("cpu");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn on_cuda_a_checkpoint_in_another_dtype_streams_converted_to_the_parameters_dtype() {
    conversion_streams_converted_bytes("cuda:0");
}

fn conversion_streams_converted_bytes(device: &str) {
    let dir = tempfile::tempdir().unwrap();
    // fp32 weights loaded as bf16, and bf16 weights upcast to fp32 (modules kept in fp32).
    let f32_path = dir.path().join("f32.safetensors");
    let mut names = vec![("embed.weight".to_owned(), vec![W, 8])];
    for b in 0..6 {
        names.push((format!("blocks.{b}.attn.weight"), vec![W, W / 2]));
        names.push((format!("blocks.{b}.norm.weight"), vec![W]));
    }
    names.push(("norm_out.weight".into(), vec![W]));
    // Bytes that make every kind of f32 (including NaN and infinities) over the tensors.
    let byte = |t: usize, i: u64| ((t as u64 * 131 + i * 7 + i / 4) % 256) as u8;
    testing::write_dtype(&f32_path, Dtype::F32, &names, byte).unwrap();
    let bf16_path = checkpoint(dir.path(), 6);
    let fp8_path = dir.path().join("fp8.safetensors");
    testing::write_dtype(&fp8_path, Dtype::F8E4M3, &names, byte).unwrap();
    // Columns: read backend, retained windows (vmm_source_cache_gb, which hold no converted
    // tensor), dtype_conversion, where conversion happens.
    // The last two rows take the disk route, where `auto` converts on the device whatever the
    // direction (host memory stays within the staging).
    for (path, from, to, read, cache, site, at, preset) in [
        (&fp8_path, Dtype::F8E4M3, Dtype::BF16, "mmap", "0", "auto", "device", "auto"),
        (&fp8_path, Dtype::F8E4M3, Dtype::F32, "mmap", "0", "host", "host", "auto"),
        (&f32_path, Dtype::F32, Dtype::BF16, "pread", "0", "auto", "host", "auto"),
        (&f32_path, Dtype::F32, Dtype::F16, "mmap", "0", "auto", "host", "auto"),
        (&f32_path, Dtype::F32, Dtype::BF16, "mmap", "0", "device", "device", "auto"),
        (&bf16_path, Dtype::BF16, Dtype::F32, "mmap", "0", "host", "host", "auto"),
        (&bf16_path, Dtype::BF16, Dtype::F32, "pread", "0", "auto", "device", "auto"),
        (&f32_path, Dtype::F32, Dtype::BF16, "pread", "1", "auto", "host", "auto"),
        (&f32_path, Dtype::F32, Dtype::BF16, "pread", "0", "auto", "device", "nvme_baseline"),
        (&bf16_path, Dtype::BF16, Dtype::F32, "pread", "0", "auto", "device", "nvme_baseline"),
    ] {
        let extra = [
            ("preset", preset),
            ("load_safetensors_backend", read),
            ("execution_device", device),
            ("vmm_source_cache_gb", cache),
            ("dtype_conversion", site),
            // Room for the two staging buffers of stored bytes converted on the device.
            ("vmm_resident_weight_budget_gb", "0.03"),
        ];
        let session = converted(path, to, &extra).unwrap();
        let s = setup(&session);
        let case = format!("{from:?} -> {to:?} ({site}, preset {preset})");
        let route = if preset == "nvme_baseline" { "vmm_runtime" } else { "vmm_fast_runtime" };
        assert_eq!(session.route().name(), route, "{case}");
        assert_eq!(s.conversion.as_deref(), Some(at), "{case}");
        if cache != "0" {
            assert_eq!(s.host_source.as_deref(), Some("retained"));
            assert_eq!((s.retained_bytes, s.unretained_bytes), (Some(0), Some(0)), "{s:?}");
        }
        let c = ddo_source::Checkpoint::open(path).unwrap();
        let n = c.slices().len() as u64;
        assert_eq!(s.converted_tensors, Some(n), "every tensor: {case}");
        let ratio = to.size_bytes() as f64 / from.size_bytes() as f64;
        if at == "host" {
            let (src, out) = (s.conversion_source_bytes.unwrap(), s.converted_bytes.unwrap());
            assert_eq!(out as f64, src as f64 * ratio);
            assert!(s.conversion_seconds.unwrap() > 0.0);
            assert_eq!(s.device_converted_tensors, None);
        } else {
            assert_eq!(s.device_converted_tensors, Some(n), "{case}");
            assert_eq!(s.conversion_source_bytes, None, "nothing converted at load: {case}");
        }
        assert!(
            session.metrics(None).format_profile().contains(&format!("conversion=at={at}")),
            "{case}"
        );
        let source =
            ddo_source::CheckpointSource::new(c.into(), ddo_source::ReadOptions::default())
                .unwrap();
        let expect = |name: &str| {
            use ddo_core::WeightSource;
            let i = source.slices().iter().position(|t| t.name == name).unwrap();
            let mut raw = vec![0; source.slices()[i].len as usize];
            source.read(i, &mut raw).unwrap();
            let mut want = vec![0; (raw.len() as f64 * ratio) as usize];
            ddo_source::convert(from, to, &raw, &mut want);
            want
        };
        // On a GPU a NaN widens to the device's NaN.
        let nan_payloads = (at == "device").then_some(to);
        run_and_compare(&session, 2, &expect, nan_payloads);
        let rt = session.metrics(None).runtime;
        if at == "device" {
            // Every upload converts its unit's tensors (two per block).
            assert!(rt.device_conversions.unwrap() >= 2 * rt.uploads.unwrap() - 2, "{rt:?}");
        } else {
            assert_eq!(rt.device_conversions, Some(0), "{case}");
        }
        // Outside a pass, the source's view is converted too.
        assert_eq!(session.source_tensor("embed.weight").unwrap(), expect("embed.weight"));
        // Reload converts again, to the same bytes.
        assert!(session.unload().unwrap());
        session.reload().unwrap();
        run_and_compare(&session, 1, &expect, nan_payloads);
    }
}

#[test]
fn a_budget_without_room_for_staging_widens_on_the_host_instead() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 6);
    let host = [("dtype_conversion", "host"), ("vmm_resident_weight_budget_gb", "0.0001")];
    let e = converted(&path, Dtype::F32, &host).unwrap_err().to_string();
    // The least budget that converting on the host needs, from what the error says.
    let mib: f64 =
        e.split("need at least ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    let budget = format!("{}", mib / 1024.0);
    let session =
        converted(&path, Dtype::F32, &[("vmm_resident_weight_budget_gb", budget.as_str())])
            .unwrap();
    let s = setup(&session);
    assert_eq!(s.conversion.as_deref(), Some("host"), "{s:?}");
    assert!(s.warnings.unwrap().iter().any(|w| w.contains("no room for the staging buffers")));
    // With room for them, widening runs on the device.
    let more = format!("{}", (mib + 8.0) / 1024.0);
    let session =
        converted(&path, Dtype::F32, &[("vmm_resident_weight_budget_gb", more.as_str())]).unwrap();
    assert_eq!(setup(&session).conversion.as_deref(), Some("device"));
}

#[test]
fn a_dtype_ddo_does_not_convert_is_refused_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 4);
    let e = converted(&path, Dtype::I16, &[]).unwrap_err();
    let text = e.to_string();
    assert!(text.contains("ddo converts between F32, F16 and BF16"), "{text}");
    assert!(text.contains("torch_dtype"), "{text}");
}

#[test]
fn scaled_fp8_weights_are_refused_unless_the_module_takes_their_scales() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("scaled.safetensors");
    let names = vec![
        ("blocks.0.attn.weight".to_owned(), vec![W, W / 2]),
        ("blocks.0.attn.scale_weight".to_owned(), vec![1]),
        ("blocks.1.attn.weight".to_owned(), vec![W, W / 2]),
    ];
    testing::write_dtype(&path, Dtype::F8E4M3, &names, |_, i| (i % 100) as u8).unwrap();
    let mut tree = tree_of(&path, Dtype::BF16);
    tree.parameters.retain(|p| !p.name.ends_with("scale_weight"));
    let e = native_with(&path, &[], Some(tree.clone())).unwrap_err().to_string();
    assert!(e.contains("scale tensors (blocks.0.attn.scale_weight)"), "{e}");
    assert!(e.contains("refuses to serve them unscaled"), "{e}");
    // The other layouts' names: weight_scale / input_scale, weight_scale_inv.
    for name in ["weight_scale", "input_scale", "weight_scale_inv"] {
        let other = dir.path().join(format!("{name}.safetensors"));
        let mut names = names.clone();
        names[1].0 = format!("blocks.0.attn.{name}");
        testing::write_dtype(&other, Dtype::F8E4M3, &names, |_, i| (i % 100) as u8).unwrap();
        let mut tree = tree_of(&other, Dtype::BF16);
        tree.parameters.retain(|p| !p.name.ends_with(name));
        let e = native_with(&other, &[], Some(tree)).unwrap_err().to_string();
        assert!(e.contains(&format!("scale tensors (blocks.0.attn.{name})")), "{e}");
    }
    // A module that declares the scales (its math applies them) streams the fp8 bytes as they are.
    let session = native_with(&path, &[], Some(tree_of(&path, Dtype::F8E4M3))).unwrap();
    assert_eq!(setup(&session).conversion, None);
    let c = ddo_source::Checkpoint::open(&path).unwrap();
    let source =
        ddo_source::CheckpointSource::new(c.into(), ddo_source::ReadOptions::default()).unwrap();
    use ddo_core::WeightSource;
    session.begin_pass(S).unwrap();
    for unit in session.units().unwrap().iter().filter(|u| !u.pinned) {
        let lease = session.acquire(unit.id, S).unwrap();
        for (i, t) in source.slices().iter().enumerate() {
            if t.name.starts_with(&format!("{}.", unit.name)) {
                let mut raw = vec![0; t.len as usize];
                source.read(i, &mut raw).unwrap();
                assert_eq!(session.read_tensor(&t.name).unwrap(), raw, "{}", t.name);
            }
        }
        session.release(lease, S).unwrap();
    }
    session.end_pass(S).unwrap();
}

#[test]
fn a_byte_parameter_takes_a_tensor_as_rows_of_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 3);
    let mut tree = tree_of(&path, Dtype::BF16);
    let last = |p: &mut ddo_arena::ParameterRef, extra: u64| {
        let shape = p.shape.as_mut().unwrap();
        *shape.last_mut().unwrap() = *shape.last().unwrap() * 2 + extra;
        p.dtype = Some(Dtype::U8);
    };
    last(&mut tree.parameters[1], 0);
    let session = native_with(&path, &[], Some(tree.clone())).unwrap();
    let view = session.tensor(&tree.parameters[1].name).unwrap();
    assert_eq!(
        view.dtype,
        Dtype::BF16,
        "the view is the stored tensor; the framework reinterprets it"
    );
    run_and_check(&session, 1, &checkpoint_bytes(3));
    drop(session);
    last(&mut tree.parameters[1], 1);
    let e = native_with(&path, &[], Some(tree)).unwrap_err().to_string();
    assert!(e.contains("but the checkpoint stores BF16"), "{e}");
}

#[test]
fn a_mapped_file_is_registered_only_where_its_served_tensors_lie() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 6);
    // The framework converted the blocks' weights into memory of its own; only the rest (the
    // norms, the embedding) are still views into its mapping of the file.
    let Weights::Host { mut storages, mut tensors, mmap } = lazily_loaded(&path, false) else {
        unreachable!()
    };
    let expect = checkpoint_bytes(6);
    for t in tensors.iter_mut().filter(|t| t.name.ends_with("attn.weight")) {
        storages.push(HostSlice::whole(
            Arc::new(HostBytes::from(expect(&t.name))) as Arc<dyn HostRegion>
        ));
        t.storage = storages.len() - 1;
        t.offset = 0;
    }
    let session = ddo_compose::open(SessionSpec {
        plan: resolve(&[("backend", "linear"), ("small_tensor_threshold_kb", "0")]),
        weights: Weights::Host { storages, tensors, mmap },
        tree: None,
    })
    .unwrap();
    let s = setup(&session);
    assert_eq!(s.host_source.as_deref(), Some("host_tensors+file"));
    let file = std::fs::metadata(&path).unwrap().len();
    let weights = 6 * W * W * 2;
    // The weights' own buffers, plus pages around the norms and embedding: not the whole file.
    let registered = s.registered_bytes.unwrap();
    assert!(
        registered >= weights && registered < weights + file / 2,
        "{registered} of {file}: {s:?}"
    );
    run_and_check(&session, 2, &expect);
}

#[test]
fn weights_around_a_tensor_converted_at_load_upload_in_one_copy() {
    weights_around_a_converted_tensor("cpu");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn on_cuda_weights_around_a_tensor_converted_at_load_upload_in_one_copy() {
    weights_around_a_converted_tensor("cuda:0");
}

fn weights_around_a_converted_tensor(device: &str) {
    // A quantized checkpoint's pattern: in each block, two weights served as stored with an
    // fp32 norm between them that converts to bf16 at load (served from converted memory).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mixed.safetensors");
    let mut names = vec![("embed.weight".to_owned(), Dtype::BF16, vec![W, 8])];
    for b in 0..6 {
        names.push((format!("blocks.{b}.attn.weight"), Dtype::BF16, vec![W, W / 2]));
        names.push((format!("blocks.{b}.norm.weight"), Dtype::F32, vec![8 * W]));
        names.push((format!("blocks.{b}.proj.weight"), Dtype::BF16, vec![W, W / 2]));
    }
    names.push(("norm_out.weight".into(), Dtype::F32, vec![W]));
    let byte = |t: usize, i: u64| ((t as u64 * 29 + i * 3 + i / 7) % 256) as u8;
    testing::write_typed(&path, &names, byte).unwrap();
    let c = ddo_source::Checkpoint::open(&path).unwrap();
    let source =
        ddo_source::CheckpointSource::new(c.into(), ddo_source::ReadOptions::default()).unwrap();
    let expect = |name: &str| {
        use ddo_core::WeightSource;
        let i = source.slices().iter().position(|t| t.name == name).unwrap();
        let s = &source.slices()[i];
        let mut raw = vec![0; s.len as usize];
        source.read(i, &mut raw).unwrap();
        if s.dtype == Dtype::BF16 {
            return raw;
        }
        let mut want = vec![0; raw.len() / 2];
        ddo_source::convert(s.dtype, Dtype::BF16, &raw, &mut want);
        want
    };
    // Mapped (the registered runs span the norms), retained windows (which hold no norm), reads.
    for (read, cache) in [("mmap", "0"), ("mmap", "1"), ("pread", "0")] {
        let extra = [
            ("load_safetensors_backend", read),
            ("vmm_source_cache_gb", cache),
            ("execution_device", device),
        ];
        let session = converted(&path, Dtype::BF16, &extra).unwrap();
        assert_eq!(setup(&session).conversion.as_deref(), Some("host"), "{read} {cache}");
        for _ in 0..2 {
            session.begin_pass(S).unwrap();
            for unit in session.units().unwrap().iter().filter(|u| !u.pinned) {
                let lease = session.acquire(unit.id, S).unwrap();
                for suffix in ["attn.weight", "norm.weight", "proj.weight"] {
                    let name = format!("{}.{suffix}", unit.name);
                    assert_eq!(
                        session.read_tensor(&name).unwrap(),
                        expect(&name),
                        "{name} {read} {cache}"
                    );
                }
                session.release(lease, S).unwrap();
            }
            for name in ["embed.weight", "norm_out.weight"] {
                assert_eq!(session.read_tensor(name).unwrap(), expect(name), "{name}");
            }
            session.end_pass(S).unwrap();
        }
        let rt = session.metrics(None).runtime;
        if cache == "0" && read == "mmap" {
            // The weights and the 32 KiB between them, then the converted norm: two copies per
            // block; the resident unit's embedding and norm are two as well.
            assert_eq!(rt.upload_copies, Some(2 * rt.uploads.unwrap()), "{rt:?}");
        }
        if cache == "1" {
            // Windows hold the weights, not the stored norms between them: a copy per weight
            // from its window (not a read of the whole span), one for the converted norm.
            assert_eq!(rt.upload_copies, Some(3 * rt.uploads.unwrap() - 1), "{rt:?}");
        }
    }
}

// ---- entropy-coded streaming -------------------------------------------------------------------

#[test]
fn encoded_streaming_serves_the_checkpoints_bytes() {
    encoded_streaming("cpu");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn on_cuda_encoded_streaming_serves_the_checkpoints_bytes() {
    encoded_streaming("cuda:0");
}

fn encoded_streaming(device: &str) {
    let every = [("on", "0"), ("auto", "0"), ("auto", "1"), ("off", "0")];
    encoded_streaming_of(device, Dtype::BF16, &every);
    // fp16 encodes through the same split of bits.
    encoded_streaming_of(device, Dtype::F16, &every[..2]);
}

fn encoded_streaming_of(device: &str, dtype: Dtype, modes: &[(&str, &str)]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.safetensors");
    let mut names = vec![("embed.weight".to_owned(), vec![1024, 8])];
    for b in 0..6 {
        names.push((format!("blocks.{b}.attn.weight"), vec![2048, 1024]));
        names.push((format!("blocks.{b}.norm.weight"), vec![1024]));
    }
    names.push(("norm_out.weight".into(), vec![1024]));
    // Weight-like: a few exponents (high bytes near 0x3c), random mantissas and signs.
    let hash =
        |t: usize, i: u64| (t as u64 * 0x9e37_79b9 + i).wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
    let byte = |t: usize, i: u64| {
        let h = hash(t, i / 2);
        if i.is_multiple_of(2) {
            h as u8
        } else {
            (0x3b + (h >> 8) % 3) as u8 | (((h >> 12) & 1) << 7) as u8
        }
    };
    testing::write_dtype(&path, dtype, &names, byte).unwrap();
    let expect = stored_bytes(&path);
    for &(mode, cache) in modes {
        let extra = [
            ("execution_device", device),
            ("vmm_weight_encoding", mode),
            ("vmm_source_cache_gb", cache),
            ("vmm_resident_weight_budget_gb", "0.02"),
        ];
        let session = native_with(&path, &extra, None).unwrap();
        if mode != "off" && device != "cpu" {
            // Where the link is measured, passes stream raw while auto times them (these, with
            // no compute, run at their copy floor: transfer-bound) and while the encodings are
            // written in the background; the switch is due once the file is complete.
            if mode == "auto" {
                let note = setup(&session).weight_encoding.unwrap();
                assert!(note.contains("while passes are timed"), "{note}");
            }
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
            while !session.encoding_switch_due() && std::time::Instant::now() < deadline {
                session.begin_pass(S).unwrap();
                for unit in session.units().unwrap() {
                    let lease = session.acquire(unit.id, S).unwrap();
                    session.release(lease, S).unwrap();
                }
                session.end_pass(S).unwrap();
            }
            if session.encoding_switch_due() {
                assert!(session.switch_encoding().unwrap());
            }
            let note = setup(&session).weight_encoding.unwrap();
            if mode == "auto" {
                assert!(note.contains("transfer-bound"), "{note}");
            }
        }
        let s = setup(&session);
        let case = format!("{dtype:?}, {mode}, cache {cache}: {s:?}");
        assert!(s.streamed_units.unwrap() >= 2, "{case}");
        run_and_compare(&session, 3, &expect, None);
        let rt = session.metrics(None).runtime;
        if mode == "off" {
            assert_eq!(s.weight_encoding.as_deref(), Some("off"));
            assert_eq!((s.encoded_tensors, rt.device_decodes), (None, Some(0)), "{case}");
            continue;
        }
        // The six 4 MiB matrices (of the streamed units under auto) are encoded, to ~2/3.
        let n = s.encoded_tensors.unwrap();
        assert!(if mode == "on" { n == 6 } else { (2..=6).contains(&n) }, "{case}");
        let ratio = s.encoded_bytes.unwrap() as f64 / s.encoding_source_bytes.unwrap() as f64;
        assert!(ratio < 0.8, "{ratio} {case}");
        assert!(s.weight_encoding.as_deref().unwrap().starts_with(mode), "{case}");
        assert!(rt.device_decodes.unwrap() > 0, "{rt:?}");
        assert!(rt.encoded_upload_bytes.unwrap() < rt.decoded_bytes.unwrap(), "{rt:?}");
        assert!(rt.decode_seconds.unwrap() > 0.0, "{rt:?}");
        let profile = session.metrics(None).format_profile();
        assert!(profile.contains("encoding=mode=") && profile.contains("decodes="), "{profile}");
        // Unload and reload encode again, to the same bytes.
        assert!(session.unload().unwrap());
        session.reload().unwrap();
        run_and_compare(&session, 1, &expect, None);
    }
}

// ---- encoded files -------------------------------------------------------------------------------

/// Writes a checkpoint of six weight-like 2 MiB bf16 matrices in blocks (bytes drawn from
/// `seed`); gives its bytes as read.
fn weight_like(path: &Path, seed: u64) -> impl Fn(&str) -> Vec<u8> + use<> {
    let mut names = vec![("embed.weight".to_owned(), vec![1024, 8])];
    for b in 0..6 {
        names.push((format!("blocks.{b}.attn.weight"), vec![1024, 1024]));
        names.push((format!("blocks.{b}.norm.weight"), vec![1024]));
    }
    names.push(("norm_out.weight".into(), vec![1024]));
    let byte = |t: usize, i: u64| {
        let h = ((seed + t as u64) * 0x9e37_79b9 + i / 2).wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
        if i.is_multiple_of(2) {
            h as u8
        } else {
            (0x3b + (h >> 8) % 3) as u8 | (((h >> 12) & 1) << 7) as u8
        }
    };
    testing::write_dtype(path, Dtype::BF16, &names, byte).unwrap();
    bytes_of(path)
}

/// The bytes of the checkpoint at `path` as read.
fn bytes_of(path: &Path) -> impl Fn(&str) -> Vec<u8> + use<> {
    let source = ddo_source::CheckpointSource::new(
        ddo_source::Checkpoint::open(path).unwrap().into(),
        ddo_source::ReadOptions::default(),
    )
    .unwrap();
    move |name: &str| {
        use ddo_core::WeightSource;
        let i = source.slices().iter().position(|t| t.name == name).unwrap();
        let mut raw = vec![0; source.slices()[i].len as usize];
        source.read(i, &mut raw).unwrap();
        raw
    }
}

/// The native route encoding every unit, its encoded files in `folder`.
fn with_encoded_files(path: &Path, folder: &Path) -> ComponentSession {
    let extra =
        [("vmm_weight_encoding", "on"), ("vmm_encoded_cache_dir", folder.to_str().unwrap())];
    native_with(path, &extra, None).unwrap()
}

/// The encoding line of the profile.
fn encoding_note(session: &ComponentSession) -> String {
    setup(session).weight_encoding.unwrap()
}

#[test]
fn an_encoded_file_is_written_once_and_read_while_the_checkpoint_is_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.safetensors");
    let expect = weight_like(&path, 0);
    let folder = dir.path().join("encoded");
    // The first load encodes and writes the file.
    let first = with_encoded_files(&path, &folder);
    let s = setup(&first);
    let file = PathBuf::from(s.encoded_file.clone().unwrap());
    assert_eq!(file.parent(), Some(folder.as_path()));
    let note = encoding_note(&first);
    assert!(
        note.ends_with(&format!("; encoded (encoded file {} written)", file.display())),
        "{note}"
    );
    assert!(s.encoding_seconds.unwrap() > 0.0, "{s:?}");
    run_and_compare(&first, 2, &expect, None);
    let written = std::fs::metadata(&file).unwrap().modified().unwrap();
    let rt = first.metrics(None).runtime;
    first.close().unwrap();
    // The next one reads it: nothing is encoded, and the same bytes stream.
    let second = with_encoded_files(&path, &folder);
    let r = setup(&second);
    let note = encoding_note(&second);
    assert!(note.ends_with(&format!("; read from {}", file.display())), "{note}");
    assert_eq!(r.encoded_file.as_deref(), s.encoded_file.as_deref());
    assert_eq!(r.encoding_seconds, Some(0.0));
    assert_eq!(
        (r.encoded_tensors, r.encoded_bytes, r.encoding_source_bytes),
        (s.encoded_tensors, s.encoded_bytes, s.encoding_source_bytes)
    );
    assert_eq!(s.encoded_tensors, Some(6));
    run_and_compare(&second, 2, &expect, None);
    let rt2 = second.metrics(None).runtime;
    assert_eq!(
        (rt2.decoded_bytes, rt2.encoded_upload_bytes, rt2.device_decodes),
        (rt.decoded_bytes, rt.encoded_upload_bytes, rt.device_decodes)
    );
    let profile = second.metrics(None).format_profile();
    assert!(profile.contains(&format!("file={}", file.display())), "{profile}");
    assert_eq!(std::fs::metadata(&file).unwrap().modified().unwrap(), written);
    // Reload maps it again.
    assert!(second.unload().unwrap());
    second.reload().unwrap();
    assert!(encoding_note(&second).contains("; read from "));
    run_and_compare(&second, 1, &expect, None);
    second.close().unwrap();
    // A checkpoint touched since is encoded again, and the file written again.
    let f = std::fs::File::options().write(true).open(&path).unwrap();
    f.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(10)).unwrap();
    drop(f);
    let expect = bytes_of(&path);
    let third = with_encoded_files(&path, &folder);
    let note = encoding_note(&third);
    let changed =
        format!("re-encoded: the checkpoint changed since {} was written", file.display());
    assert!(note.contains(&changed) && note.ends_with("(written again)"), "{note}");
    assert!(setup(&third).encoding_seconds.unwrap() > 0.0);
    run_and_compare(&third, 1, &expect, None);
    third.close().unwrap();
    let fourth = with_encoded_files(&path, &folder);
    assert!(encoding_note(&fourth).contains("; read from "), "{}", encoding_note(&fourth));
    run_and_compare(&fourth, 1, &expect, None);
    fourth.close().unwrap();
    // A checkpoint whose bytes changed is encoded again.
    let expect = weight_like(&path, 1);
    let fifth = with_encoded_files(&path, &folder);
    assert!(encoding_note(&fifth).contains(&changed), "{}", encoding_note(&fifth));
    run_and_compare(&fifth, 1, &expect, None);
}

/// CRC-32 (IEEE), as encoded files checksum their header.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xedb8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

#[test]
fn a_damaged_truncated_or_other_version_encoded_file_is_never_used() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.safetensors");
    let expect = weight_like(&path, 0);
    let folder = dir.path().join("encoded");
    let first = with_encoded_files(&path, &folder);
    let file = PathBuf::from(setup(&first).encoded_file.unwrap());
    first.close().unwrap();
    let good = std::fs::read(&file).unwrap();
    let header_len = u64::from_le_bytes(good[8..16].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&good[24..24 + header_len]).unwrap();
    header["version"] = serde_json::json!(9);
    let mut json = serde_json::to_vec(&header).unwrap();
    json.resize(header_len, b' ');
    let mut other_version = good.clone();
    other_version[16..20].copy_from_slice(&crc32(&json).to_le_bytes());
    other_version[24..24 + header_len].copy_from_slice(&json);
    let flipped = |at: usize| {
        let mut bytes = good.clone();
        bytes[at] ^= 1;
        bytes
    };
    let shown = file.display().to_string();
    let cases: [(&str, Vec<u8>, String); 5] = [
        (
            "an encoding",
            flipped(good.len() - 100),
            format!("{shown} is damaged: the encoding of tensor"),
        ),
        (
            "the first encoding's header",
            flipped((24 + header_len).next_multiple_of(65536)),
            format!("{shown} is damaged: the encoding"),
        ),
        ("the header", flipped(40), format!("{shown} is damaged: its header's CRC-32")),
        ("truncated", good[..good.len() - 4096].to_vec(), format!("{shown} is damaged: it is")),
        ("of another version", other_version, format!("{shown} was written in format version 9")),
    ];
    for (what, bytes, why) in cases {
        std::fs::write(&file, &bytes).unwrap();
        let session = with_encoded_files(&path, &folder);
        let note = encoding_note(&session);
        assert!(note.contains(&format!("; re-encoded: {why}")), "{what}: {note}");
        assert!(note.ends_with("(written again)"), "{what}: {note}");
        run_and_compare(&session, 1, &expect, None);
        session.close().unwrap();
        // Encoding is deterministic: the file is written again as it was.
        assert!(std::fs::read(&file).unwrap() == good, "{what}");
    }
}

#[test]
fn a_folder_that_cannot_be_written_still_streams_encoded() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.safetensors");
    let expect = weight_like(&path, 0);
    // A folder inside a file cannot be made.
    let folder = path.join("encoded");
    let session = with_encoded_files(&path, &folder);
    let s = setup(&session);
    let note = encoding_note(&session);
    assert!(note.contains("could not be written"), "{note}");
    assert_eq!((s.encoded_tensors, s.encoded_file), (Some(6), None));
    run_and_compare(&session, 2, &expect, None);
    assert!(session.metrics(None).runtime.device_decodes.unwrap() > 0);
    let names: Vec<_> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["weights.safetensors"]);
}

#[test]
fn a_chosen_tensor_whose_encoding_is_not_smaller_streams_as_stored() {
    // Each block: a norm, then an incompressible 128 KiB tensor (its encoding is not smaller, so
    // it is served as stored, from pages it shares with the norm), then a weight-like matrix.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let mut names = vec![("embed.weight".to_owned(), vec![1024, 8])];
    for b in 0..6 {
        names.push((format!("blocks.{b}.norm.weight"), vec![1000]));
        names.push((format!("blocks.{b}.noise.weight"), vec![65536]));
        names.push((format!("blocks.{b}.attn.weight"), vec![2048, 1024]));
    }
    names.push(("norm_out.weight".into(), vec![1024]));
    let noise: Vec<usize> = (0..names.len()).filter(|&t| names[t].0.contains("noise")).collect();
    let byte = move |t: usize, i: u64| {
        let h = (t as u64 * 0x9e37_79b9 + i).wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
        match (noise.contains(&t), i.is_multiple_of(2)) {
            (true, _) | (false, true) => h as u8,
            (false, false) => (0x3b + (h >> 8) % 3) as u8,
        }
    };
    testing::write_dtype(&path, Dtype::BF16, &names, byte).unwrap();
    let extra = [("vmm_weight_encoding", "on"), ("vmm_resident_weight_budget_gb", "0.03")];
    let session = native_with(&path, &extra, None).unwrap();
    let s = setup(&session);
    assert!(s.streamed_units.unwrap() >= 2, "{s:?}");
    // The matrices are encoded; the noise tensors were asked for and stay as stored.
    assert_eq!(s.encoded_tensors, Some(6), "{s:?}");
    let expect = stored_bytes(&path);
    for _ in 0..2 {
        session.begin_pass(S).unwrap();
        for unit in session.units().unwrap().iter().filter(|u| !u.pinned) {
            let lease = session.acquire(unit.id, S).unwrap();
            for suffix in ["norm.weight", "noise.weight", "attn.weight"] {
                let name = format!("{}.{suffix}", unit.name);
                assert_eq!(session.read_tensor(&name).unwrap(), expect(&name), "{name}");
            }
            session.release(lease, S).unwrap();
        }
        session.end_pass(S).unwrap();
    }
}

#[test]
fn streamed_units_held_in_a_peer_store_stream_their_bytes_from_there() {
    // The host backend models every device's memory in host memory.
    peer_store("cpu", "cuda:1");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn on_cuda_streamed_units_held_in_a_peer_store_stream_their_bytes_from_there() {
    // The last GPU the driver lists: another GPU where the machine has two, else the same one.
    let last = ddo_platform::cuda::topology().unwrap().devices.len() - 1;
    peer_store("cuda:0", &format!("cuda:{last}"));
}

fn peer_store(device: &str, peer: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 8);
    let session =
        native(&path, &[("execution_device", device), ("vmm_peer_store_device", peer)]).unwrap();
    let s = setup(&session);
    let streamed = s.streamed_units.unwrap();
    assert!(streamed >= 4, "most blocks stream: {streamed}");
    assert_eq!(s.peer_store_device.as_deref(), Some(peer));
    assert_eq!(s.peer_store_units, Some(streamed), "every streamed unit is in the store");
    assert_eq!(s.peer_store_host_units, Some(0));
    // Each unit's tier: the resident ones on the device, every streamed one in the store.
    let tiers = tier_of_units(s.unit_tiers.as_deref().unwrap());
    assert_eq!(tiers.len() as u64, s.unit_count.unwrap(), "{tiers:?}");
    assert_eq!(tiers.iter().filter(|t| *t == "peer").count() as u64, streamed, "{tiers:?}");
    assert_eq!(tiers.iter().filter(|t| *t == "device").count() as u64, s.resident_units.unwrap());
    let before = session.metrics(None).runtime;
    run_and_check(&session, 3, &checkpoint_bytes(8));
    let after = session.metrics(None);
    after.validate().unwrap();
    let rt = after.runtime.clone();
    // Every upload after the fill copies from the store: the host link carries nothing more.
    assert_eq!(rt.upload_bytes, before.upload_bytes, "no host bytes cross the link");
    assert!(rt.peer_uploads.unwrap() >= 2 * streamed, "{rt:?}");
    assert!(rt.peer_upload_bytes.unwrap() > 0);
    assert!(after.format_profile().contains("peer_store=device="), "{}", after.format_profile());
    // A budget change plans the arena again and fills the store again.
    assert!(session.set_budget(s.gpu_budget_bytes.unwrap() + (1 << 20)).unwrap());
    assert_eq!(setup(&session).peer_store_units, setup(&session).streamed_units);
    run_and_check(&session, 1, &checkpoint_bytes(8));
    session.close().unwrap();

    // A store limited to two units: the rest stream from host memory, bytes as before.
    let unit = checkpoint_unit_bytes(&path);
    let limit = format!("{}", (2 * unit) as f64 / (1u64 << 30) as f64 + 1e-9);
    let session = native(
        &path,
        &[
            ("execution_device", device),
            ("vmm_peer_store_device", peer),
            ("vmm_peer_store_gb", &limit),
        ],
    )
    .unwrap();
    let s = setup(&session);
    assert_eq!(s.peer_store_units, Some(2), "{s:?}");
    assert_eq!(s.peer_store_host_units, Some(s.streamed_units.unwrap() - 2));
    let tiers = tier_of_units(s.unit_tiers.as_deref().unwrap());
    assert_eq!(tiers.iter().filter(|t| *t == "peer").count(), 2, "{tiers:?}");
    let host = s.host_source.clone().unwrap();
    assert_eq!(
        tiers.iter().filter(|t| **t == host).count() as u64,
        s.streamed_units.unwrap() - 2,
        "the rest from the host tier {host}: {tiers:?}"
    );
    let before = session.metrics(None).runtime.upload_bytes.unwrap();
    run_and_check(&session, 2, &checkpoint_bytes(8));
    assert!(
        session.metrics(None).runtime.upload_bytes.unwrap() > before,
        "the rest use the host link"
    );
    session.close().unwrap();
}

/// The tier of each unit id from a `unit_tiers` text (`device=0-2,5 peer=3-4`).
fn tier_of_units(text: &str) -> Vec<String> {
    let mut out: Vec<Option<String>> = Vec::new();
    for part in text.split(' ') {
        let (tier, runs) = part.split_once('=').expect("tier=runs");
        for run in runs.split(',') {
            let (a, b) = run.split_once('-').unwrap_or((run, run));
            for i in a.parse::<usize>().unwrap()..=b.parse::<usize>().unwrap() {
                if out.len() <= i {
                    out.resize(i + 1, None);
                }
                assert!(out[i].is_none(), "unit {i} in two tiers: {text}");
                out[i] = Some(tier.to_owned());
            }
        }
    }
    out.into_iter().map(|t| t.expect("every unit has a tier")).collect()
}

/// Device bytes of one streamed unit of `checkpoint(dir, n)` (all blocks are alike, each
/// filling its slot).
fn checkpoint_unit_bytes(path: &Path) -> u64 {
    let session = native(path, &[]).unwrap();
    setup(&session).slot_bytes.unwrap()
}

#[test]
fn a_peer_store_device_that_is_not_a_gpu_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 2);
    for bad in ["cpu", "gpu1", "cuda:x"] {
        let plan = testing::resolve_plan(&[
            ("execution_device", "cpu"),
            ("backend", "vmm"),
            ("vmm_peer_store_device", bad),
        ]);
        let err = plan.unwrap_err().to_string();
        assert!(err.contains("vmm_peer_store_device") && err.contains("cuda:N"), "{bad}: {err}");
    }
    drop(path);
}

/// Runs `passes` passes: streamed units acquired per block; the units `begin_pass` leased for
/// the pass only `reached` when `leased` (else acquired too); every block's bytes checked.
fn run_passes(session: &ComponentSession, passes: usize, leased: bool, blocks: usize) {
    let expect = checkpoint_bytes(blocks);
    for _ in 0..passes {
        let for_pass = session.begin_pass(S).unwrap();
        for unit in session.units().unwrap().iter().filter(|u| !u.pinned) {
            let lease = if leased && for_pass.contains(&unit.id) {
                session.reached(unit.id).unwrap();
                None
            } else {
                Some(session.acquire(unit.id, S).unwrap())
            };
            let name = format!("{}.attn.weight", unit.name);
            assert_eq!(session.read_tensor(&name).unwrap(), expect(&name), "{name}");
            if let Some(l) = lease {
                session.release(l, S).unwrap();
            }
        }
        session.end_pass(S).unwrap();
    }
}

#[test]
fn resident_blocks_leased_for_the_pass_prefetch_as_acquired_ones_do() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 12);
    // Room for the rest, two slots and some of the 4 MiB blocks: resident and streamed mix.
    let budget = [("vmm_resident_weight_budget_gb", "0.04"), ("prefetch_depth", "1")];
    let per_block = native(&path, &budget).unwrap();
    let for_pass = native(&path, &budget).unwrap();
    let units = per_block.units().unwrap();
    let resident: Vec<_> = units.iter().filter(|u| u.resident && !u.pinned).map(|u| u.id).collect();
    let streamed = units.iter().filter(|u| !u.resident).count();
    assert!(!resident.is_empty() && streamed >= 3, "want both kinds: {units:?}");

    run_passes(&per_block, 4, false, 12);
    run_passes(&for_pass, 4, true, 12);
    let (a, b) = (per_block.metrics(None).runtime, for_pass.metrics(None).runtime);
    assert_eq!(
        (a.uploads, a.prefetch_hits, a.prefetch_misses, a.prefetch_cancels, a.evictions),
        (b.uploads, b.prefetch_hits, b.prefetch_misses, b.prefetch_cancels, b.evictions),
        "reaching leased units must prefetch as acquiring them does"
    );
    assert!(b.prefetch_hits.unwrap() > 0 && b.prefetch_cancels == Some(0), "{b:?}");

    // What begin_pass returns is what the plan keeps resident; nothing else may be reached.
    let leased = for_pass.begin_pass(S).unwrap();
    assert_eq!(leased, resident);
    let streamed_unit = units.iter().find(|u| !u.resident).unwrap().id;
    let err = for_pass.reached(streamed_unit).unwrap_err().to_string();
    assert!(err.contains("not held by a pass lease"), "{err}");
    // The pass's leases are live until it ends: nothing frees the memory under them.
    let err = for_pass.unload().unwrap_err().to_string();
    assert!(err.contains("lease"), "{err}");
    for_pass.end_pass(S).unwrap();
    let err = for_pass.reached(resident[0]).unwrap_err().to_string();
    assert!(err.contains("not held by a pass lease"), "{err}");
    assert!(for_pass.unload().unwrap());
}

/// A lease taken with `acquire` on another stream belongs to its holder: beginning, ending or
/// aborting a pass gives back only the pass's own leases, so the pass never uploads over the
/// unit the other stream is reading, and the holder releases it itself.
#[test]
fn a_pass_boundary_leaves_another_streams_lease_live() {
    const OTHER: StreamId = StreamId(7);
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), 12);
    let budget = [("vmm_resident_weight_budget_gb", "0.04"), ("prefetch_depth", "1")];
    let session = native(&path, &budget).unwrap();
    let expect = checkpoint_bytes(12);
    let units = session.units().unwrap();
    let streamed: Vec<_> = units.iter().filter(|u| !u.resident).collect();
    assert!(streamed.len() >= 3, "want streamed units: {units:?}");
    let held = streamed[0];
    let name = format!("{}.attn.weight", held.name);
    let lease = session.acquire(held.id, OTHER).unwrap();
    for end in ["end", "abort"] {
        session.begin_pass(S).unwrap();
        // The pass runs every other streamed unit; one sharing the held unit's slot is refused.
        let mut busy = 0;
        for u in &streamed[1..] {
            match session.acquire(u.id, S) {
                Ok(l) => session.release(l, S).unwrap(),
                Err(e) => {
                    assert!(e.to_string().contains("leased by"), "{e}");
                    busy += 1;
                }
            }
        }
        assert!(busy > 0, "no streamed unit shares a slot with {}", held.name);
        if end == "end" {
            session.end_pass(S).unwrap()
        } else {
            session.abort_pass(S).unwrap()
        }
        assert_eq!(session.read_tensor(&name).unwrap(), expect(&name), "after the pass's {end}");
        let err = session.unload().unwrap_err().to_string();
        assert!(err.contains("1 lease(s) live"), "{err}");
    }
    session.release(lease, OTHER).unwrap();
    // A teardown gives back whatever is still live, the pass's and every holder's.
    session.begin_pass(S).unwrap();
    let _kept = session.acquire(held.id, OTHER).unwrap();
    session.release_leases(S).unwrap();
    assert!(session.unload().unwrap());
}
