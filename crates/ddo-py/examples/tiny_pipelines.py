"""Tiny Diffusers pipelines with random weights, built here without downloads: Flux-, SD3- and
Wan-shaped, with word-level tokenizers. Used by the demo and the tests."""

from __future__ import annotations

import numpy as np
import torch

WORDS = "a cat dog on the mat red blue photo of sitting".split()


def tokenizer(max_length):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=max_length
    )


def clip(cls_name="CLIPTextModel", hidden=32):
    import transformers

    config = transformers.CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=0, hidden_size=hidden, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=3, vocab_size=64, projection_dim=32, max_position_embeddings=77,
    )
    return getattr(transformers, cls_name)(config)


def t5(cls_name="T5EncoderModel", d_model=32, d_ff=37):
    import transformers

    config_cls = transformers.UMT5Config if cls_name.startswith("UMT5") else transformers.T5Config
    config = config_cls(vocab_size=64, d_model=d_model, d_kv=8, d_ff=d_ff, num_layers=3, num_heads=4)
    return getattr(transformers, cls_name)(config)


def flux_pipeline(heads: int = 2, t5_width: int = 32):
    """A Flux-shaped pipeline; ``heads`` of 16 dimensions each size the transformer's blocks
    (``heads=16``: blocks of a few MiB, larger than a mapping granule), ``t5_width`` T5's."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=4 if heads > 2 else 2, attention_head_dim=16,
        num_attention_heads=heads, joint_attention_dim=t5_width, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    )
    vae = AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1, latent_channels=1,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip(), tokenizer=tokenizer(77),
        text_encoder_2=t5(d_model=t5_width, d_ff=4 * t5_width if t5_width > 32 else 37), tokenizer_2=tokenizer(48),
        transformer=transformer,
    )
    return pipe, dict(height=8, width=8, max_sequence_length=48, guidance_scale=5.0)


def sd3_pipeline():
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=1, in_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
    )
    vae = AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1, latent_channels=4,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, transformer=transformer,
        text_encoder=clip("CLIPTextModelWithProjection"), tokenizer=tokenizer(77),
        text_encoder_2=clip("CLIPTextModelWithProjection"), tokenizer_2=tokenizer(77),
        text_encoder_3=t5(), tokenizer_3=tokenizer(48),
    )
    return pipe, dict(height=8, width=8, max_sequence_length=48, guidance_scale=5.0)


def wan_pipeline():
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=3, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
    pipe = WanPipeline(
        tokenizer=tokenizer(48), text_encoder=t5("UMT5EncoderModel"), vae=vae, transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    )
    return pipe, dict(height=16, width=16, num_frames=9, max_sequence_length=48, guidance_scale=5.0)


PIPELINES = {"flux": flux_pipeline, "sd3": sd3_pipeline, "wan": wan_pipeline}


def generate(pipe, extra, steps: int = 2):
    """A two-step generation from a fixed seed, as a numpy array."""
    out = pipe(prompt="a red cat on the mat", num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
               output_type="np", **extra)
    return np.asarray(out[0])


def own_memory(pipe):
    """``pipe`` with every weight in an allocation of its own. A loader may leave weights as
    views into a file mapping at any 4-byte offset, and CPU kernels pick other code paths (and
    round differently) for such addresses; a resident run on a GPU copies each weight into
    aligned memory, and a reference on the CPU does the same here."""
    with torch.no_grad():
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                for p in component.parameters():
                    p.data = p.data.clone()
    return pipe


def flux_transformer_inputs(seed: int, device: str) -> dict:
    """Inputs of the tiny Flux transformer of ``flux_pipeline``, bf16 on ``device``."""
    g = torch.Generator().manual_seed(seed)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 4, generator=g), encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]), img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(8, 3), return_dict=False,
    )
    return {k: v.to(device, torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}


def report(checks: list, argument, device: str) -> int:
    """Runs each ``(name, check)`` on ``argument``, printing PASS with what the check returns or
    FAIL with its error, then a summary line; returns the exit status."""
    import traceback

    failed = 0
    for name, check in checks:
        try:
            print(f"PASS {name}: {check(argument)}", flush=True)
        except Exception as e:  # noqa: BLE001 - every check reports
            failed += 1
            print(f"FAIL {name}: {e!r}", flush=True)
            traceback.print_exc()
    where = torch.cuda.get_device_name(0) if device.startswith("cuda") else device
    print(f"{len(checks) - failed}/{len(checks)} checks passed on {where}")
    return 1 if failed else 0
