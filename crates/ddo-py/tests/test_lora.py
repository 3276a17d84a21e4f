"""LoRA adapters on an offloaded component, as users load them (peft through Diffusers): the
adapter weights are parameters the checkpoint does not hold and stay resident beside the streamed
blocks; outputs equal the same adapters on the resident model; fusing is refused clearly."""

from __future__ import annotations

import copy

import pytest
import torch

import ddo

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def adapter(model, name="style", seed=5):
    """A LoRA adapter with random (non-zero) weights on the attention projections."""
    from peft import LoraConfig

    torch.manual_seed(seed)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS, init_lora_weights=False), adapter_name=name)


def same_adapters(src, dst):
    """Copies every adapter weight of ``src`` into ``dst`` (same names)."""
    theirs = dict(dst.named_parameters())
    with torch.no_grad():
        for n, p in src.named_parameters():
            if "lora_" in n:
                theirs[n].copy_(p)


@pytest.fixture(params=["vmm", "linear"])
def offloaded(request, tmp_path, flux):
    model, inputs = flux
    reference = copy.deepcopy(model)
    path = tmp_path / "flux"
    model.save_pretrained(path)
    config = ddo.DynamicOffloadConfig(
        backend=request.param, execution_device="cpu", vmm_resident_weight_budget_gb=6 / 1024, prefetch_depth=1
    )
    loaded = ddo.from_pretrained_with_dynamic_offload(
        path, model_loader=type(model), apply_dynamic=True, component="transformer", dynamic_offload_config=config
    )
    assert loaded.offload.metrics_snapshot().as_dict()["setup"]["streamed_units"] >= 2
    return loaded, reference, inputs


def test_an_adapter_on_a_streamed_model_equals_the_same_adapter_resident(offloaded):
    loaded, reference, inputs = offloaded
    base = run(reference, inputs)
    adapter(reference)
    adapter(loaded.module)
    same_adapters(reference, loaded.module)
    want = run(reference, inputs)
    assert not torch.equal(want, base), "the adapter changes the output"
    for _ in range(2):
        assert torch.equal(run(loaded.module, inputs), want)
    # Adapter weights as set_adapters weighs them.
    reference.set_adapters(["style"], weights=[0.5])
    loaded.module.set_adapters(["style"], weights=[0.5])
    assert torch.equal(run(loaded.module, inputs), run(reference, inputs))
    # A second adapter, both active.
    adapter(reference, "detail", seed=6)
    adapter(loaded.module, "detail", seed=6)
    same_adapters(reference, loaded.module)
    reference.set_adapters(["style", "detail"], weights=[0.7, 0.3])
    loaded.module.set_adapters(["style", "detail"], weights=[0.7, 0.3])
    assert torch.equal(run(loaded.module, inputs), run(reference, inputs))
    # state_dict gives the checkpoint's base weights under the adapters' names, and the adapters.
    state = loaded.module.state_dict()
    ref_state = reference.state_dict()
    assert state.keys() == ref_state.keys()
    for k, v in ref_state.items():
        assert torch.equal(state[k], v), k
    # Unloading the adapters gives the base model back.
    loaded.module.unload_lora()
    assert torch.equal(run(loaded.module, inputs), base)
    loaded.offload.remove()


def test_fusing_an_adapter_is_refused_before_it_writes(offloaded):
    loaded, reference, inputs = offloaded
    adapter(reference)
    adapter(loaded.module)
    same_adapters(reference, loaded.module)
    want = run(reference, inputs)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="fuse"):
        loaded.module.fuse_lora()
    assert torch.equal(run(loaded.module, inputs), want), "nothing was written"
    # Fusing through peft directly is caught at the next forward, and unload/reload restores.
    for m in loaded.module.modules():
        if hasattr(m, "merge") and hasattr(m, "merged_adapters"):
            m.merge()
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="fused"):
        run(loaded.module, inputs)
    for m in loaded.module.modules():
        if getattr(m, "merged_adapters", None):
            m.unmerge()
    loaded.offload.unload()
    loaded.offload.reload()
    assert torch.equal(run(loaded.module, inputs), want)
    loaded.offload.remove()


def test_an_adapter_left_on_another_device_is_refused(offloaded):
    loaded, _, inputs = offloaded
    adapter(loaded.module)
    name, layer = next((n, m) for n, m in loaded.module.named_modules() if "lora_A" in n and hasattr(m, "weight"))
    layer.weight = torch.nn.Parameter(torch.empty(layer.weight.shape, device="meta"))
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="added after ddo attached and is on meta"):
        run(loaded.module, inputs)
