"""GGUF files with Diffusers parameter names: on the native route the stored tensors stream as
they are (quantized ones as Diffusers' ``GGUFParameter`` s, dequantized by ``GGUFLinear`` in its
forward), and outputs equal Diffusers' own ``from_single_file`` bit for bit."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

import ddo

from conftest import tiny_flux  # noqa: E402

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def flux():
    model, inputs = tiny_flux()
    # One weight of each other stored type; biases of one block in F16.
    types = {
        "single_transformer_blocks.0.proj_mlp.weight": Q.Q4_0,
        "single_transformer_blocks.1.proj_out.weight": Q.Q5_0,
        "proj_out.weight": Q.BF16,
        **{f"transformer_blocks.1.attn.to_{x}.bias": Q.F16 for x in "qkv"},
    }
    return model, inputs, types


def krea2():
    """Diffusers keeps Krea2's norms in fp32 and unquantized: a BF16 norm weight is dequantized
    at load (the session converts it the same way)."""
    from diffusers import Krea2Transformer2DModel

    torch.manual_seed(8)
    model = Krea2Transformer2DModel(
        in_channels=4,
        num_layers=4,
        attention_head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        timestep_embed_dim=32,
        text_hidden_dim=32,
        num_text_layers=3,
        text_num_attention_heads=2,
        text_num_key_value_heads=2,
        text_intermediate_size=64,
        num_layerwise_text_blocks=1,
        num_refiner_text_blocks=1,
        axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(9)
    grid = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 4),
        encoder_hidden_states=torch.randn(1, 6, 3, 32),
        timestep=torch.tensor([0.5]),
        position_ids=torch.cat([torch.zeros(6, 3), grid.reshape(16, 3)]),
        return_dict=False,
    )
    types = {"final_layer.norm.weight": Q.BF16, "transformer_blocks.1.norm1.weight": Q.BF16}
    types["transformer_blocks.1.ff.down.weight"] = Q.Q4_0
    return model, inputs, types


def sd3():
    """SD3 has a persistent buffer: the module is loaded by ``from_single_file``, then streamed."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(3)
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=32,
        out_channels=4,
    )
    torch.manual_seed(4)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 8, 8),
        encoder_hidden_states=torch.randn(1, 6, 32),
        pooled_projections=torch.randn(1, 32),
        timestep=torch.tensor([3]),
        return_dict=False,
    )
    return model, inputs, {"transformer_blocks.1.ff.net.2.weight": Q.BF16}


FAMILIES = {"flux": flux, "krea2": krea2, "sd3": sd3}


def linear_weights(model):
    return {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def write_gguf(path, model, types, rename=lambda n: n):
    """The model's state dict as a GGUF file: Linear weights whose rows split into 32-value blocks
    in Q8_0 (or the type ``types`` gives), the rest F32."""
    linear = linear_weights(model)
    writer = gguf.GGUFWriter(os.fspath(path), "ddo-test")
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        q = types.get(name, Q.Q8_0 if name in linear and a.shape[-1] % 32 == 0 else Q.F32)
        if q == Q.F32:
            writer.add_tensor(rename(name), a)
        elif q == Q.F16:
            writer.add_tensor(rename(name), a.astype(np.float16))
        elif q == Q.Q8_1:  # gguf-py writes no Q8_1: any bytes of the right size
            block, size = gguf.GGML_QUANT_SIZES[q]
            data = np.zeros((*a.shape[:-1], a.shape[-1] // block * size), dtype=np.uint8)
            writer.add_tensor(rename(name), data, raw_dtype=q)
        else:
            writer.add_tensor(rename(name), gguf.quants.quantize(a, q), raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def saved(tmp_path, family, **kw):
    """The family's model folder: ``config.json`` and ``model.gguf``; with its inputs in bf16."""
    model, inputs, types = FAMILIES[family]()
    folder = tmp_path / family
    model.save_config(folder)
    write_gguf(folder / "model.gguf", model, types, **kw)
    inputs = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    return type(model), folder, inputs


def reference(cls, folder, gguf_file="model.gguf"):
    from diffusers import GGUFQuantizationConfig

    return cls.from_single_file(
        os.fspath(folder / gguf_file),
        config=os.fspath(folder),
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16),
        torch_dtype=torch.bfloat16,
    ).eval()


def config(granules=3, **kw):
    # Three 2 MiB granules: the resident rest and two slots, so the blocks stream; a model that
    # widens tensors on the device (keep-in-fp32 modules) needs a fourth, its staging buffer.
    return ddo.DynamicOffloadConfig(
        backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=granules * 2 / 1024, **kw
    )


def load(folder, **kw):
    kw.setdefault("dynamic_offload_config", config())
    return ddo.from_pretrained_with_dynamic_offload(
        folder, apply_dynamic=True, torch_dtype=torch.bfloat16, component="transformer", **kw
    )


def layout(module):
    """Each parameter's dtype, shape and GGUF type; each buffer's dtype."""
    params = {n: (p.dtype, tuple(p.shape), getattr(p, "quant_type", None)) for n, p in module.named_parameters()}
    return params, {n: b.dtype for n, b in module.named_buffers()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_native_route_streams_gguf_and_equals_from_single_file(tmp_path, monkeypatch, family):
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter

    cls, folder, inputs = saved(tmp_path, family)
    ref = reference(cls, folder)
    want = run(ref, inputs)
    if family != "sd3":  # built without weights: only the session reads the file

        def read(*_a, **_k):
            raise AssertionError("the file was loaded")

        monkeypatch.setattr(cls, "from_single_file", read)
    loaded = load(folder, dynamic_offload_config=config(4 if family == "krea2" else 3))  # the folder's one .gguf
    module, result = loaded.module, loaded.offload
    assert result.runtime_route == "vmm_fast_runtime"
    assert loaded.source["path"] == os.fspath(folder / "model.gguf")
    assert loaded.bound == len(ref.state_dict())
    assert module.is_quantized and module.hf_quantizer.compute_dtype == torch.bfloat16
    seen = {}

    def check(name):
        def hook(m, _args):
            w = m.weight
            assert isinstance(w, GGUFParameter) and not w.is_meta, name
            seen[name] = w.quant_type

        return hook

    linears = {n: m for n, m in module.named_modules() if isinstance(m, GGUFLinear)}
    handles = [m.register_forward_pre_hook(check(n)) for n, m in linears.items()]
    for _ in range(3):
        assert torch.equal(run(module, inputs), want), family
    for h in handles:
        h.remove()
    # Every quantized Linear ran on its GGUFParameter of the file's type (Q8_0 and the others).
    assert seen == {n: ref.get_submodule(n).weight.quant_type for n in linears} and len(seen) >= 10
    assert len(set(seen.values())) >= 2, seen
    assert layout(module) == layout(ref)
    own = module.state_dict()
    assert all(torch.equal(own[k], v) for k, v in ref.state_dict().items())
    # Between passes a streamed quantized layer called on its own dequantizes its placeholder.
    name, layer = next((n, m) for n, m in linears.items() if isinstance(m.weight, ddo.StreamedWeight))
    x = torch.randn(2, layer.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(layer(x), ref.get_submodule(name)(x)), name
    kept = copy.deepcopy(layer.weight)  # a quantized parameter of its own
    assert isinstance(kept, GGUFParameter) and kept.quant_type == ref.get_submodule(name).weight.quant_type
    assert torch.equal(kept.as_tensor(), ref.get_submodule(name).weight.as_tensor())
    stats = result.metrics_snapshot(collect_completed=True).as_dict()
    setup, runtime = stats["setup"], stats["runtime"]
    assert setup["host_source"] == "mapping" and setup["streamed_units"] >= 2, setup
    assert runtime["passes"] == 3 and runtime["uploads"] > setup["streamed_units"], runtime
    # Placeholders keep their GGUF types; reload streams the file again.
    result.unload()
    assert all(p.is_meta for p in module.parameters()) and layout(module) == layout(ref)
    result.reload()
    assert torch.equal(run(module, inputs), want)
    result.remove()


def test_gguf_file_by_name_or_path_and_the_linear_route(tmp_path):
    cls, folder, inputs = saved(tmp_path, "flux")
    want = run(reference(cls, folder), inputs)
    os.rename(folder / "model.gguf", folder / "flux-q8.gguf")
    # A safetensors file beside it: the GGUF file is used only when named.
    cls.from_config(cls.load_config(folder)).save_pretrained(folder)
    native = load(folder, gguf_file="flux-q8.gguf")
    assert torch.equal(run(native.module, inputs), want)
    native.offload.remove()
    linear_route = ddo.DynamicOffloadConfig(route="dynamic_offload", execution_device="cpu")
    linear = load(folder, gguf_file=folder / "flux-q8.gguf", dynamic_offload_config=linear_route)
    assert linear.offload.runtime_route == "linear_runtime"
    for _ in range(2):
        assert torch.equal(run(linear.module, inputs), want)
    linear.offload.remove()


def test_an_original_key_layout_is_refused(tmp_path):
    cls, folder, _ = saved(tmp_path, "flux", rename=lambda n: "model.diffusion_model." + n)
    first = next(n for n, _ in cls.from_config(cls.load_config(folder)).named_parameters())
    with pytest.raises(ddo.DynamicOffloadCheckpointError) as e:
        load(folder)
    message = str(e.value)
    assert f"{folder / 'model.gguf'} has no tensor {first}" in message
    assert "Diffusers parameter names" in message


@pytest.mark.parametrize("damage", ["truncated", "not_gguf"])
def test_a_corrupt_gguf_is_refused_before_any_module_is_built(tmp_path, monkeypatch, damage):
    _, folder, _ = saved(tmp_path, "flux")
    f = folder / "model.gguf"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"GGML" + data[4:])

    def built(*_a, **_k):
        raise AssertionError("a module was built")

    monkeypatch.setattr(ddo.loaders.meta, "meta_module", built)
    monkeypatch.setattr(ddo.loaders.checkpoint, "loader_of", built)
    with pytest.raises(ddo.DynamicOffloadCheckpointError, match=str(f)):
        load(folder)


def test_a_quant_type_diffusers_cannot_dequantize_is_refused(tmp_path):
    name = "transformer_blocks.0.attn.to_q.weight"
    model, _, _ = flux()
    model.save_config(tmp_path)
    write_gguf(tmp_path / "model.gguf", model, {name: Q.Q8_1})
    message = f"tensor {name} has GGUF type Q8_1, which Diffusers cannot dequantize"
    with pytest.raises(ddo.DynamicOffloadCheckpointError, match=message):
        load(tmp_path)


def test_a_quantized_tensor_diffusers_keeps_unquantized_is_refused(tmp_path):
    # Diffusers keeps Krea2's norms in fp32 and dequantizes a Q8_0 weight there at load; ddo
    # streams stored bytes and converts only F32, F16 and BF16.
    name = "final_layer.norm.weight"
    model, _, _ = krea2()
    model.save_config(tmp_path)
    write_gguf(tmp_path / "model.gguf", model, {name: Q.Q8_0})
    with pytest.raises(ddo.DynamicOffloadCheckpointError, match=f"tensor {name} has GGUF type Q8_0"):
        load(tmp_path)


def test_a_folder_without_config_is_refused(tmp_path):
    _, folder, _ = saved(tmp_path, "flux")
    os.remove(folder / "config.json")
    with pytest.raises(ddo.DynamicOffloadError, match="has no config.json"):
        load(folder, gguf_file="model.gguf")
