"""The native route (vmm_fast_runtime) on the CPU: the same arena, on the host backend. Weights
stream from the checkpoint's mapping into arena memory that parameters view without copying."""

from __future__ import annotations

import copy

import pytest
import torch

import ddo


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def budget_for(model, slots=2):
    """The resident rest plus `slots` of the largest unit, in GiB: most units stream."""
    granule = 2 << 20
    units = ddo.find_execution_units(model)
    in_units = {id(p) for _, m in units for p in m.parameters()}
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_units)
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters()) for _, m in units)
    up = lambda n: (n + granule - 1) // granule * granule  # noqa: E731
    return (up(rest) + slots * up(largest)) / 2**30


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
    assert result.route == "vmm_fast_runtime"
    for _ in range(3):
        assert torch.equal(run(loaded.module, inputs), reference), name
    stats = result.native.stats()
    assert stats["streamed_units"] >= 2 and stats["execution_slots"] >= 2, stats
    runtime = stats["runtime"]
    assert runtime["prefetch_hits"] > 0 and runtime["uploads"] > stats["streamed_units"]
    snapshot = result.metrics_snapshot(collect_completed=True).as_dict()
    assert snapshot["route"]["name"] == "vmm_fast_runtime"
    assert snapshot["setup"]["streamed_units"] == stats["streamed_units"]
    assert "prefetch_hits" in snapshot["runtime"]


def test_views_are_built_once_at_fixed_addresses(tmp_path, flux):
    model, inputs = flux
    loaded = load_native(tmp_path, model)
    before = {n: p.data_ptr() for n, p in loaded.module.named_parameters()}
    run(loaded.module, inputs)
    run(loaded.module, inputs)
    assert {n: p.data_ptr() for n, p in loaded.module.named_parameters()} == before


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
    stats = loaded.offload.native.stats()
    assert stats["registered_bytes"] > 0
    assert loaded.bound == len(loaded.source["tensors"])
