"""Whole pipelines from one call: tiny random Flux-, SD3- and Wan-shaped pipelines saved with
tokenizers built here, loaded with every model component streamed from its checkpoint, generate
exactly what Diffusers' own loading generates."""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest
import torch

import ddo

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from tiny_pipelines import PIPELINES, flux_pipeline, generate, own_memory  # noqa: E402

def every_model_streamed(**overrides):
    """Every model component on the arena (text encoders and VAE included), on the CPU, with a
    budget of three 2 MiB granules so the blocks of each stream."""
    components = {n: ddo.ComponentPolicy(route="dynamic") for n in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae")}
    settings = {"vmm_resident_weight_budget_gb": 6 / 1024, **overrides}
    return ddo.DynamicOffloadConfig(backend="vmm", execution_device="cpu", components=components, **settings)


@pytest.mark.parametrize("family", sorted(PIPELINES))
def test_a_pipeline_folder_loads_in_one_call_and_generates_what_diffusers_generates(tmp_path, family):
    from diffusers import DiffusionPipeline

    torch.manual_seed(0)
    pipe, extra = PIPELINES[family]()
    pipe.save_pretrained(tmp_path / family)
    want = generate(own_memory(DiffusionPipeline.from_pretrained(tmp_path / family)), extra)
    result = ddo.from_pretrained_pipeline_with_dynamic_offload(tmp_path / family, dynamic_offload_config=every_model_streamed())
    assert type(result.pipeline) is type(pipe)
    models = {n for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    assert set(result.offload) == models, result.offload.keys()
    routes = {n: r.metrics_snapshot().as_dict()["execution"]["route"] for n, r in result.offload.items()}
    assert set(routes.values()) == {"vmm_fast_runtime"}, routes
    streamed = {n: s.as_dict()["setup"]["streamed_units"] for n, s in result.metrics_snapshots().items()}
    assert streamed["transformer"] >= 2, streamed
    for _ in range(2):
        np.testing.assert_array_equal(generate(result.pipeline, extra), want)
    result.remove()


def test_one_gpu_budget_is_split_by_weight_bytes(tmp_path):
    pipe, extra = flux_pipeline()
    pipe.save_pretrained(tmp_path / "flux")
    result = ddo.from_pretrained_pipeline_with_dynamic_offload(
        tmp_path / "flux", dynamic_offload_config=every_model_streamed(), gpu_budget_gb=1.0
    )
    budgets = result.budgets_gb
    assert set(budgets) == set(result.offload) and abs(sum(budgets.values()) - 1.0) < 1e-9, budgets
    sizes = {n: sum(p.numel() * p.element_size() for p in getattr(pipe, n).parameters()) for n in budgets}
    assert max(budgets, key=budgets.get) == max(sizes, key=sizes.get)
    for name, r in result.offload.items():
        gpu = r.metrics_snapshot().as_dict()["setup"]["gpu_budget_bytes"]
        assert abs(gpu - budgets[name] * 2**30) < 1e6, (name, gpu, budgets[name])
    result.remove()
    tiny = ddo.from_pretrained_pipeline_with_dynamic_offload
    with pytest.raises(ddo.DynamicOffloadCapacityError, match="share of gpu_budget_gb=0.001 .*raise gpu_budget_gb"):
        tiny(tmp_path / "flux", dynamic_offload_config=every_model_streamed(), gpu_budget_gb=0.001)


def test_device_map_places_components_and_each_device_splits_its_own_budget(tmp_path):
    from diffusers import DiffusionPipeline

    torch.manual_seed(0)
    pipe, extra = flux_pipeline()
    pipe.save_pretrained(tmp_path / "flux")
    want = generate(own_memory(DiffusionPipeline.from_pretrained(tmp_path / "flux")), extra)
    placed = {"text_encoder": "cpu", "text_encoder_2": torch.device("cpu")}
    result = ddo.from_pretrained_pipeline_with_dynamic_offload(
        tmp_path / "flux", dynamic_offload_config=every_model_streamed(), device_map=placed, gpu_budget_gb={"cpu": 1.0}
    )
    assert result.devices == {"text_encoder": "cpu", "text_encoder_2": "cpu"}
    assert set(result.budgets_gb) == set(result.offload) and abs(sum(result.budgets_gb.values()) - 1.0) < 1e-9
    for name, r in result.offload.items():
        setup = r.metrics_snapshot().as_dict()["setup"]
        assert setup["execution_device"] == "cpu", (name, setup["execution_device"])
        assert abs(setup["gpu_budget_bytes"] - result.budgets_gb[name] * 2**30) < 1e6, name
    np.testing.assert_array_equal(generate(result.pipeline, extra), want)
    result.remove()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"device_map": {"unet": "cpu"}}, r"device_map names unet, which is not a model component this call loads \(model components: .*transformer"),
        ({"device_map": {"vae": "gpu7"}}, r"device_map\['vae'\] is 'gpu7', not a device"),
        ({"device_map": {"vae": "meta"}}, r"device_map\['vae'\] is 'meta': ddo runs components on 'cuda:N' or 'cpu'"),
        ({"gpu_budget_gb": {"cuda:1": 1.0}}, r"gpu_budget_gb names cuda:1, and these components .* run elsewhere: .*transformer \(cpu\)"),
        ({"gpu_budget_gb": {"cpu": 1.0, "cuda:1": 2.0}}, r"gives cuda:1 a budget, and no component on vmm_fast_runtime runs there"),
        ({"gpu_budget_gb": {"cpu": -1}}, r"gpu_budget_gb\['cpu'\] must be a positive number of GiB"),
        ({"gpu_budget_gb": "8"}, r"gpu_budget_gb must be a number of GiB or a mapping of devices to GiB"),
        ({"gpu_budget_gb": float("nan")}, r"gpu_budget_gb must be a positive number of GiB, not nan"),
        ({"gpu_budget_gb": 0}, r"gpu_budget_gb must be a positive number of GiB, not 0"),
        ({"gpu_budget_gb": {"cpu": float("inf")}}, r"gpu_budget_gb\['cpu'\] must be a positive number of GiB, not inf"),
        ({"gpu_budget_gb": 10**400}, r"gpu_budget_gb must be a positive number of GiB"),
        ({"gpu_budget_gb": {"cpu": 1.0, "cpu:0": 2.0}}, r"gpu_budget_gb names cpu twice"),
        ({"gpu_budget_gb": {}}, r"gpu_budget_gb is an empty mapping"),
        ({"device_map": "balanced"}, r"device_map must map component names to devices"),
        ({"device_map": {"tokenizer": "cpu"}}, r"device_map names tokenizer, which is not a model component .*tokenizers and schedulers have no device"),
    ],
)
def test_placements_and_budgets_that_cannot_be_served_are_refused_by_name(tmp_path, kwargs, message):
    pipe, _ = flux_pipeline()
    pipe.save_pretrained(tmp_path / "flux")
    with pytest.raises(ddo.DynamicOffloadConfigError, match=message):
        ddo.from_pretrained_pipeline_with_dynamic_offload(tmp_path / "flux", dynamic_offload_config=every_model_streamed(), **kwargs)


def test_budgets_follow_the_device_the_environment_names_and_take_numpy_numbers(tmp_path, monkeypatch):
    pipe, _ = flux_pipeline()
    pipe.save_pretrained(tmp_path / "flux")
    load = ddo.from_pretrained_pipeline_with_dynamic_offload
    # The config leaves execution_device unset: DDO_EXECUTION_DEVICE decides, for the split too.
    config = ddo.DynamicOffloadConfig(backend="vmm", vmm_resident_weight_budget_gb=6 / 1024)
    monkeypatch.setenv("DDO_EXECUTION_DEVICE", "cuda:3")
    with pytest.raises(ddo.DynamicOffloadConfigError, match=r"run elsewhere: transformer \(cuda:3\)"):
        load(tmp_path / "flux", dynamic_offload_config=config, gpu_budget_gb={"cpu": 1.0})
    monkeypatch.setenv("DDO_EXECUTION_DEVICE", "cpu")
    result = load(tmp_path / "flux", dynamic_offload_config=config, gpu_budget_gb={"cpu": np.float32(1.0)})
    assert abs(sum(result.budgets_gb.values()) - 1.0) < 1e-6, result.budgets_gb
    result.remove()


def test_a_component_that_fails_to_load_is_named_and_the_others_are_removed(tmp_path, monkeypatch):
    pipe, _ = flux_pipeline()
    pipe.save_pretrained(tmp_path / "flux")
    removed = []
    real_remove = ddo.DynamicOffloadApplyResult.remove
    monkeypatch.setattr(ddo.DynamicOffloadApplyResult, "remove", lambda self: (removed.append(self), real_remove(self)))
    # A GPU this machine does not have: the component placed on it fails.
    absent = f"cuda:{torch.cuda.device_count() + 1}"
    with pytest.raises(ddo.DynamicOffloadError, match=absent) as info:
        ddo.from_pretrained_pipeline_with_dynamic_offload(
            tmp_path / "flux", dynamic_offload_config=every_model_streamed(), device_map={"transformer": absent}
        )
    assert any("while loading component transformer" in n and absent in n for n in info.value.__notes__), info.value.__notes__
    assert removed, "the components loaded before it are removed"


def test_a_folder_without_a_pipeline_says_so(tmp_path):
    with pytest.raises(ddo.DynamicOffloadError, match="model_index.json"):
        ddo.from_pretrained_pipeline_with_dynamic_offload(tmp_path)


def test_plain_settings_of_the_index_reach_the_pipeline(tmp_path):
    from tiny_pipelines import wan_pipeline
    from diffusers import WanPipeline

    pipe, _ = wan_pipeline()
    pipe = WanPipeline(**{k: v for k, v in pipe.components.items() if v is not None}, boundary_ratio=0.875)
    pipe.save_pretrained(tmp_path / "wan")
    result = ddo.from_pretrained_pipeline_with_dynamic_offload(tmp_path / "wan", dynamic_offload_config=every_model_streamed())
    assert result.pipeline.config.boundary_ratio == 0.875
    assert result.pipeline.transformer_2 is None
    result.remove()


def test_a_budget_with_nothing_to_split_among_is_refused(tmp_path):
    pipe, _ = flux_pipeline()
    pipe.save_pretrained(tmp_path / "flux")
    linear = ddo.DynamicOffloadConfig(backend="linear", execution_device="cpu")
    with pytest.raises(ddo.DynamicOffloadConfigError, match="gpu_budget_gb=2 .*none resolved to it"):
        ddo.from_pretrained_pipeline_with_dynamic_offload(tmp_path / "flux", dynamic_offload_config=linear, gpu_budget_gb=2)


@pytest.mark.parametrize(
    "index,message",
    [("[]", "not an object of components"), ('{"_class_name": "FluxPipeline", "x": ["os", "system"]}', "not a class"),
     ('{"_class_name": "FluxPipeline", "x": ["diffusers", "NoSuchThing"]}', "not a class"), ("{", "cannot be read as JSON")],
)
def test_a_bad_index_is_refused_by_name(tmp_path, index, message):
    (tmp_path / "model_index.json").write_text(index)
    with pytest.raises(ddo.DynamicOffloadError, match=message):
        ddo.from_pretrained_pipeline_with_dynamic_offload(tmp_path)
    (tmp_path / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    with pytest.raises(ddo.DynamicOffloadConfigError, match="number of GiB"):
        ddo.from_pretrained_pipeline_with_dynamic_offload(tmp_path, gpu_budget_gb=True)


def test_a_variant_loads_its_own_files(tmp_path):
    from diffusers import DiffusionPipeline

    torch.manual_seed(0)
    pipe, extra = flux_pipeline()
    pipe.save_pretrained(tmp_path / "flux")
    # An fp16 variant beside the plain files, with other values, as hub repos hold them.
    torch.manual_seed(1)
    other, _ = flux_pipeline()
    other.to(torch.float16).save_pretrained(tmp_path / "variant", variant="fp16")
    for weights in (tmp_path / "variant").glob("*/*.fp16.safetensors"):
        shutil.copy(weights, tmp_path / "flux" / weights.parent.name / weights.name)
    want = generate(own_memory(DiffusionPipeline.from_pretrained(tmp_path / "flux", variant="fp16", torch_dtype=torch.float32)), extra)
    plain = generate(own_memory(DiffusionPipeline.from_pretrained(tmp_path / "flux")), extra)
    assert not np.array_equal(want, plain)
    result = ddo.from_pretrained_pipeline_with_dynamic_offload(
        tmp_path / "flux",
        variant="fp16",
        torch_dtype=torch.float32,
        # fp16 widens to fp32 on the device: a granule more for the staging buffer.
        dynamic_offload_config=every_model_streamed(vmm_resident_weight_budget_gb=8 / 1024),
    )
    np.testing.assert_array_equal(generate(result.pipeline, extra), want)
    result.remove()
    # Without a variant, the plain files (variant files beside them are skipped).
    result = ddo.from_pretrained_pipeline_with_dynamic_offload(tmp_path / "flux", dynamic_offload_config=every_model_streamed())
    np.testing.assert_array_equal(generate(result.pipeline, extra), plain)
    result.remove()
    with pytest.raises(ddo.DynamicOffloadError, match="no single checkpoint of variant 'bf16'"):
        ddo.from_pretrained_pipeline_with_dynamic_offload(tmp_path / "flux", variant="bf16", dynamic_offload_config=every_model_streamed())
