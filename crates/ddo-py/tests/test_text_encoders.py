"""transformers text encoders on the native route: found from ``architectures``, built as
transformers' own ``from_pretrained(dtype=...)`` builds them, weights streamed (converted where the
checkpoint's dtype differs), outputs equal to the resident model's bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

import ddo


def t5():
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=3, num_heads=2))


def umt5():
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=3, num_heads=2))


def clip():
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                            num_attention_heads=2, max_position_embeddings=16)
    return CLIPTextModel(config)


def clip_projection():
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                            num_attention_heads=2, max_position_embeddings=16, projection_dim=8)
    return CLIPTextModelWithProjection(config)


def qwen2():
    from transformers import Qwen2Config, Qwen2Model

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2Model(config)


def llama():
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaModel(config)


ENCODERS = {"t5": t5, "umt5": umt5, "clip": clip, "clip_projection": clip_projection, "qwen2": qwen2, "llama": llama}


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("name", sorted(ENCODERS))
@pytest.mark.parametrize("stored,loaded", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_a_text_encoder_streams_as_transformers_loads_it(tmp_path, name, stored, loaded):
    torch.manual_seed(3)
    model = ENCODERS[name]().eval()
    path = tmp_path / name
    model.to(stored).save_pretrained(path)
    cls = type(model)
    assert json.loads((path / "config.json").read_text())["architectures"] == [cls.__name__]
    reference = cls.from_pretrained(path, dtype=loaded).eval()
    ids = torch.tensor([[1, 5, 9, 3, 2, 7]])
    with torch.no_grad():
        want = first(reference(input_ids=ids, return_dict=False))
    # Presets hand text encoders to Diffusers' leaf offload; route="dynamic" asks for the arena.
    # Every unit takes one 2 MiB granule here: the resident rest and two slots, so blocks stream.
    config = ddo.DynamicOffloadConfig(
        route="dynamic", backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=6 / 1024
    )
    got = ddo.from_pretrained_with_dynamic_offload(
        path, dtype=loaded, apply_dynamic=True, component="text_encoder", dynamic_offload_config=config
    )
    assert type(got.module) is cls
    params = dict(got.module.named_parameters())
    assert {n: p.dtype for n, p in params.items()} == {n: p.dtype for n, p in reference.named_parameters()}
    for _ in range(2):
        with torch.no_grad():
            out = first(got.module(input_ids=ids, return_dict=False))
        assert torch.equal(out, want), name
    snapshot = got.offload.metrics_snapshot().as_dict()
    assert snapshot["route"] == "dynamic_offload" and snapshot["execution"]["route"] == "vmm_fast_runtime"
    setup = snapshot["setup"]
    assert setup["streamed_units"] >= 2, setup
    assert (setup.get("converted_tensors") or 0) > 0 or stored == loaded
    got.offload.remove()


def test_a_config_naming_no_class_says_what_to_pass(tmp_path):
    clip().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ddo.DynamicOffloadError, match="model_loader="):
        ddo.from_pretrained_with_dynamic_offload(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModel"]}')
    with pytest.raises(ddo.DynamicOffloadError, match="NoSuchModel"):
        ddo.from_pretrained_with_dynamic_offload(tmp_path)


def test_auto_dtype_builds_buffers_in_the_loaded_dtype(tmp_path):
    torch.manual_seed(3)
    model = clip().eval()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "clip")
    reference = type(model).from_pretrained(tmp_path / "clip", dtype="auto").eval()
    ids = torch.tensor([[1, 5, 9, 3, 2, 7]])
    with torch.no_grad():
        want = first(reference(input_ids=ids, return_dict=False))
    config = ddo.DynamicOffloadConfig(route="dynamic", backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=6 / 1024)
    got = ddo.from_pretrained_with_dynamic_offload(
        tmp_path / "clip", dtype="auto", apply_dynamic=True, component="text_encoder", dynamic_offload_config=config
    )
    with torch.no_grad():
        assert torch.equal(first(got.module(input_ids=ids, return_dict=False)), want)
    got.offload.remove()
