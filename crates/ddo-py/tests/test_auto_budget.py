"""auto_budget_policy = balanced: the native arena's budget from the device's free memory, planned
again after the first pass and when the working set grows (host backend: the host's memory)."""

from __future__ import annotations

import copy

import pytest
import torch

import ddo
from ddo import runtime as ddo_runtime
from ddo.runtime import publishing

MIB = 1 << 20


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def load(tmp_path, flux, **config):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    folder = tmp_path / "transformer"
    model.save_pretrained(folder)
    loaded = ddo.from_pretrained_with_dynamic_offload(
        folder,
        apply_dynamic=True,
        dynamic_offload_config=ddo.DynamicOffloadConfig(
            backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=0.007, **config
        ),
    )
    return loaded, inputs, reference


def reference_keys(flux):
    return flux[0].state_dict().keys()


def auto(loaded):
    return loaded.offload.metrics_snapshot().as_dict()["setup"]


def test_the_first_pass_sizes_the_budget_from_free_memory(tmp_path, flux):
    loaded, inputs, reference = load(tmp_path, flux, auto_budget_policy="balanced")
    before = auto(loaded)
    assert before["streamed_units"] > 0 and before["auto_budget"]["replans"] == 0
    assert before["auto_budget"]["headroom_bytes"] == 1 << 30
    assert torch.equal(run(loaded.module, inputs), reference)
    after = auto(loaded)
    # The host has far more free memory than this model: everything is resident now.
    assert after["auto_budget"]["replans"] == 1 and after["auto_budget"]["decision"] == "first_pass"
    assert after["streamed_units"] == 0 and after["gpu_budget_bytes"] > before["gpu_budget_bytes"]
    assert after["auto_budget"]["budget_bytes"] == after["gpu_budget_bytes"]
    assert after["registered_bytes"] == before["registered_bytes"]
    for _ in range(3):
        assert torch.equal(run(loaded.module, inputs), reference)
    m = loaded.offload.metrics_snapshot()
    m.validate()
    assert "auto_budget=policy=balanced" in m.format_profile()
    assert m.as_dict()["setup"]["auto_budget"]["replans"] == 1
    loaded.offload.remove()


def test_a_growing_working_set_plans_a_smaller_budget(tmp_path, flux, monkeypatch):
    loaded, inputs, reference = load(tmp_path, flux, auto_budget_policy="balanced", auto_vram_headroom_gb=0.004)
    budget = loaded.offload.runtime.auto_budget
    headroom = budget.headroom
    free = {"bytes": 512 * MIB}
    budget.free = lambda _device: free["bytes"]
    assert torch.equal(run(loaded.module, inputs), reference)
    first = auto(loaded)
    assert first["auto_budget"]["decision"] == "first_pass"
    # The held arena plus 512 MiB free, less the headroom: everything resident.
    assert first["gpu_budget_bytes"] > 500 * MIB and first["streamed_units"] == 0
    # Free memory falls below half the headroom (another allocation, larger activations).
    free["bytes"] = headroom // 4
    assert torch.equal(run(loaded.module, inputs), reference)
    second = auto(loaded)
    assert second["auto_budget"]["decision"] == "working_set_grew" and second["auto_budget"]["replans"] == 2
    assert second["gpu_budget_bytes"] < first["gpu_budget_bytes"]
    # Plenty free again: a later pass changes nothing.
    free["bytes"] = 1 << 40
    assert torch.equal(run(loaded.module, inputs), reference)
    assert auto(loaded)["auto_budget"]["replans"] == 2
    # A budget that cannot hold two slots keeps the last one, with a warning that says why.
    free["bytes"] = 0
    with pytest.warns(UserWarning, match="cannot run in"):
        assert torch.equal(run(loaded.module, inputs), reference)
    assert auto(loaded)["auto_budget"]["decision"] == "kept_too_small"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not at every pass
        assert torch.equal(run(loaded.module, inputs), reference)
    loaded.offload.remove()


def test_a_kept_weight_view_keeps_the_budget(tmp_path, flux):
    loaded, inputs, reference = load(tmp_path, flux, auto_budget_policy="balanced")
    resident = next(n for n, p in loaded.module.named_parameters() if p.device.type == "cpu" and not p.is_meta)
    kept = loaded.module.get_parameter(resident).detach()
    assert torch.equal(run(loaded.module, inputs), reference)
    assert auto(loaded)["auto_budget"]["decision"] in ("kept_views_held", "first_pass")
    del kept
    assert torch.equal(run(loaded.module, inputs), reference)
    loaded.offload.remove()


def test_balanced_is_refused_off_the_native_route(flux):
    model, _ = flux
    with pytest.raises(ddo.DynamicOffloadConfigError, match="use backend vmm"):
        ddo.enable_offload(
            model, route="dynamic_offload", execution_device="cpu", auto_budget_policy="balanced", use_environment=False
        )
    assert ddo.get_dynamic_offload_state(model) is None


def test_free_memory_is_read_from_the_host_for_the_host_backend():
    free = ddo_runtime.device_free_bytes(torch.device("cpu"))
    assert 0 < free < 1 << 50


class _FailingBudget:
    """The session, with a budget change that fails so badly the component ends unloaded (what
    the device running out of memory for both the new and the last budget does)."""

    def __init__(self, session):
        self._session = session

    def __getattr__(self, name):
        return getattr(self._session, name)

    def set_budget(self, _total):
        self._session.unload()
        raise ddo.DynamicOffloadError("out of device memory")


def test_a_budget_change_that_fails_leaves_the_component_unloaded_and_reloadable(tmp_path, flux):
    loaded, inputs, reference = load(tmp_path, flux, auto_budget_policy="balanced")
    runtime = loaded.offload.runtime
    runtime.session = _FailingBudget(runtime.session)
    with pytest.warns(UserWarning, match="the component is unloaded: free GPU memory and call reload"):
        assert torch.equal(run(loaded.module, inputs), reference)
    assert auto(loaded)["auto_budget"]["decision"] == "unloaded"
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="reload"):
        run(loaded.module, inputs)
    runtime.session = runtime.session._session
    loaded.offload.reload()
    assert torch.equal(run(loaded.module, inputs), reference)
    loaded.offload.remove()


def test_a_first_pass_under_inference_mode_plans_again_and_keeps_the_write_guard(tmp_path, flux):
    loaded, inputs, reference = load(tmp_path, flux, auto_budget_policy="balanced")
    with torch.inference_mode():
        assert torch.equal(loaded.module(**inputs)[0], reference)
        assert auto(loaded)["auto_budget"]["decision"] == "first_pass"
        assert torch.equal(loaded.module(**inputs)[0], reference)
    runtime = loaded.offload.runtime
    assert runtime.watched and not any(p.is_inference() for _, _, p, _, _ in runtime.watched)
    # A write into a weight published by the re-plan is still refused at the next forward.
    weight = next(p for p in loaded.module.parameters() if not p.is_meta)
    with torch.no_grad():
        weight.add_(1)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="written in place"):
        run(loaded.module, inputs)
    loaded.offload.remove()


@pytest.mark.parametrize("where", ["_publish_meta", "_publish_views_now"])
def test_an_interrupt_while_the_budget_is_planned_again_leaves_the_module_usable(tmp_path, flux, where):
    loaded, inputs, reference = load(tmp_path, flux, auto_budget_policy="balanced")
    runtime = loaded.offload.runtime
    real = getattr(runtime, where)
    calls = {"n": 0}

    def interrupted(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            # Half the parameters changed, then Ctrl-C.
            half = runtime.places[: len(runtime.places) // 2]
            for owner, attr, _ in half:
                p = owner._parameters[attr]
                owner._parameters[attr] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), False)
            raise KeyboardInterrupt
        return real(*args)

    setattr(runtime, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(loaded.module, inputs)
    for _ in range(2):
        assert torch.equal(run(loaded.module, inputs), reference)
    assert runtime.views_whole and not any(p.is_meta for _, _, p, _, _ in runtime.watched)
    # The interrupted first re-plan is made by the next pass: everything resident.
    assert auto(loaded)["streamed_units"] == 0
    assert loaded.module.state_dict().keys() == reference_keys(flux)
    loaded.offload.remove()


def test_counters_go_on_across_a_budget_change(tmp_path, flux):
    loaded, inputs, reference = load(tmp_path, flux, auto_budget_policy="balanced")
    for _ in range(3):
        assert torch.equal(run(loaded.module, inputs), reference)
    assert auto(loaded)["auto_budget"]["replans"] == 1
    runtime = loaded.offload.metrics_snapshot().as_dict()["runtime"]
    assert runtime["passes"] == 3 and runtime["uploads"] > 0
    loaded.offload.remove()


def test_a_write_after_an_interrupted_unload_is_still_refused(tmp_path, flux, monkeypatch):
    loaded, inputs, reference = load(tmp_path, flux, auto_budget_policy="balanced")
    assert torch.equal(run(loaded.module, inputs), reference)
    real, calls = publishing._parameter_like, {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(publishing, "_parameter_like", flaky)
    with pytest.raises(KeyboardInterrupt):
        loaded.offload.unload()
    monkeypatch.setattr(publishing, "_parameter_like", real)
    weight = [p for p in loaded.module.parameters() if not p.is_meta][-1]
    with torch.no_grad():
        weight.fill_(1)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="written in place"):
        run(loaded.module, inputs)


