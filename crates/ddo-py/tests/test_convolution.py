"""Route ``linear_convolution``: a VAE streamed layer by layer on the host backend gives exactly
the resident outputs, within its arena budget, and refuses what it cannot serve."""

from __future__ import annotations

import copy
import os
import sys

import numpy as np
import pytest
import torch

import ddo

ROUTE = dict(component="vae", route="linear_convolution", execution_device="cpu", use_environment=False)


def autoencoder(channels=(32, 64)):
    """A small random ``AutoencoderKL`` whose convolutions exceed the route's 16 KiB threshold."""
    from diffusers import AutoencoderKL

    torch.manual_seed(5)
    model = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
    ).eval()
    torch.manual_seed(6)
    return model, torch.randn(1, 3, 32, 32)


@pytest.fixture
def kl():
    return autoencoder()


def layer_leaves(model, threshold=16 * 1024):
    """Convolution and linear leaves holding a parameter over ``threshold`` bytes, in module order."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.modules.conv._ConvNd, torch.nn.Linear)) and not list(m.children()):
            if any(p.numel() * p.element_size() > threshold for p in m.parameters(recurse=False)):
                out.append(name)
    return out


def outputs(model, x):
    with torch.no_grad():
        latent = model.encode(x).latent_dist.mode()
        return latent, model.decode(latent).sample, model(x, return_dict=False)[0]


def test_encode_and_decode_equal_the_resident_run_over_several_passes(kl):
    model, x = kl
    want = outputs(copy.deepcopy(model), x)
    result = ddo.enable_offload(model, **ROUTE)
    assert result.route == "dynamic_offload" and result.runtime_route == "linear_convolution"
    for _ in range(3):
        for got, ref in zip(outputs(model, x), want):
            assert torch.equal(got, ref)
    data = result.metrics_snapshot().as_dict()
    assert data["execution"]["route"] == "linear_convolution"
    assert data["execution"]["execution_mode"] == "linear_runtime"
    assert data["configuration"]["dynamic_offload_linear_convolution_offload"] is True
    # encode, decode and forward are passes of their own (forward's encode and decode belong to it).
    assert data["runtime"]["passes"] == 9
    profile = result.metrics_snapshot().format_profile()
    assert "runtime=linear_convolution" in profile and f"streamed_units={len(layer_leaves(model))}" in profile
    result.remove()


def test_units_are_the_convolution_and_linear_leaves(kl):
    model, _ = kl
    leaves = layer_leaves(model)
    found = [p for p, _ in ddo.find_execution_units(model, route="linear_convolution")]
    assert found == leaves and len(found) > 10
    assert all(isinstance(model.get_submodule(p), torch.nn.Conv2d) for p in found)
    # The block rule finds the repeated blocks instead.
    assert [p for p, _ in ddo.find_execution_units(model)] != found
    result = ddo.enable_offload(model, **ROUTE)
    streamed = [name for _, name, pinned in result.runtime.session.units() if not pinned]
    assert streamed == leaves
    # Norms, biases and layers under the threshold stay resident: real tensors, not placeholders.
    assert not isinstance(model.decoder.conv_norm_out.weight, ddo.StreamedWeight)
    assert not isinstance(model.decoder.conv_out.bias, ddo.StreamedWeight)
    assert isinstance(model.decoder.up_blocks[0].resnets[0].conv1.weight, ddo.StreamedWeight)
    result.remove()


def test_every_layer_streams_without_a_threshold(vae):
    model, inputs = vae
    want = copy.deepcopy(model)(**inputs)[0]
    result = ddo.enable_offload(model, small_tensor_threshold_kb=0, **ROUTE)
    setup = result.metrics_snapshot().as_dict()["setup"]
    assert setup["streamed_units"] == len(layer_leaves(model, threshold=0))
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], want.detach())
    result.remove()


def test_the_arena_stays_within_its_budget_below_the_module_size():
    model, x = autoencoder((64, 128, 256))
    want = outputs(copy.deepcopy(model), x)
    result = ddo.enable_offload(model, prefetch_depth=1, **ROUTE)
    for got, ref in zip(outputs(model, x), want):
        assert torch.equal(got, ref)
    data = result.metrics_snapshot().as_dict()
    setup, runtime = data["setup"], data["runtime"]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert setup["total_bytes"] == total
    assert setup["execution_slots"] == 2
    assert runtime["peak_bytes"] <= setup["gpu_budget_bytes"] < total
    result.remove()


def test_the_routes_configuration_and_its_sources():
    model, _ = autoencoder()
    result = ddo.enable_offload(model, component="vae", execution_device="cpu", environ={"DDO_VAE_ROUTE": "linear_convolution"})
    values, origins = result.settings.values, result.settings.origins
    assert result.runtime_route == "linear_convolution"
    assert values["pin_cpu_memory"] is True and values["resident_module_budget_gb"] == 0
    assert values["small_tensor_threshold_kb"] == 16
    assert origins["pin_cpu_memory"] == "route linear_convolution"
    result.remove()
    config = ddo.DynamicOffloadConfig(linear_convolution_offload=True, execution_device="cpu")
    result = ddo.enable_offload(model, component="vae", config=config, use_environment=False)
    assert result.runtime_route == "linear_convolution"
    result.remove()


def test_an_explicit_config_must_ask_for_convolution_offload_itself():
    model, _ = autoencoder()
    before = dict(model.named_parameters())
    config = ddo.DynamicOffloadConfig(execution_device="cpu")
    with pytest.raises(ddo.DynamicOffloadConfigError, match="the config must itself set linear_convolution_offload=True"):
        ddo.enable_offload(model, component="vae", route="linear_convolution", config=config, use_environment=False)
    assert dict(model.named_parameters()) == before


def test_convolution_offload_outside_the_linear_runtime_is_refused_at_resolution():
    model, _ = autoencoder()
    with pytest.raises(ddo.DynamicOffloadConfigError, match="streams layers on the linear runtime.*use backend linear"):
        ddo.enable_offload(
            model, component="vae", backend="vmm", linear_convolution_offload=True, execution_device="cpu",
            use_environment=False,
        )


def test_offload_device_must_be_the_host(kl):
    model, _ = kl
    with pytest.raises(ddo.DynamicOffloadConfigError, match="offload_device"):
        ddo.enable_offload(model, offload_device="cuda:0", **ROUTE)
    assert not any(isinstance(p, ddo.StreamedWeight) for p in model.parameters())


def untouched(model, before):
    assert dict(model.named_parameters()) == before and "forward" not in model.__dict__
    assert getattr(model, "_ddo_offload", None) is None


def test_quantized_modules_are_refused(kl):
    model, _ = kl
    before = dict(model.named_parameters())
    model.hf_quantizer = object()
    with pytest.raises(ddo.DynamicOffloadError, match="is quantized .*use route diffusers_group_offload"):
        ddo.enable_offload(model, **ROUTE)
    del model.hf_quantizer
    untouched(model, before)
    model.decoder.conv_out.weight = torch.nn.Parameter(
        model.decoder.conv_out.weight.detach().to(torch.int8), requires_grad=False
    )
    with pytest.raises(ddo.DynamicOffloadError, match="decoder.conv_out.weight .* torch.int8 .*plain float16"):
        ddo.enable_offload(model, **ROUTE)


def test_training_mode_is_refused_before_anything_changes(kl):
    model, _ = kl
    before = dict(model.named_parameters())
    model.decoder.train()
    with pytest.raises(ddo.DynamicOffloadError, match="decoder is in training mode.*AutoencoderKL.eval"):
        ddo.enable_offload(model, **ROUTE)
    untouched(model, before)


def test_layers_hooked_by_another_offload_are_refused(kl):
    from diffusers.hooks import apply_group_offloading

    model, _ = kl
    apply_group_offloading(model, onload_device=torch.device("cpu"), offload_type="leaf_level")
    with pytest.raises(ddo.DynamicOffloadError, match="another library's offload hooks"):
        ddo.enable_offload(model, **ROUTE)


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::torch.jit.TracerWarning")
def test_forward_refusals_leave_the_module_usable(kl, monkeypatch):
    model, x = kl
    want = outputs(copy.deepcopy(model), x)
    result = ddo.enable_offload(model, **ROUTE)
    grad = x.clone().requires_grad_()
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="an input requires grad"):
        model.encode(grad)
    with torch.no_grad():
        with pytest.raises(ddo.DynamicOffloadLifecycleError, match="while a tracer records it"):
            torch.jit.trace(model.decoder, (want[0],), check_trace=False)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(ddo.DynamicOffloadLifecycleError, match="during CUDA graph capture"):
            model.decode(want[0])
    monkeypatch.undo()
    for got, ref in zip(outputs(model, x), want):
        assert torch.equal(got, ref)
    result.remove()


def test_an_output_viewing_a_streamed_weight_is_refused(kl):
    model, x = kl
    layer = model.decoder.up_blocks[0].resnets[0].conv1
    layer.register_forward_hook(lambda m, _args, _out: m.weight[:, :, 0, 0])
    result = ddo.enable_offload(model, **ROUTE)
    with torch.no_grad(), pytest.raises(ddo.DynamicOffloadLifecycleError, match="views its streamed weight .*weight"):
        model.decode(model.encode(x).latent_dist.mode())
    result.remove()


def test_remove_is_refused_inside_a_forward_and_restores_the_module(kl):
    model, x = kl
    originals = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    want = outputs(copy.deepcopy(model), x)
    result = ddo.enable_offload(model, **ROUTE)
    handle = model.decoder.conv_in.register_forward_hook(lambda *_: result.remove())
    with torch.no_grad(), pytest.raises(ddo.DynamicOffloadLifecycleError, match="remove\\(\\) was called inside"):
        model.decode(want[0])
    handle.remove()
    for got, ref in zip(outputs(model, x), want):
        assert torch.equal(got, ref)
    result.remove()
    assert {n: (p, p.data_ptr()) for n, p in model.named_parameters()} == originals
    assert not {"forward", "encode", "decode"} & set(model.__dict__)
    for got, ref in zip(outputs(model, x), want):
        assert torch.equal(got, ref)


def test_a_wan_video_autoencoder_streams_layer_by_layer():
    diffusers = pytest.importorskip("diffusers")
    if not hasattr(diffusers, "AutoencoderKLWan"):
        pytest.skip("this Diffusers has no AutoencoderKLWan")
    torch.manual_seed(0)
    model = diffusers.AutoencoderKLWan(
        base_dim=16, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True]
    ).eval()
    x = torch.randn(1, 3, 5, 32, 32)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        latent = reference.encode(x).latent_dist.mode()
        want = reference.decode(latent).sample
    result = ddo.enable_offload(model, **ROUTE)
    units = [p for p, _ in ddo.find_execution_units(model, route="linear_convolution")]
    assert any(type(model.get_submodule(p)).__name__ == "WanCausalConv3d" for p in units)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model.encode(x).latent_dist.mode(), latent)
            assert torch.equal(model.decode(latent).sample, want)
    assert result.metrics_snapshot().as_dict()["setup"]["streamed_units"] == len(units)
    result.remove()


def test_a_pipeline_streams_its_vae_by_layers_from_the_environment():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from tiny_pipelines import flux_pipeline, generate

    torch.manual_seed(0)
    pipe, extra = flux_pipeline()
    for c in pipe.components.values():
        if isinstance(c, torch.nn.Module):
            c.eval()
    want = generate(copy.deepcopy(pipe), extra)
    # The tiny VAE's layers are all under the route's 16 KiB threshold: stream every one.
    results = ddo.enable_pipeline_offload(
        pipe, execution_device="cpu", environ={"DDO_VAE_ROUTE": "linear_convolution"}, small_tensor_threshold_kb=0
    )
    try:
        assert results["vae"].runtime_route == "linear_convolution"
        assert results["transformer"].runtime_route == "linear_runtime"
        assert results["vae"].metrics_snapshot().as_dict()["setup"]["streamed_units"] >= 4
        for _ in range(2):
            np.testing.assert_array_equal(generate(pipe, extra), want)
    finally:
        for r in results.values():
            r.remove()


def test_a_pipeline_config_streams_its_vae_by_layers_beside_native_components(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from diffusers import DiffusionPipeline
    from tiny_pipelines import flux_pipeline, generate, own_memory

    torch.manual_seed(0)
    pipe, extra = flux_pipeline()
    pipe.save_pretrained(tmp_path / "flux")
    want = generate(own_memory(DiffusionPipeline.from_pretrained(tmp_path / "flux")), extra)
    config = ddo.DynamicOffloadConfig(
        backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=6 / 1024, small_tensor_threshold_kb=0,
        components={"vae": ddo.ComponentPolicy(route="linear_convolution")},
    )
    result = ddo.from_pretrained_pipeline_with_dynamic_offload(tmp_path / "flux", dynamic_offload_config=config)
    try:
        assert result.offload["vae"].runtime_route == "linear_convolution"
        assert result.offload["transformer"].runtime_route == "vmm_fast_runtime"
        np.testing.assert_array_equal(generate(result.pipeline, extra), want)
    finally:
        result.remove()
