"""Loading keywords: Diffusers' own (``dtype``, ``torch_dtype``, ``variant``, ``use_safetensors``,
``local_files_only``, ...) pass through the whole-pipeline loader as Diffusers takes them, and the
configuration is ``config=`` everywhere (``dynamic_offload_config=`` still works on the loaders)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import ddo

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from tiny_pipelines import flux_pipeline, generate, own_memory  # noqa: E402

load = ddo.from_pretrained_pipeline_with_dynamic_offload


def streamed():
    components = {n: ddo.ComponentPolicy(route="dynamic") for n in ("text_encoder", "text_encoder_2", "vae")}
    return ddo.DynamicOffloadConfig(
        backend="vmm", execution_device="cpu", components=components, vmm_resident_weight_budget_gb=6 / 1024
    )


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    torch.manual_seed(0)
    pipe, extra = flux_pipeline()
    folder = tmp_path_factory.mktemp("kw") / "flux"
    pipe.save_pretrained(folder)
    return folder, extra


def model_dtypes(pipe):
    return {n: next(c.parameters()).dtype for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)}


@pytest.mark.parametrize("keyword", ["dtype", "torch_dtype"])
def test_diffusers_dtype_keyword_reaches_every_model_component(flux_folder, keyword):
    from diffusers import DiffusionPipeline

    folder, extra = flux_folder
    want = generate(own_memory(DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16)), extra)
    result = load(
        folder, config=streamed(), local_files_only=True, use_safetensors=True, low_cpu_mem_usage=True,
        **{keyword: torch.bfloat16},
    )
    try:
        assert set(model_dtypes(result.pipeline).values()) == {torch.bfloat16}, model_dtypes(result.pipeline)
        np.testing.assert_array_equal(generate(result.pipeline, extra), want)
    finally:
        result.remove()


def test_a_dtype_mapping_is_read_per_component_as_diffusers_reads_it(flux_folder):
    folder, _ = flux_folder
    result = load(folder, config=streamed(), dtype={"transformer": torch.bfloat16, "default": torch.float16})
    try:
        dtypes = model_dtypes(result.pipeline)
        assert dtypes.pop("transformer") == torch.bfloat16
        assert set(dtypes.values()) == {torch.float16}, dtypes
    finally:
        result.remove()


def test_use_safetensors_reaches_the_model_classes_as_in_diffusers(flux_folder):
    from diffusers import DiffusionPipeline

    folder, _ = flux_folder
    # A folder of safetensors only: Diffusers' own loading fails at a model class, and so does ddo's.
    with pytest.raises(OSError, match="pytorch_model.bin"):
        DiffusionPipeline.from_pretrained(folder, use_safetensors=False)
    with pytest.raises(OSError, match="pytorch_model.bin"):
        load(folder, config=ddo.DynamicOffloadConfig(execution_device="cpu"), use_safetensors=False)


def test_loading_keywords_it_does_not_take_and_unknown_keywords_are_refused_by_name(flux_folder):
    folder, _ = flux_folder
    with pytest.raises(ddo.DynamicOffloadConfigError, match="custom_pipeline.*enable_pipeline_offload"):
        load(folder, config=streamed(), custom_pipeline="lpw")
    with pytest.raises(ddo.DynamicOffloadConfigError, match="pass only dtype"):
        load(folder, config=streamed(), dtype=torch.float32, torch_dtype=torch.float32)
    with pytest.raises(ddo.DynamicOffloadConfigError, match="torch.dtype"):
        load(folder, config=streamed(), dtype="bf16")
    with pytest.raises(TypeError, match="frobnicate: neither a loading keyword nor a component of FluxPipeline"):
        load(folder, config=streamed(), frobnicate=1)
    with pytest.raises(TypeError, match=r"backend.*config=DynamicOffloadConfig"):
        load(folder, backend="vmm")


def test_the_loaders_take_config_and_the_published_name_and_refuse_both(flux_folder):
    folder, _ = flux_folder
    for keyword in ("config", "dynamic_offload_config"):
        result = load(folder, **{keyword: streamed()})
        assert result.offload["transformer"].metrics_snapshot().as_dict()["execution"]["route"] == "vmm_fast_runtime"
        result.remove()
        one = ddo.from_pretrained_with_dynamic_offload(
            folder / "transformer", apply_dynamic=True, component="transformer", **{keyword: streamed()}
        )
        assert one.offload is not None and one.offload.runtime_route == "vmm_fast_runtime"
        one.offload.remove()
    with pytest.raises(TypeError, match="twice.*pass it once, as config="):
        load(folder, config=streamed(), dynamic_offload_config=streamed())
    with pytest.raises(TypeError, match="twice.*pass it once, as config="):
        ddo.from_pretrained_with_dynamic_offload(folder / "transformer", config=streamed(), dynamic_offload_config=streamed())


def test_a_transformers_config_still_goes_to_the_model_class(flux_folder):
    from transformers import CLIPTextConfig, CLIPTextModel

    folder, _ = flux_folder
    config = CLIPTextConfig.from_pretrained(folder / "text_encoder")
    loaded = ddo.from_pretrained_with_dynamic_offload(folder / "text_encoder", model_loader=CLIPTextModel, config=config)
    assert isinstance(loaded.module, CLIPTextModel)


def test_enable_offload_names_config_when_given_the_loaders_keyword():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    for call in (ddo.enable_offload, ddo.enable_dynamic_offload):
        with pytest.raises(TypeError, match="takes the DynamicOffloadConfig as config="):
            call(module, dynamic_offload_config=ddo.DynamicOffloadConfig(execution_device="cpu"))


def test_the_pipeline_result_attributes_are_documented():
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..")
    with open(os.path.join(root, "docs", "src", "guide", "pipelines.md"), encoding="utf-8") as f:
        page = f.read()
    doc = ddo.DynamicOffloadPipelineResult.__doc__ or ""
    for attribute in ("pipeline", "offload", "budgets_gb", "devices"):
        assert f"| `.{attribute}` |" in page, attribute
        assert f"``{attribute}``:" in doc, attribute
