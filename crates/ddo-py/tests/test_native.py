"""The native route (vmm_fast_runtime) on the CPU: the same arena, on the host backend. Weights
stream from the checkpoint's mapping into arena memory that parameters view without copying."""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch

import ddo


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def budget_for(model, slots=2, staging=False):
    """The resident rest plus `slots` of the largest unit (and a granule of staging for tensors
    converted on the device), in GiB: most units stream."""
    granule = 2 << 20
    units = ddo.find_execution_units(model)
    in_units = {id(p) for _, m in units for p in m.parameters()}
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_units)
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters()) for _, m in units)
    up = lambda n: (n + granule - 1) // granule * granule  # noqa: E731
    return (up(rest) + slots * up(largest) + (granule if staging else 0)) / 2**30


def metrics(result):
    return result.metrics_snapshot(collect_completed=True).as_dict()


def load_native(tmp_path, model, slots=2, cls=None):
    path = tmp_path / type(model).__name__
    model.save_pretrained(path)
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=budget_for(model, slots))
    return ddo.from_pretrained_with_dynamic_offload(
        path, model_loader=cls or type(model), apply_dynamic=True, component="transformer", dynamic_offload_config=config
    )


@pytest.mark.parametrize("name", ["flux", "sd3", "vae"])
def test_native_outputs_equal_resident(request, tmp_path, name):
    model, inputs = request.getfixturevalue(name)
    reference = run(copy.deepcopy(model), inputs)
    loaded = load_native(tmp_path, model)
    result = loaded.offload
    assert result.runtime_route == "vmm_fast_runtime"
    for _ in range(3):
        assert torch.equal(run(loaded.module, inputs), reference), name
    snapshot = metrics(result)
    setup, runtime = snapshot["setup"], snapshot["runtime"]
    assert setup["streamed_units"] >= 2 and setup["execution_slots"] >= 2, setup
    assert runtime["prefetch_hits"] > 0 and runtime["uploads"] > setup["streamed_units"]
    assert snapshot["route"] == "dynamic_offload" and snapshot["execution"]["route"] == "vmm_fast_runtime"
    assert setup["host_source"] == "mapping" and setup["execution_device"] == "cpu"


def test_views_are_built_once_at_fixed_addresses(tmp_path, flux):
    model, inputs = flux
    loaded = load_native(tmp_path, model)
    before = {n: p.data_ptr() for n, p in loaded.module.named_parameters()}
    run(loaded.module, inputs)
    run(loaded.module, inputs)
    assert {n: p.data_ptr() for n, p in loaded.module.named_parameters()} == before


def test_the_first_forward_starts_warm(tmp_path, flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    loaded = load_native(tmp_path, model)
    stats = metrics(loaded.offload)
    setup = stats["setup"]
    # Attach already uploaded the resident units and one streamed unit per slot.
    assert stats["runtime"]["uploads"] == setup["resident_units"] + setup["execution_slots"], stats
    assert torch.equal(run(loaded.module, inputs), reference)
    runtime = metrics(loaded.offload)["runtime"]
    assert runtime["prefetch_misses"] == 0 and runtime["prefetch_hits"] == setup["streamed_units"], runtime


def test_reclaim_unload_reload(tmp_path, flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    loaded = load_native(tmp_path, model)
    result = loaded.offload
    run(loaded.module, inputs)
    slots, freed = result.reclaim()
    assert slots >= 2 and freed > 0
    assert torch.equal(run(loaded.module, inputs), reference)
    result.unload()
    assert all(p.is_meta for p in loaded.module.parameters())
    result.reload()
    assert torch.equal(run(loaded.module, inputs), reference)


def test_an_exception_inside_a_block_leaves_the_arena_usable(tmp_path, flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    loaded = load_native(tmp_path, model)
    block = loaded.module.transformer_blocks[1]

    def boom(_m, _args):
        raise RuntimeError("inside the block")

    handle = block.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="inside the block"):
        run(loaded.module, inputs)
    handle.remove()
    # Every lease was released: the next passes run and give the same outputs.
    for _ in range(2):
        assert torch.equal(run(loaded.module, inputs), reference)


def test_the_module_is_built_without_weights(tmp_path, flux):
    model, _ = flux
    loaded = load_native(tmp_path, model)
    # Parameters view arena memory (not tensors of their own).
    assert metrics(loaded.offload)["setup"]["registered_bytes"] > 0
    assert loaded.bound == len(loaded.source["tensors"])


def test_the_mapping_tier_reads_the_checkpoint_while_the_module_is_built(tmp_path, flux):
    """With no host-tier setting and room on the host, the checkpoint's files are read into the
    page cache while the module is built, then read in and registered range by range; the load
    says how long each stage took."""
    model, _ = flux
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    files = [str(path / n) for n in os.listdir(path) if n.endswith(".safetensors")]
    for f in files:  # a cold checkpoint: written out, then dropped from the page cache
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=budget_for(model))
    start = time.perf_counter()
    loaded = ddo.from_pretrained_with_dynamic_offload(path, apply_dynamic=True, dynamic_offload_config=config)
    wall = time.perf_counter() - start
    assert loaded.read_ahead_bytes == sum(os.path.getsize(f) for f in files)
    # Each stage measured (it did work, so it took time), and together no longer than the call.
    stages = loaded.stage_seconds
    assert set(stages) == {"validate", "load", "attach"}
    assert all(s > 0 for s in stages.values()) and sum(stages.values()) <= wall
    setup = metrics(loaded.offload)["setup"]
    # Every registered byte was read in before it was registered.
    assert setup["read_in_bytes"] >= setup["registered_bytes"] > 0
    # The session's set-up steps ran inside the attach stage, each measured.
    steps = [setup["registration_seconds"], setup["source_seconds"], setup["resident_upload_seconds"]]
    assert all(s > 0 for s in steps) and sum(steps) <= stages["attach"]
    assert "setup_stages=source_seconds=" in loaded.offload.metrics_snapshot().format_profile()


def test_a_host_tier_setting_reads_nothing_ahead(tmp_path, flux):
    model, _ = flux
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    config = ddo.DynamicOffloadConfig(
        backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=budget_for(model), vmm_source_cache_gb=1.0
    )
    loaded = ddo.from_pretrained_with_dynamic_offload(path, apply_dynamic=True, dynamic_offload_config=config)
    assert loaded.read_ahead_bytes == 0
    assert "read_in_bytes" not in metrics(loaded.offload)["setup"]
    loaded.offload.remove()


def test_streamed_units_held_in_a_peer_store_give_the_resident_outputs(tmp_path, flux):
    """vmm_peer_store_device: the streamed units live in that GPU's memory (on the host backend,
    host memory standing for it) and stream from there; outputs stay bit for bit."""
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    config = ddo.DynamicOffloadConfig(
        backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=budget_for(model),
        vmm_peer_store_device="cuda:1",
    )
    loaded = ddo.from_pretrained_with_dynamic_offload(path, apply_dynamic=True, dynamic_offload_config=config)
    for _ in range(3):
        assert torch.equal(run(loaded.module, inputs), reference)
    snapshot = metrics(loaded.offload)
    setup, runtime = snapshot["setup"], snapshot["runtime"]
    assert setup["peer_store_device"] == "cuda:1"
    assert setup["peer_store_units"] == setup["streamed_units"] > 0
    assert runtime["peer_uploads"] >= 2 * setup["streamed_units"]
    loaded.offload.remove()


def test_a_peer_store_device_that_is_no_gpu_is_refused_by_name():
    from ddo.settings import resolve_settings

    with pytest.raises(ddo.DynamicOffloadConfigError, match="vmm_peer_store_device"):
        resolve_settings("transformer", config=ddo.DynamicOffloadConfig(backend="vmm", vmm_peer_store_device="gpu1"))


@pytest.mark.parametrize("storage_gb", [1.0, 0.0001])
def test_retained_windows_feed_the_arena(tmp_path, flux, storage_gb):
    """vmm_source_cache_gb > 0: host bytes come from retained windows under that ceiling; what
    does not fit is read from the checkpoint on demand. Outputs are the same either way."""
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    config = ddo.DynamicOffloadConfig(
        backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=budget_for(model), vmm_source_cache_gb=storage_gb
    )
    loaded = ddo.from_pretrained_with_dynamic_offload(path, apply_dynamic=True, dynamic_offload_config=config)
    for _ in range(2):
        assert torch.equal(run(loaded.module, inputs), reference)
    stats = metrics(loaded.offload)["setup"]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert stats["host_source"] == "retained"
    assert stats["retained_bytes"] + stats["unretained_bytes"] == total
    assert stats["retained_bytes"] <= storage_gb * 2**30
    if storage_gb >= 1:
        assert stats["unretained_bytes"] == 0
        assert stats["registered_bytes"] >= stats["retained_bytes"]
    else:
        assert stats["retained_bytes"] < total
    profile = loaded.offload.metrics_snapshot().format_profile()
    assert "retained" in profile, profile
    loaded.offload.remove()


def test_the_disk_route_reads_the_checkpoint_every_pass_bit_identical(tmp_path, flux):
    """backend vmm, preset nvme_baseline: route vmm_runtime, every unit read from the checkpoint
    into staging buffers each pass; the outputs equal the resident model's."""
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    config = ddo.DynamicOffloadConfig(
        backend="vmm", preset="nvme_baseline", execution_device="cpu", vmm_resident_weight_budget_gb=budget_for(model)
    )
    loaded = ddo.from_pretrained_with_dynamic_offload(path, dynamic_offload_config=config, apply_dynamic=True)
    result = loaded.offload
    assert result.runtime_route == "vmm_runtime"
    for _ in range(3):
        assert torch.equal(run(loaded.module, inputs), reference)
    snapshot = metrics(result)
    setup, runtime = snapshot["setup"], snapshot["runtime"]
    assert snapshot["route"] == "dynamic_offload" and snapshot["execution"]["route"] == "vmm_runtime"
    assert setup["host_source"] == "disk" and setup["streamed_units"] >= 2, setup
    assert 0 < setup["staging_bytes"] <= 2 * 0.625 * 2**30
    assert runtime["disk_bytes_per_pass"] > 0 and "read_stall_seconds" in runtime, runtime
    assert "disk=" in result.metrics_snapshot().format_profile()
    result.remove()


def test_registration_stays_within_its_ceiling(tmp_path, flux):
    model, _ = flux
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    base = dict(backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=budget_for(model))
    # Storage 0.0625 GiB (one 64 MiB segment) bounds registration; the checkpoint needs one.
    fits = ddo.from_pretrained_with_dynamic_offload(
        path, apply_dynamic=True, dynamic_offload_config=ddo.DynamicOffloadConfig(vmm_source_cache_gb=0.0625, **base)
    )
    stats = metrics(fits.offload)["setup"]
    assert stats["registered_bytes"] > 0 and stats["unregistered_bytes"] == 0, stats
    fits.offload.remove()
    # An impossible ceiling is refused by validation before anything is loaded.
    with pytest.raises(ddo.DynamicOffloadConfigError, match="not a whole number of 64 MiB segments"):
        ddo.from_pretrained_with_dynamic_offload(
            path,
            apply_dynamic=True,
            dynamic_offload_config=ddo.DynamicOffloadConfig(vmm_source_cache_gb=1, vmm_source_registered_gb=0.01, **base),
        )


def test_a_budget_too_small_says_what_is_needed_and_changes_nothing(tmp_path, flux):
    model, _ = flux
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=0.001)
    with pytest.raises(ddo.DynamicOffloadCapacityError) as info:
        ddo.from_pretrained_with_dynamic_offload(path, apply_dynamic=True, dynamic_offload_config=config)
    text = str(info.value)
    assert text.startswith("GPU budget of 1.02 MiB (1.02 MiB after 0 B of headroom) is too small"), text
    assert "raise the budget to" in text and "vmm_resident_weight_budget_gb" in text
    assert isinstance(info.value, ddo.DynamicOffloadConfigError) and isinstance(info.value, ValueError)


def test_a_module_not_loaded_from_a_checkpoint_is_refused_for_the_native_route(flux):
    model, _ = flux
    with pytest.raises(ddo.DynamicOffloadError, match="load the component with ddo.from_pretrained_with_dynamic_offload"):
        ddo.enable_offload(model, backend="vmm", execution_device="cpu", use_environment=False)
    assert all(p.device.type == "cpu" and not p.is_meta for p in model.parameters())


def _with_rounding_cases(model):
    """Puts values where narrowing decides (ties to even, subnormals, signed zero) into every
    floating parameter, so conversion is checked where it can go wrong."""
    cases = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-9), 2**-130, -0.0, 3 * 2**-25, 1e-3 + 2**-20])
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            n = min(len(cases), flat.numel())
            flat[:n] = cases[:n].to(p.dtype)
    return model


@pytest.mark.parametrize(
    "stored,loaded",
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.bfloat16),
        (torch.float8_e4m3fn, torch.bfloat16),
        (torch.float8_e5m2, torch.float16),
    ],
)
def test_a_checkpoint_in_another_dtype_loads_as_diffusers_loads_it(tmp_path, wan, stored, loaded):
    from diffusers import WanTransformer3DModel

    model, inputs = wan
    path = tmp_path / "wan"
    _with_rounding_cases(model).to(stored).save_pretrained(path)
    reference = WanTransformer3DModel.from_pretrained(path, torch_dtype=loaded).eval()
    inputs = {k: v.to(loaded) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    want = run(reference, inputs)
    budget = budget_for(reference, staging=stored.itemsize < 4)
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=budget)
    got = ddo.from_pretrained_with_dynamic_offload(
        path, torch_dtype=loaded, apply_dynamic=True, component="transformer", dynamic_offload_config=config
    )
    params = dict(got.module.named_parameters())
    ref_params = dict(reference.named_parameters())
    assert {n: p.dtype for n, p in params.items()} == {n: p.dtype for n, p in ref_params.items()}
    assert any(p.dtype == torch.float32 for p in params.values()), "keep-in-fp32 modules stay fp32"
    for _ in range(2):
        assert torch.equal(run(got.module, inputs), want)
    state = got.module.state_dict()
    for n, p in ref_params.items():
        assert torch.equal(state[n].view(torch.uint8), p.detach().view(torch.uint8)), n
    setup = metrics(got.offload)["setup"]
    # Widening (keep-in-fp32 modules, fp8) converts on the device after upload; the rest at load.
    at_load = stored != loaded and stored.itemsize >= loaded.itemsize
    on_device = stored.itemsize < 4  # keep-in-fp32 modules (and fp8 -> 16 bits) widen
    want = {(True, True): "host+device", (True, False): "host", (False, True): "device"}[(at_load, on_device)]
    assert setup["conversion"] == want and setup["converted_tensors"] > 0, setup
    assert (setup.get("device_converted_tensors") or 0) > 0 if on_device else "device_converted_tensors" not in setup
    assert setup["streamed_units"] >= 2, setup
    assert f"conversion=at={setup['conversion']}" in got.offload.metrics_snapshot().format_profile()
    got.offload.remove()


def _cached(cache, repo, model):
    """Puts ``model`` into a Hugging Face hub cache folder as a download would leave it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    model.save_pretrained(root / "snapshots" / commit)


def test_a_hub_id_resolves_in_the_local_cache_without_network(tmp_path, monkeypatch, flux):
    import huggingface_hub.constants

    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _cached(tmp_path / "hub", "example/tiny-flux", model)
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=budget_for(model))
    loaded = ddo.from_pretrained_with_dynamic_offload(
        "example/tiny-flux", apply_dynamic=True, component="transformer", dynamic_offload_config=config
    )
    assert torch.equal(run(loaded.module, inputs), reference)
    assert loaded.source["path"].startswith(str(tmp_path / "hub"))
    loaded.offload.remove()
    with pytest.raises(ddo.DynamicOffloadError, match="hf download example/missing"):
        ddo.from_pretrained_with_dynamic_offload("example/missing")


def test_unload_and_remove_wait_for_a_forward_in_another_thread(tmp_path, flux):
    import threading
    import time

    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    loaded = load_native(tmp_path, model)
    block = loaded.module.transformer_blocks[0]
    original = block.forward
    entered = threading.Event()

    def slow(*args, **kwargs):
        entered.set()
        time.sleep(0.3)
        return original(*args, **kwargs)

    block.forward = slow
    results = []
    worker = threading.Thread(target=lambda: results.append(run(loaded.module, inputs)))
    worker.start()
    entered.wait(5)
    loaded.offload.unload()  # waits for the pass in the other thread to end
    worker.join(5)
    assert len(results) == 1 and torch.equal(results[0], reference)
    loaded.offload.reload()
    del block.forward
    worker = threading.Thread(target=lambda: results.append(run(loaded.module, inputs)))
    block.forward = slow
    entered.clear()
    worker.start()
    entered.wait(5)
    loaded.offload.remove()
    worker.join(5)
    assert len(results) == 2 and torch.equal(results[1], reference)


def load_mixed(tmp_path, model, **extra):
    """``model`` on the native route with two slots (prefetch depth 1) and a granule more: one
    block resident, the others streamed. Returns the loaded result, its runtime and its blocks'
    units by id."""
    path = tmp_path / type(model).__name__
    model.save_pretrained(path)
    config = ddo.DynamicOffloadConfig(
        backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=budget_for(model, 2) + 2 / 1024, prefetch_depth=1,
        **extra,
    )
    loaded = ddo.from_pretrained_with_dynamic_offload(
        path, model_loader=type(model), apply_dynamic=True, component="transformer", dynamic_offload_config=config
    )
    runtime = loaded.offload.runtime
    return loaded, runtime, {u: name for u, name, pinned in runtime.session.units() if not pinned}


def run_in_thread(runtime, unit, block):
    """Another thread enters ``block`` (its ddo pre-hook) and stays inside until the returned
    event is set, then leaves (its post-hook). Returns the event and the thread."""
    import threading

    inside, leave = threading.Event(), threading.Event()

    def other():
        runtime._pre(unit)(block, ())
        inside.set()
        leave.wait()
        runtime._post(unit)(block, (), None)

    worker = threading.Thread(target=other)
    worker.start()
    inside.wait()
    return leave, worker


class CountingSession:
    """The native session with its per-block calls counted."""

    def __init__(self, inner):
        self.inner, self.calls = inner, {"acquire": [], "reached": []}

    def acquire(self, unit, stream):
        self.calls["acquire"].append(unit)
        return self.inner.acquire(unit, stream)

    def reached(self, unit):
        self.calls["reached"].append(unit)
        return self.inner.reached(unit)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class LoggedSession(CountingSession):
    """The native session with each acquire and release logged as (call, lease, thread name)."""

    def __init__(self, inner, log):
        super().__init__(inner)
        self.log = log

    def release(self, lease, stream):
        import threading

        self.log.append(("release", lease, threading.current_thread().name))
        return self.inner.release(lease, stream)

    def acquire(self, unit, stream):
        import threading

        lease = self.inner.acquire(unit, stream)
        self.log.append(("acquire", lease, threading.current_thread().name))
        return lease


def test_resident_blocks_take_no_lease_of_their_own_inside_a_pass(tmp_path, sd3):
    model, inputs = sd3
    reference = run(copy.deepcopy(model), inputs)
    loaded, runtime, units = load_mixed(tmp_path, model)
    streamed = set(runtime.streamed)
    resident = set(units) - streamed
    assert resident and streamed, (resident, streamed)
    runtime.session = counting = CountingSession(runtime.session)
    for _ in range(3):
        assert torch.equal(run(loaded.module, inputs), reference)
    assert set(counting.calls["acquire"]) == streamed and len(counting.calls["acquire"]) == 3 * len(streamed)
    assert sorted(counting.calls["reached"]) == sorted(list(resident) * 3)
    snapshot = metrics(loaded.offload)
    assert snapshot["runtime"]["prefetch_hits"] > 0 and snapshot["runtime"]["prefetch_cancels"] == 0, snapshot["runtime"]
    # Outside a pass (a block called on its own) a resident block takes its own lease.
    counting.calls["acquire"].clear()
    block = loaded.module.get_submodule(units[min(resident)])
    assert not runtime.pass_units
    with torch.no_grad():
        for hook in block._forward_pre_hooks.values():
            hook(block, ())
        for hook in block._forward_hooks.values():
            hook(block, (), None)
    assert counting.calls["acquire"] == [min(resident)]
    assert torch.equal(run(loaded.module, inputs), reference)
    loaded.offload.remove()


def test_a_blocks_post_hook_gives_back_only_its_own_threads_lease(tmp_path, sd3):
    """A resident block run directly in another thread during a pass takes its own lease, and
    that thread's post-hook, not the pass's, gives it back."""
    import threading

    model, inputs = sd3
    loaded, runtime, units = load_mixed(tmp_path, model)
    unit = min(set(units) - set(runtime.streamed))
    block = loaded.module.get_submodule(units[unit])
    pre, post = runtime._pre(unit), runtime._post(unit)
    inside, other_done, pass_post_done = threading.Event(), threading.Event(), threading.Event()
    log = []

    runtime.session = LoggedSession(runtime.session, log)

    def other():
        inside.wait()
        pre(block, ())
        other_done.set()
        pass_post_done.wait()
        post(block, (), None)

    worker = threading.Thread(target=other, name="other")
    worker.start()

    def in_the_pass(_m, _args):
        inside.set()
        other_done.wait()

    handles = [
        block.register_forward_pre_hook(in_the_pass, prepend=True),
        block.register_forward_hook(lambda *_: pass_post_done.set()),  # after ddo's post-hook
    ]
    run(loaded.module, inputs)
    for h in handles:
        h.remove()
    worker.join()
    acquired = [lease for kind, lease, who in log if kind == "acquire" and who == "other"]
    released = [(lease, who) for kind, lease, who in log if kind == "release" and lease in acquired]
    assert acquired and released == [(acquired[0], "other")], log
    loaded.offload.remove()


def test_a_pass_that_ends_leaves_another_threads_lease_to_that_thread(tmp_path, sd3):
    """A block run in another thread takes its lease during a pass and ends after the pass: the
    pass's end gives back only its own leases, and that thread's post-hook gives back its own."""
    import threading

    model, inputs = sd3
    reference = run(copy.deepcopy(model), inputs)
    loaded, runtime, units = load_mixed(tmp_path, model)
    unit = min(set(units) - set(runtime.streamed))
    block = loaded.module.get_submodule(units[unit])
    pre, post = runtime._pre(unit), runtime._post(unit)
    log = []

    runtime.session = LoggedSession(runtime.session, log)
    acquired, pass_ended = threading.Event(), threading.Event()

    def other():
        pre(block, ())
        acquired.set()
        pass_ended.wait(timeout=60)
        post(block, (), None)

    worker = threading.Thread(target=other, name="other")

    def in_the_pass(_m, _args):
        worker.start()
        acquired.wait()

    h = block.register_forward_pre_hook(in_the_pass, prepend=True)
    assert torch.equal(run(loaded.module, inputs), reference)  # the pass ends; "other" still holds
    h.remove()
    assert any(u == unit for _, u in runtime.leases)
    pass_ended.set()
    worker.join()
    mine = [lease for kind, lease, who in log if kind == "acquire" and who == "other"]
    assert [(lease, who) for kind, lease, who in log if kind == "release" and lease in mine] == [(mine[0], "other")], log
    assert runtime.leases == {}
    assert torch.equal(run(loaded.module, inputs), reference)
    loaded.offload.remove()


def test_a_pass_never_uploads_over_a_block_another_stream_holds(tmp_path, sd3):
    """Another stream's lease on a streamed unit survives a pass's begin and end: a unit that
    shares its slot is refused until that lease is given back, and the held unit's bytes stay."""
    model, inputs = sd3
    loaded, runtime, units = load_mixed(tmp_path, model)
    s = runtime.session
    streamed = sorted(runtime.streamed)
    held = s.acquire(streamed[0], 7)
    views = [w for _, _, w, _ in runtime.swaps[streamed[0]]]
    before = [w.clone() for w in views]
    sharing = []
    for unit in streamed[1:]:
        try:
            s.release(s.acquire(unit, 1), 1)
        except ddo._native.DynamicOffloadError as e:
            assert "leased by" in str(e), e
            sharing.append(unit)
    assert sharing, "no unit shares the held unit's slot"
    s.begin_pass(1)
    with pytest.raises(ddo._native.DynamicOffloadError, match="leased by"):
        s.acquire(sharing[0], 1)
    s.end_pass(1)
    assert all(torch.equal(a, b) for a, b in zip(views, before))
    s.release(held, 7)
    s.release(s.acquire(sharing[0], 1), 1)
    loaded.offload.remove()


def test_a_block_called_directly_that_raises_leaves_the_module_usable(tmp_path, sd3):
    model, inputs = sd3
    reference = run(copy.deepcopy(model), inputs)
    loaded, runtime, units = load_mixed(tmp_path, model)
    block = loaded.module.get_submodule(units[sorted(runtime.streamed)[0]])

    def boom(*_args):
        raise RuntimeError("inside the block")

    h = block.register_forward_pre_hook(boom)  # after ddo's pre-hook: its lease is taken
    with pytest.raises(RuntimeError, match="inside the block"), torch.no_grad():
        block(torch.zeros(1))
    h.remove()
    # ddo's post-hook runs however the block ends: its lease is back.
    assert runtime.leases == {}
    assert torch.equal(run(loaded.module, inputs), reference)
    # A lease the block's thread never gave back (its post-hook never ran) is given back
    # before that thread's next forward begins.
    runtime._pre(sorted(runtime.streamed)[0])(block, ())
    assert runtime.leases
    assert torch.equal(run(loaded.module, inputs), reference)
    assert runtime.leases == {}
    loaded.offload.remove()


def test_a_streamed_block_another_thread_runs_or_left_is_named_and_a_dead_threads_is_given_back(tmp_path, sd3):
    """A streamed block another thread runs now: a forward and the changes between passes are
    refused naming it, and served once it returns. A block a thread left by a KeyboardInterrupt
    (its post-hook never runs) is given back once that thread has ended."""
    import threading

    model, inputs = sd3
    reference = run(copy.deepcopy(model), inputs)
    loaded, runtime, units = load_mixed(tmp_path, model)
    unit = sorted(runtime.streamed)[0]
    block = loaded.module.get_submodule(units[unit])
    leave, worker = run_in_thread(runtime, unit, block)
    for call in (lambda: run(loaded.module, inputs), loaded.offload.reclaim, loaded.offload.unload):
        with pytest.raises(ddo.DynamicOffloadLifecycleError, match=f"{units[unit]} runs in another thread"):
            call()
    leave.set()
    worker.join()
    assert torch.equal(run(loaded.module, inputs), reference)

    def interrupted():
        def stop(*_args):
            raise KeyboardInterrupt

        h = block.register_forward_pre_hook(stop)
        try:
            with torch.no_grad():
                block(torch.zeros(1))
        except KeyboardInterrupt:
            pass
        finally:
            h.remove()

    ended = threading.Thread(target=interrupted)
    ended.start()
    ended.join()
    assert runtime.leases, "a KeyboardInterrupt skips the post-hook"
    assert torch.equal(run(loaded.module, inputs), reference)
    assert runtime.leases == {}
    loaded.offload.unload()
    loaded.offload.reload()
    assert torch.equal(run(loaded.module, inputs), reference)
    loaded.offload.remove()


def test_a_streamed_block_another_thread_enters_during_a_pass_is_not_taken_for_a_changed_weight(tmp_path, sd3):
    """Another thread enters a streamed block while a pass runs, before the pass reaches it (its
    pre-hook compares the block's parameters for the pass, its views then go in place): the pass
    does not take them for a changed parameter but fails on the slot that thread holds, saying
    so, and the module serves once the block returns."""
    import threading

    model, inputs = sd3
    reference = run(copy.deepcopy(model), inputs)
    loaded, runtime, units = load_mixed(tmp_path, model)
    unit = sorted(runtime.streamed)[0]
    block = loaded.module.get_submodule(units[unit])
    first = loaded.module.pos_embed  # runs before every block
    leave, worker = threading.Event(), []

    def enter_it(_m, _args):
        if not worker:
            inside = threading.Event()

            def other():
                runtime._pre(unit)(block, ())
                inside.set()
                leave.wait(timeout=60)
                runtime._post(unit)(block, (), None)

            worker.append(threading.Thread(target=other))
            worker[0].start()
            inside.wait()

    h = first.register_forward_pre_hook(enter_it, prepend=True)
    with pytest.raises(ddo.DynamicOffloadError, match="leased by unit") as refused:
        run(loaded.module, inputs)
    assert "changed" not in str(refused.value) and "holds another" not in str(refused.value)
    h.remove()
    leave.set()
    worker[0].join()
    assert runtime.leases == {}
    assert torch.equal(run(loaded.module, inputs), reference)
    loaded.offload.remove()


def test_a_block_running_in_another_thread_defers_the_automatic_budget(tmp_path, sd3):
    """A resident block another thread runs when a pass ends holds its lease: the automatic
    budget plans after a later pass instead of taking the refusal for a budget too small."""
    import threading

    model, inputs = sd3
    reference = run(copy.deepcopy(model), inputs)
    loaded, runtime, units = load_mixed(tmp_path, model, auto_budget_policy="balanced")
    assert runtime.streamed
    unit = min(set(units) - set(runtime.streamed))
    block = loaded.module.get_submodule(units[unit])
    leave, worker = run_in_thread(runtime, unit, block)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "budget too small" warning
        assert torch.equal(run(loaded.module, inputs), reference)
    setup = metrics(loaded.offload)["setup"]
    assert setup["auto_budget"]["decision"] == "kept_blocks_running" and setup["streamed_units"] > 0, setup
    leave.set()
    worker.join()
    assert torch.equal(run(loaded.module, inputs), reference)
    setup = metrics(loaded.offload)["setup"]
    assert setup["auto_budget"]["replans"] == 1 and setup["auto_budget"]["decision"] == "first_pass", setup
    assert setup["streamed_units"] == 0
    assert torch.equal(run(loaded.module, inputs), reference)
    loaded.offload.remove()
