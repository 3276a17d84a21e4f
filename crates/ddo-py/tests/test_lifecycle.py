"""Phase helpers, the execution timer, the metrics journal, offload state, the host CLI's
lifecycle flags, the bootstrap module and capacity profiles, on the host backend (CPU)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch

import ddo
import ddo_vmm_bootstrap
from ddo import profiles
from ddo.settings import resolve_settings

from conftest import tiny_flux

MIB = 1 << 20


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def streamed_linear(flux):
    """The tiny Flux on the linear route with its four blocks streamed through two slots."""
    model, inputs = flux
    result = ddo.enable_offload(model, route="dynamic_offload", use_environment=False, prefetch_depth=0)
    return model, inputs, result


def native(tmp_path, model, **config):
    folder = tmp_path / "transformer"
    model.save_pretrained(folder)
    cfg = dict(backend="vmm", vmm_resident_weight_budget_gb=0.008)
    cfg.update(config)
    return ddo.from_pretrained_with_dynamic_offload(
        folder, apply_dynamic=True, dynamic_offload_config=ddo.DynamicOffloadConfig(**cfg)
    )


def section(metrics, name):
    metrics.validate()
    assert name in metrics.format_profile()
    return metrics.as_dict()["runtime"][name]


# ---- phase helpers ------------------------------------------------------------------------------


def test_host_cache_release_is_off_by_default_and_never_starts_cuda():
    m = ddo.release_pytorch_host_cache(phase="after_text_encoder")
    assert m.route == "pytorch_host_cache_release"
    assert section(m, "host_cache_release") == {"phase": "after_text_encoder", "status": "disabled"}
    m = ddo.release_pytorch_host_cache(enabled=True, phase="after_run")
    assert section(m, "host_cache_release") == {"phase": "after_run", "status": "cuda_not_initialized"}
    assert not torch.cuda.is_initialized()
    cpu = section(ddo.release_pytorch_host_cache(enabled=True, device="cpu"), "host_cache_release")
    assert cpu["status"] == "unsupported" and "CUDA" in cpu["reason"]


def test_idle_cache_release_releases_every_idle_slot_of_the_device(flux):
    model, inputs, result = streamed_linear(flux)
    first = run(model, inputs)
    assert section(ddo.release_native_vmm_idle_cache(phase="p"), "idle_cache_release")["status"] == "disabled"
    assert section(ddo.release_native_vmm_idle_cache(enabled=True), "idle_cache_release")["status"] == "cuda_not_initialized"
    m = ddo.release_native_vmm_idle_cache(enabled=True, device="cpu", phase="before_transformer")
    got = section(m, "idle_cache_release")
    assert got["status"] == "completed" and got["phase"] == "before_transformer"
    assert got["sessions"] >= 1 and got["slots_released"] == 2 and got["bytes_released"] > 0
    # The next pass uploads again and computes the same.
    assert torch.equal(run(model, inputs), first)
    assert result.metrics_snapshot().as_dict()["runtime"]["reclaim_cycles"] >= 1
    result.unload()
    got = section(ddo.release_native_vmm_idle_cache(enabled=True, device="cpu"), "idle_cache_release")
    assert got["unloaded_sessions"] >= 1 and got["slots_released"] == 0
    cublas = section(
        ddo.release_native_vmm_idle_cache(enabled=True, device="cpu", clear_cublas_workspaces=True), "idle_cache_release"
    )
    assert cublas["cublas_workspaces_cleared"] is False and "CUDA" in cublas["reason"]
    result.remove()


def test_detachment_reports_nothing_when_the_module_holds_no_checkpoint_view(tmp_path, flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result = native(tmp_path, model).offload
    disabled = section(result.detach_auxiliary_cpu_sources(), "auxiliary_detachment")
    assert disabled["status"] == "disabled"
    got = section(result.detach_auxiliary_cpu_sources(enabled=True), "auxiliary_detachment")
    # Built without weights: every parameter is an arena view, no buffer came from the file.
    assert got["status"] == "nothing_to_detach"
    assert got["copied_bytes"] == 0 and got["dropped_references"] == 0
    assert got["gpu_placement_changed"] is False and got["commit_recovery_proven"] is False
    assert torch.equal(run(result.module, inputs), reference)


def test_detachment_copies_buffers_off_the_loaders_mapping_and_drops_unread_references(tmp_path, sd3):
    model, inputs = sd3
    reference = run(copy.deepcopy(model), inputs)
    loaded = native(tmp_path, model, vmm_resident_weight_budget_gb=0.02)
    result = loaded.offload
    # Weak references and copies only: holding a buffer would hold the loader's mapping.
    buffers = {n: (weakref.ref(b), b.clone()) for n, b in loaded.module.named_buffers()}
    assert buffers, "SD3 has a persistent buffer: Diffusers loads it from the file"
    with pytest.raises(ddo.DynamicOffloadCapacityError, match="max_copy_bytes"):
        result.detach_auxiliary_cpu_sources(enabled=True, max_copy_bytes=16)
    # Refused before anything changed.
    assert all(loaded.module.get_buffer(n) is ref() for n, (ref, _) in buffers.items())
    got = section(result.detach_auxiliary_cpu_sources(enabled=True), "auxiliary_detachment")
    assert got["status"] == "detached"
    assert got["copied_bytes"] >= sum(b.numel() * b.element_size() for _, b in buffers.values())
    # ddo itself holds no tensor from before attach on the native route: nothing to drop.
    assert got["copied_tensor_owners"] == len(buffers) and got["dropped_references"] == 0
    assert not result.runtime.original_buffers
    assert all(p.is_meta for p in result.runtime.originals.values())
    assert got["mapped_module_tensors_after"] == 0
    # Nothing holds the loader's private mapping of the checkpoint any more: it is unmapped.
    assert got["loader_mapping_bytes_before"] > 0 and got["loader_mapping_bytes_after"] == 0
    for n, (ref, values) in buffers.items():
        assert ref() is None and torch.equal(loaded.module.get_buffer(n), values)
    assert torch.equal(run(loaded.module, inputs), reference)
    assert result.detach_auxiliary_cpu_sources(enabled=True) is result.detach_auxiliary_cpu_sources(enabled=True)
    result.remove()


def test_detachment_does_not_apply_to_the_linear_route(flux):
    _, _, result = streamed_linear(flux)
    got = section(result.detach_auxiliary_cpu_sources(enabled=True), "auxiliary_detachment")
    assert got["status"] == "not_applicable" and "host tensors" in got["reason"]
    with pytest.raises(ddo.DynamicOffloadConfigError, match="max_copy_bytes"):
        result.detach_auxiliary_cpu_sources(enabled=True, max_copy_bytes=-1)
    result.remove()


# ---- execution timer --------------------------------------------------------------------------


def test_execution_timer_times_steps_on_the_host_clock(flux):
    model, inputs, result = streamed_linear(flux)
    disabled = result.execution_timer()
    with disabled:
        disabled.mark_step()
    assert disabled.snapshot()["status"] == "disabled"
    timer = result.execution_timer(enabled=True)
    assert timer.snapshot()["status"] == "not_finished"
    with timer:
        for _ in range(3):
            run(model, inputs)
            timer.mark_step()
        assert timer.snapshot()["status"] == "not_finished"
    snap = timer.snapshot(wait=True)
    assert snap["schema_version"] == 1 and snap["unit"] == "seconds"
    assert snap["clock"] == "host_perf_counter" and snap["status"] == "complete" and snap["failed"] is False
    assert snap["step_count"] == 3 and len(snap["step_seconds"]) == 3
    steps = snap["step_seconds"]
    assert snap["steady_state_seconds_per_step"] == pytest.approx(sum(steps[1:]) / 2)
    assert snap["phase_seconds"] == pytest.approx(sum(steps) + snap["tail_seconds"])
    assert snap["diagnostic_step_wait"]["benchmark_eligible"] is False
    metrics = result.metrics_snapshot(execution_timing=timer)
    metrics.validate()
    assert metrics.as_dict()["runtime"]["execution_timing"] == snap
    assert "execution_timing=status=complete clock=host_perf_counter" in metrics.format_profile()
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="one run"):
        timer.start()
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="mark_step"):
        timer.mark_step()
    result.remove()


def test_execution_timer_records_failure_and_diagnostic_waits(flux):
    _, _, result = streamed_linear(flux)
    timer = result.execution_timer(enabled=True, diagnostic_step_wait=True)
    with pytest.raises(KeyError):
        with timer:
            timer.mark_step()
            raise KeyError("interrupted")
    snap = timer.snapshot()
    assert snap["failed"] is True and snap["step_count"] == 1
    assert snap["diagnostic_step_wait"]["enabled"] is True and snap["diagnostic_step_wait"]["calls"] == 1
    with pytest.raises(ddo.DynamicOffloadConfigError, match="native_units.*upload_seconds"):
        result.execution_timer(enabled=True, native_units=True)
    with pytest.raises(ddo.DynamicOffloadConfigError, match="native_capacity"):
        result.execution_timer(native_capacity=0)
    # Any route carries a timer's snapshot.
    group = ddo.enable_offload(tiny_flux()[0], route="none", use_environment=False)
    metrics = group.metrics_snapshot(execution_timing=group.execution_timer(enabled=True))
    metrics.validate()
    assert metrics.as_dict()["runtime"]["execution_timing"]["status"] == "not_finished"
    result.remove()


# ---- metrics journal --------------------------------------------------------------------------


def test_metrics_journal_publishes_each_boundary_once(tmp_path, flux):
    model, inputs, result = streamed_linear(flux)
    off = result.metrics_journal(tmp_path / "off")
    assert off.before_denoise() is None and off.step(0) is None
    assert not (tmp_path / "off").exists()
    journal = result.metrics_journal(tmp_path / "journal", enabled=True)
    first = journal.before_denoise()
    run(model, inputs)
    step = journal.step(3)
    assert os.path.basename(first) == "before_denoise.json" and os.path.basename(step) == "step_0003.json"
    with open(step, encoding="utf-8") as f:
        record = json.load(f)
    assert record["schema_version"] == 1 and record["observation"] == "partial_host_step_boundary"
    assert record["step_index"] == 3 and record["host_elapsed_seconds"] >= 0
    assert record["gpu_completion_proven"] is False and record["completion_collection_requested"] is False
    assert record["metrics"]["runtime"]["passes"] == 1
    with open(first, encoding="utf-8") as f:
        assert json.load(f)["metrics"]["runtime"]["passes"] == 0
    with pytest.raises(FileExistsError):
        journal.step(3)
    with pytest.raises(FileExistsError):
        journal.before_denoise()
    # A refused record leaves the published one as it was and no temporary file behind.
    assert sorted(os.listdir(tmp_path / "journal")) == ["before_denoise.json", "step_0003.json"]
    with open(step, encoding="utf-8") as f:
        assert json.load(f) == record
    with pytest.raises(ddo.DynamicOffloadConfigError):
        journal.step(-1)
    result.remove()


# ---- offload state ----------------------------------------------------------------------------


def test_state_reports_units_and_bytes_by_placement(flux, capsys):
    model, inputs, result = streamed_linear(flux)
    assert ddo.get_dynamic_offload_state(torch.nn.Linear(2, 2)) is None
    state = ddo.get_dynamic_offload_state(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert state.route == "linear_runtime" and state.total_bytes == total
    assert sum(state.bytes_by_placement.values()) == total
    assert state.unit_count == 5 and state.streamed_unit_count == 4 and state.resident_unit_count == 1
    assert state.patched_module_count == 4
    assert sum(u.bytes for u in state.units) == total
    data = state.as_dict()
    assert data["bytes_by_placement"]["streamed"] == sum(u["bytes"] for u in data["units"] if u["placement"] == "streamed")
    # The published names: entries, selected_resident_modules.
    assert state.entries == state.units and len(data["entries"]) == 5
    assert sum(e["bytes"] for e in data["entries"]) == total
    assert state.selected_resident_modules == tuple(u.path for u in state.units if u.placement != "streamed")
    assert len(state.selected_resident_modules) == 1 and data["selected_resident_modules"] == ["resident"]
    json.dumps(data)
    run(model, inputs)
    result.print_profile_summary(top_n=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(line.startswith("[dynamic-offload-profile] ") for line in lines)
    assert any("streamed units (top 2 of 4" in line for line in lines)
    assert any("runtime passes=1" in line for line in lines)
    result.unload()
    unloaded = ddo.get_dynamic_offload_state(model)
    assert unloaded.unloaded and unloaded.bytes_by_placement == {"unloaded": total}
    result.reload()
    result.remove()
    assert ddo.get_dynamic_offload_state(model) is None


def test_state_of_routes_without_the_arena(flux):
    model, _ = flux
    result = ddo.enable_offload(model, route="none", use_environment=False)
    state = ddo.get_dynamic_offload_state(model)
    assert state.unit_count == 0 and list(state.bytes_by_placement) == ["resident"]
    result.remove()


# ---- host CLI: lifecycle flags, Windows standby purge, bootstrap ---------------------------------


def test_lifecycle_arguments_are_tri_state():
    parser = ddo.add_dynamic_offload_lifecycle_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--purge-before-run", "--no-purge-after-run"])
    assert args.purge_before_run is True and args.purge_after_run is False
    assert args.purge_after_text_encoder is None and args.purge_before_transformer is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--purge-after-run", "--no-purge-after-run"])
    only = ddo.add_dynamic_offload_lifecycle_arguments(argparse.ArgumentParser(), phases=("after_run",))
    assert vars(only.parse_args([])) == {"purge_after_run": None}
    with pytest.raises(ValueError, match="unknown lifecycle phase.*before_run"):
        ddo.add_dynamic_offload_lifecycle_arguments(argparse.ArgumentParser(), phases=("after_vae",))


def test_windows_standby_purge_is_a_no_op_on_linux(capsys):
    expected = {"purged": False, "reason": "non_windows", "phase": "before_run"}
    assert ddo.maybe_purge_windows_standby_cache("before_run") == expected
    settings = resolve_settings("model", use_environment=False)
    assert ddo.maybe_purge_windows_standby_cache(settings, "before_run", enabled=True) == expected
    assert ddo.purge_windows_standby_cache()["reason"] == "non_windows"
    events = []
    got = ddo.purge_windows_standby_cache_event(lambda name, payload: events.append((name, payload)), "after_run")
    assert got == {"purged": False, "reason": "non_windows", "phase": "after_run"} and events == [("after_run", got)]
    assert "not purged (non_windows)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="phase"):
        ddo.maybe_purge_windows_standby_cache(settings)


def test_bootstrap_reads_both_flag_forms_and_never_reexecutes():
    requested = ddo_vmm_bootstrap.vmm_fast_requested
    assert requested(["--ddo-backend", "vmm", "--ddo-preset", "auto"])
    assert requested(["--ddo-backend=vmm"])
    assert requested([], default_backend="vmm")
    assert not requested(["--ddo-backend", "vmm", "--ddo-preset=nvme_baseline"])
    assert not requested(["--ddo-backend=linear"])
    assert not requested(["script.py", "--", "--ddo-backend", "vmm"])
    assert ddo_vmm_bootstrap.ensure_vmm_fast_process(argv=["--ddo-backend", "vmm"]) is None
    with pytest.raises(ValueError, match="allocator_cache_mib"):
        ddo_vmm_bootstrap.ensure_vmm_fast_process(allocator_cache_mib=-1)
    # Hosts import it before CUDA: it imports no torch, and runs the host in this process.
    code = "import sys, ddo_vmm_bootstrap as b; b.ensure_vmm_fast_process(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- capacity profiles ------------------------------------------------------------------------


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    directory = tmp_path / "profiles"
    monkeypatch.setenv("DDO_PROFILE_DIR", str(directory))
    return directory


def test_profile_key_path_and_directory(profile_dir, monkeypatch):
    ctx = {"name": "flux", "model_class": "M", "identity_version": 1}
    key = ddo.dynamic_offload_profile_key(ctx)
    assert key.startswith("ddo-capacity-v1-") and len(key) == len("ddo-capacity-v1-") + 24
    # Canonical: the order of keys does not matter, any value does.
    assert key == ddo.dynamic_offload_profile_key(dict(reversed(list(ctx.items()))))
    assert key != ddo.dynamic_offload_profile_key({**ctx, "name": "flux2"})
    import hashlib

    canonical = json.dumps(ctx, sort_keys=True, separators=(",", ":"))
    assert key == "ddo-capacity-v1-" + hashlib.sha256(canonical.encode()).hexdigest()[:24]
    assert ddo.get_dynamic_offload_profile_dir() == profile_dir
    assert ddo.get_dynamic_offload_profile_dir(profile_dir / "x") == profile_dir / "x"
    assert ddo.dynamic_offload_profile_path(ctx) == profile_dir / (key + ".json")
    monkeypatch.delenv("DDO_PROFILE_DIR")
    assert str(ddo.get_dynamic_offload_profile_dir()) == os.path.join(os.path.expanduser("~"), ".ddo", "profiles")
    with pytest.raises(ddo.DynamicOffloadConfigError, match="JSON"):
        ddo.dynamic_offload_profile_key({"name": object()})


def test_profile_file_keeps_the_last_20_observations_and_is_replaced_atomically(profile_dir, monkeypatch):
    ctx = {"name": "flux", "identity_version": 1}
    assert ddo.load_dynamic_offload_profile(ctx) is None
    for i in range(25):
        rec = {"setting": "vmm_resident_weight_budget_gb", "budget_gb": float(i)}
        assert ddo.record_dynamic_offload_profile(ctx, {"run": i}, recommendation=rec) == ddo.dynamic_offload_profile_path(ctx)
    data = ddo.load_dynamic_offload_profile(ctx)
    assert data["schema_version"] == ddo.DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION == 1
    assert data["profile_key"] == ddo.dynamic_offload_profile_key(ctx) and data["context"] == ctx
    assert [o["run"] for o in data["observations"]] == list(range(5, 25))
    assert ddo.get_dynamic_offload_profile_recommendation(data)["budget_gb"] == 24.0
    # An observation without a recommendation keeps the last one.
    ddo.record_dynamic_offload_profile(ctx, {"run": 25})
    assert ddo.get_dynamic_offload_profile_recommendation(ddo.load_dynamic_offload_profile(ctx))["budget_gb"] == 24.0
    assert [n for n in os.listdir(profile_dir) if not n.startswith(".")] == [ddo.dynamic_offload_profile_path(ctx).name]
    # A write that fails before the rename leaves the old profile whole and no temporary file.
    path = ddo.dynamic_offload_profile_path(ctx)
    before = open(path, encoding="utf-8").read()

    def broken(_src, _dst):
        raise OSError("disk full")

    with monkeypatch.context() as patched:
        patched.setattr(profiles.os, "replace", broken)
        with pytest.raises(OSError, match="disk full"):
            ddo.record_dynamic_offload_profile(ctx, {"run": 99})
    assert open(path, encoding="utf-8").read() == before
    assert len([n for n in os.listdir(profile_dir) if not n.endswith(".tmp")]) == 2  # the profile and its lock
    # A file that is not a profile is ignored with a warning naming it, with what to do.
    with open(path, "w", encoding="utf-8") as f:
        f.write("{not json")
    with pytest.warns(UserWarning, match="delete it"):
        assert ddo.load_dynamic_offload_profile(ctx) is None
    assert ddo.DynamicOffloadProfileSession.recommend_resident_budget(24, 20.5, 1) == 2.5
    assert ddo.DynamicOffloadProfileSession.recommend_resident_budget(24, 30, 1) == 0


def write_profile(module, route, budget_gb, name="flux"):
    """A profile file written by hand, in the documented format, as a build on this device would."""
    ctx = profiles.profile_context(module, "model", route, "cpu", name)
    setting = {"linear_runtime": "resident_module_budget_gb", "vmm_fast_runtime": "vmm_resident_weight_budget_gb"}[route]
    path = ddo.dynamic_offload_profile_path(ctx)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(
            {
                "schema_version": 1,
                "profile_key": ddo.dynamic_offload_profile_key(ctx),
                "context": ctx,
                "recommendation": {"setting": setting, "budget_gb": budget_gb},
                "observations": [{"recorded_by": "test"}],
            },
            f,
        )
    return ctx


def test_a_recorded_profile_sizes_the_linear_routes_resident_budget(profile_dir, flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    write_profile(model, "linear_runtime", 0.25)
    result = ddo.enable_offload(
        model, config=ddo.DynamicOffloadConfig(route="dynamic_offload", profile_name="flux"), use_environment=False
    )
    assert result.settings.values["resident_module_budget_gb"] == 0.25
    assert result.settings.values["profile_resident_module_budget_gb"] == 0.25
    setup = result.metrics_snapshot().as_dict()["setup"]
    assert setup["capacity_profile"]["status"] == "applied" and setup["capacity_profile"]["budget_gb"] == 0.25
    result.metrics_snapshot().validate()
    assert "capacity_profile=name=flux status=applied" in result.metrics_snapshot().format_profile()
    with result.profile_run():  # not building: a null context
        assert torch.equal(run(model, inputs), reference)
    # Applying a profile records nothing.
    ctx = profiles.profile_context(model, "model", "linear_runtime", "cpu", "flux")
    assert len(ddo.load_dynamic_offload_profile(ctx)["observations"]) == 1
    result.remove()
    # An explicit budget wins over the profile.
    result = ddo.enable_offload(
        model,
        config=ddo.DynamicOffloadConfig(route="dynamic_offload", profile_name="flux", resident_module_budget_gb=0.0),
        use_environment=False,
    )
    assert result.settings.values["resident_module_budget_gb"] == 0.0
    assert result.capacity_profile["status"] == "explicit_budget"
    assert result.capacity_profile["recommended_budget_gb"] == 0.25
    result.remove()


def test_a_recorded_profile_sizes_the_native_routes_gpu_budget(profile_dir, tmp_path, flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    write_profile(model, "vmm_fast_runtime", 0.03)
    folder = tmp_path / "transformer"
    model.save_pretrained(folder)
    loaded = ddo.from_pretrained_with_dynamic_offload(
        folder, apply_dynamic=True, profile_name="flux", dynamic_offload_config=ddo.DynamicOffloadConfig(backend="vmm")
    )
    result = loaded.offload
    assert result.settings.values["vmm_resident_weight_budget_gb"] == 0.03
    setup = result.metrics_snapshot().as_dict()["setup"]
    assert setup["capacity_profile"]["status"] == "applied"
    assert setup["gpu_budget_bytes"] == int(0.03 * (1 << 30))
    with loaded.profile_run():
        assert torch.equal(run(loaded.module, inputs), reference)
    result.remove()


def test_profile_names_without_a_recording_and_builds_off_the_gpu_are_reported(profile_dir, flux):
    model, _ = flux
    with pytest.warns(UserWarning, match="no recording"):
        result = ddo.enable_offload(model, route="dynamic_offload", profile_name="new", use_environment=False)
    assert result.capacity_profile["status"] == "not_found"
    result.remove()
    with pytest.raises(ddo.DynamicOffloadConfigError, match="measures GPU memory.*cpu"):
        ddo.enable_offload(model, route="dynamic_offload", profile_name="new", build_profile=True, use_environment=False)
    with pytest.raises(ddo.DynamicOffloadConfigError, match="set profile_name"):
        ddo.enable_offload(model, route="dynamic_offload", build_profile=True, use_environment=False)
    with pytest.raises(ddo.DynamicOffloadConfigError, match="has none"):
        ddo.enable_offload(model, route="none", profile_name="new", build_profile=True, use_environment=False)
    with pytest.raises(ddo.DynamicOffloadConfigError, match="apply_dynamic=True"):
        ddo.from_pretrained_with_dynamic_offload("unused", profile_name="new")
    assert ddo.get_dynamic_offload_state(model) is None


@pytest.mark.parametrize(
    "damage",
    ["not json", "a folder", "nested", "other route", "absurd budget", "negative budget", "other context"],
)
def test_a_profile_that_is_not_valid_is_not_applied_and_the_attach_says_why(profile_dir, flux, damage):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    ctx = write_profile(model, "linear_runtime", 0.25)
    path = ddo.dynamic_offload_profile_path(ctx)
    data = json.loads(path.read_text())
    if damage == "not json":
        path.write_text("{")
    elif damage == "a folder":
        path.unlink()
        path.mkdir()
    elif damage == "nested":
        path.write_text("[" * 100000 + "]" * 100000)
    elif damage == "other route":
        data["recommendation"]["setting"] = "vmm_resident_weight_budget_gb"
        path.write_text(json.dumps(data))
    elif damage == "absurd budget":
        data["recommendation"]["budget_gb"] = 1e300
        path.write_text(json.dumps(data))
    elif damage == "negative budget":
        data["recommendation"]["budget_gb"] = -1
        path.write_text(json.dumps(data))
    else:
        data["context"]["name"] = "other"
        path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="capacity profile 'flux'"):
        result = ddo.enable_offload(model, route="dynamic_offload", profile_name="flux", use_environment=False)
    assert result.capacity_profile["status"] == "invalid"
    assert result.settings.values["resident_module_budget_gb"] == 0.0
    assert torch.equal(run(model, inputs), reference)
    result.remove()


def test_a_hosts_profile_session_records_both_profiles_and_merges_capacity_limits(profile_dir, flux):
    execution = {"model": "flux", "resolution": 1024}
    family = {"model": "flux"}
    session = ddo.DynamicOffloadProfileSession(execution, family)
    assert session.execution_profile is None and session.capacity_profile is None
    for tokens, status in [(4096, "success"), (8192, "success"), (16384, "failure"), (12288, "failure"), (2048, "x")]:
        paths = session.record_success(
            {"status": status, "capacity": {"metric": "tokens", "value": tokens}},
            {"profile_resident_module_budget_gb": 0.25},
        )
    assert paths == (ddo.dynamic_offload_profile_path(execution), ddo.dynamic_offload_profile_path(family))
    limits = ddo.get_dynamic_offload_profile_capacity(session.capacity_profile, "tokens")
    assert limits == {"max_success": 8192.0, "min_failure": 12288.0}
    assert ddo.get_dynamic_offload_profile_capacity(session.capacity_profile, "frames") is None
    assert ddo.get_dynamic_offload_profile_recommendation(session.capacity_profile) is None
    assert len(session.execution_profile["observations"]) == 5
    # A fresh session reads what the last one recorded.
    again = ddo.DynamicOffloadProfileSession(execution, family, profile_dir)
    assert again.execution_profile == session.execution_profile
    # apply_settings sizes the budget from the execution profile, unless one was set explicitly.
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    host = dict(execution_device="cpu", offload_device="cpu", target_module_classes=(torch.nn.Linear, torch.nn.Embedding),
                skip_modules_pattern=None, environ={})
    settings = ddo.load_dynamic_offload_settings_from_env(**host)
    assert settings.route_name == "linear_runtime"
    applied, recommendation = again.apply_settings(settings)
    assert recommendation == {"profile_resident_module_budget_gb": 0.25}
    assert applied.values["resident_module_budget_gb"] == 0.25
    assert applied.values["profile_resident_module_budget_gb"] == 0.25
    assert again.apply_settings(settings, allow_recommendation=False) == (settings, recommendation)
    explicit = ddo.load_dynamic_offload_settings_from_env(
        **{**host, "environ": {"DDO_RESIDENT_MODULE_BUDGET_GB": "0.5"}}
    )
    assert again.apply_settings(explicit) == (explicit, None)
    result = ddo.enable_offload(model, settings=applied, use_environment=False)
    assert result.settings.values["resident_module_budget_gb"] == 0.25
    assert torch.equal(run(model, inputs), reference)
    result.remove()
    with pytest.raises(ddo.DynamicOffloadConfigError, match="not JSON"):
        session.record_success({"status": "success", "value": float("nan")})


def test_the_timer_takes_the_published_constructor_and_refuses_what_it_cannot_measure():
    timer = ddo.DynamicOffloadExecutionTimer(True, "cpu", None, False)
    with timer:
        timer.mark_step()
    assert timer.snapshot()["status"] == "complete" and timer.snapshot()["step_count"] == 1
    with pytest.raises(ddo.DynamicOffloadConfigError, match="per-unit"):
        ddo.DynamicOffloadExecutionTimer(True, "cpu", native_factory=lambda: None)
    with pytest.raises(ddo.DynamicOffloadConfigError, match="not a device"):
        ddo.DynamicOffloadExecutionTimer(True, "bogus")
    with pytest.raises(ddo.DynamicOffloadConfigError, match="not meta"):
        ddo.DynamicOffloadExecutionTimer(True, "meta")
    if not torch.cuda.is_available():
        with pytest.raises(ddo.DynamicOffloadConfigError, match="no CUDA device"):
            ddo.DynamicOffloadExecutionTimer(True, "cuda")
    with pytest.raises(TypeError, match="DynamicOffloadMetrics"):
        timer.attach({"route": "x"})


def test_phase_helpers_refuse_a_device_that_is_not_one():
    for helper in (ddo.release_pytorch_host_cache, ddo.release_native_vmm_idle_cache):
        with pytest.raises(ddo.DynamicOffloadConfigError, match="is not a device"):
            helper(enabled=True, device="bogus")



def test_profile_records_from_several_threads_are_all_kept(profile_dir):
    import threading

    ctx = {"name": "threads"}

    def record(base):
        for i in range(5):
            ddo.record_dynamic_offload_profile(ctx, {"status": "success", "capacity": {"metric": "t", "value": base + i}})

    threads = [threading.Thread(target=record, args=(10 * k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    data = ddo.load_dynamic_offload_profile(ctx)
    assert len(data["observations"]) == 20
    assert ddo.get_dynamic_offload_profile_capacity(data, "t") == {"max_success": 34.0}


def test_profile_values_of_any_shape_never_crash(profile_dir, flux):
    model, _ = flux
    ctx = write_profile(model, "linear_runtime", 0.25)
    path = ddo.dynamic_offload_profile_path(ctx)
    data = json.loads(path.read_text())
    data["recommendation"]["budget_gb"] = 10**400
    data["recommendation"]["device_total_bytes"] = "abc"
    data["capacity_limits"] = {"t": {"max_success": "abc", "min_failure": 10**400}}
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="no finite budget"):
        result = ddo.enable_offload(model, route="dynamic_offload", profile_name="flux", use_environment=False)
    assert result.capacity_profile["status"] == "invalid"
    result.remove()
    # Limits that are not numbers are replaced by the next record; huge numbers read as none.
    assert ddo.get_dynamic_offload_profile_capacity(data, "t") is None
    ddo.record_dynamic_offload_profile(ctx, {"status": "success", "capacity": {"metric": "t", "value": 10**400}})
    ddo.record_dynamic_offload_profile(ctx, {"status": "success", "capacity": {"metric": "t", "value": 3}})
    assert ddo.get_dynamic_offload_profile_capacity(ddo.load_dynamic_offload_profile(ctx), "t") == {"max_success": 3.0}
    with pytest.raises(ddo.DynamicOffloadConfigError, match="a capacity metric is a name"):
        ddo.get_dynamic_offload_profile_capacity(data, ["t"])
    with pytest.raises(ddo.DynamicOffloadConfigError, match="not JSON data"):
        ddo.dynamic_offload_profile_key({"a": 10**5000})
    deep: list = []
    for _ in range(100000):
        deep = [deep]
    with pytest.raises(ddo.DynamicOffloadConfigError, match="not JSON data"):
        ddo.dynamic_offload_profile_key({"a": deep})


def test_profile_folders_paths_and_modes(profile_dir, tmp_path):
    ctx = {"name": "paths"}
    path = ddo.record_dynamic_offload_profile(ctx, {"run": 1}, os.fsencode(tmp_path / "bytes"))
    assert path == tmp_path / "bytes" / path.name
    old = os.umask(0o022)
    try:
        mode = os.stat(ddo.record_dynamic_offload_profile(ctx, {"run": 2}, tmp_path / "mode")).st_mode & 0o777
    finally:
        os.umask(old)
    assert mode == 0o644
    with pytest.raises(ddo.DynamicOffloadConfigError, match="str or Path"):
        ddo.load_dynamic_offload_profile(ctx, 5)
    ddo.dynamic_offload_profile_path(ctx).mkdir(parents=True)
    with pytest.raises(ddo.DynamicOffloadConfigError, match="is a folder"):
        ddo.record_dynamic_offload_profile(ctx, {"run": 3})
    a_file = tmp_path / "afile"
    a_file.write_text("")
    with pytest.warns(UserWarning, match="set DDO_PROFILE_DIR or profile_dir to a folder"):
        assert ddo.load_dynamic_offload_profile(ctx, a_file) is None


def test_a_hosts_profile_session_applies_only_what_attach_would(profile_dir):
    host = dict(execution_device="cpu", offload_device="cpu", target_module_classes=(torch.nn.Linear, torch.nn.Embedding),
                skip_modules_pattern=None, environ={})
    settings = ddo.load_dynamic_offload_settings_from_env(**host)
    same = {"model": "same"}
    session = ddo.DynamicOffloadProfileSession(same, same)
    session.record_success({"run": 1}, {"setting": "vmm_resident_weight_budget_gb", "budget_gb": 0.25})
    assert len(session.execution_profile["observations"]) == 1  # one profile: recorded once
    with pytest.warns(UserWarning, match="sizes resident_module_budget_gb"):
        assert session.apply_settings(settings) == (settings, None)
    session.record_success({"run": 2}, {"budget_gb": 1e300})
    with pytest.warns(UserWarning, match="more than cpu"):
        assert session.apply_settings(settings) == (settings, None)
    with pytest.raises(ddo.DynamicOffloadConfigError, match="takes DynamicOffloadSettings"):
        session.apply_settings(None)


def test_published_shapes_of_state_timer_and_phase_helpers(flux):
    model, inputs, result = streamed_linear(flux)
    state = ddo.get_dynamic_offload_state(model)
    assert state.entries[0].name == state.entries[0].path
    run(model, inputs)
    released = ddo.release_native_vmm_idle_cache(enabled=True, device="cpu:0").as_dict()["runtime"]
    assert released["idle_cache_release"]["sessions"] == 1
    with pytest.raises(ddo.DynamicOffloadConfigError, match="not meta"):
        ddo.release_native_vmm_idle_cache(enabled=True, device="meta")
    result.remove()
    with pytest.raises(ddo.DynamicOffloadConfigError, match="True or False"):
        ddo.DynamicOffloadExecutionTimer("false", "cpu")
    with pytest.raises(ddo.DynamicOffloadConfigError, match="True or False"):
        ddo.DynamicOffloadExecutionTimer(True, "cpu", None, "no")
    assert ddo.DynamicOffloadExecutionTimer(True, "cpu", False, False).enabled


def test_attach_and_a_hosts_profile_session_refuse_a_profile_the_same_way(profile_dir, flux):
    model, _ = flux
    write_profile(model, "linear_runtime", 1e300)
    with pytest.warns(UserWarning, match="more than cpu's"):
        result = ddo.enable_offload(model, route="dynamic_offload", profile_name="flux", use_environment=False)
    assert result.capacity_profile["status"] == "invalid"
    result.remove()
    host = dict(execution_device="cpu", offload_device="cpu", target_module_classes=(torch.nn.Linear, torch.nn.Embedding),
                skip_modules_pattern=None)
    same = {"model": "same"}
    session = ddo.DynamicOffloadProfileSession(same, same)
    session.record_success({"run": 1}, {"budget_gb": 1e300})
    settings = ddo.load_dynamic_offload_settings_from_env(**host, environ={})
    with pytest.warns(UserWarning, match="more than cpu's"):
        assert session.apply_settings(settings) == (settings, None)
    # The native route needs GPU memory for weights: a profile recommending none is refused.
    session.record_success({"run": 2}, {"setting": "vmm_resident_weight_budget_gb", "budget_gb": 0.0})
    native = ddo.load_dynamic_offload_settings_from_env(**host, environ={"DDO_BACKEND": "vmm"})
    assert native.route_name == "vmm_fast_runtime"
    with pytest.warns(UserWarning, match="no GPU memory for weights"):
        assert session.apply_settings(native) == (native, None)
    # A host's settings that already carry a resident budget (the warm_process preset's 6 GiB) keep it.
    session.record_success({"run": 3}, {"budget_gb": 0.25})
    warm = ddo.load_dynamic_offload_settings_from_env(**host, environ={"DDO_PRESET": "warm_process"})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert session.apply_settings(warm) == (warm, None)
    assert session.apply_settings(settings)[0].values["resident_module_budget_gb"] == 0.25
