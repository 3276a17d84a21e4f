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


def one_adapter_on_both(loaded, reference, inputs):
    """The same adapter on the resident and the offloaded model; the resident output with it."""
    adapter(reference)
    adapter(loaded.module)
    same_adapters(reference, loaded.module)
    return run(reference, inputs)


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
    want = one_adapter_on_both(loaded, reference, inputs)
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
    want = one_adapter_on_both(loaded, reference, inputs)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="fuse"):
        loaded.module.fuse_lora()
    assert torch.equal(run(loaded.module, inputs), want), "nothing was written"
    # Merging through peft directly (what merge_and_unload and Diffusers' fuse paths call) is
    # refused before anything is written.
    layer = next(m for m in loaded.module.modules() if hasattr(m, "merged_adapters"))
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="merging adapters"):
        layer.merge()
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="merging adapters"):
        layer.merge(safe_merge=True)
    assert torch.equal(run(loaded.module, inputs), want), "nothing was written"
    # A layer that says it is merged (merged before attach, say) does not run with streamed
    # unmerged weights: the forward is refused.
    layer.merged_adapters.append("style")
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="fused"):
        run(loaded.module, inputs)
    layer.merged_adapters.clear()
    assert torch.equal(run(loaded.module, inputs), want)
    loaded.offload.remove()


def test_an_adapter_loads_from_its_state_dict_as_pipelines_load_it(offloaded):
    from peft.utils import get_peft_model_state_dict

    loaded, reference, inputs = offloaded
    adapter(reference)
    want = run(reference, inputs)
    weights = get_peft_model_state_dict(reference, adapter_name="style")
    loaded.module.load_lora_adapter(weights, prefix=None, adapter_name="style")
    assert torch.equal(run(loaded.module, inputs), want)
    # A state dict naming a streamed weight is still refused, and nothing is loaded.
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="view arena memory"):
        loaded.module.load_state_dict({"proj_out.weight": torch.zeros(4, 32)}, strict=False)
    assert torch.equal(run(loaded.module, inputs), want)
    loaded.offload.remove()


def test_an_adapter_without_values_is_refused_with_what_to_do(offloaded):
    loaded, _, inputs = offloaded
    run(loaded.module, inputs)
    loaded.offload.unload()
    adapter(loaded.module)  # placed where the base weights are: meta placeholders while unloaded
    loaded.offload.reload()
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="has no values: it is meta"):
        run(loaded.module, inputs)
    loaded.module.delete_adapters("style")
    run(loaded.module, inputs)
    adapter(loaded.module)
    run(loaded.module, inputs)
    # An adapter moved in place after a forward (no parameter registered) is still checked.
    layer = next(m for m in loaded.module.modules() if hasattr(m, "lora_A"))
    layer.lora_A.to("meta")
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="has no values"):
        run(loaded.module, inputs)
    loaded.offload.remove()
