"""The reference workload shared by the GPU scripts: a Flux-style transformer with random bf16
weights (built on meta, then filled, so no float32 copy is made), its inputs, and the pinned copy
speed that defines the floor."""

from __future__ import annotations

import json
import os
import time

import torch


def random_model(cls, **config):
    """``cls(**config)`` in bf16 with N(0, 0.02) weights, on the CPU, in eval mode."""
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = cls(**config)
    torch.set_default_dtype(torch.float32)
    model = model.to_empty(device="cpu").eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(p.dtype))
    return model


def saved_model(work: str, name: str, cls, label: str, save_dtype=None, **config) -> tuple[str, int]:
    """``cls(**config)`` with random weights saved under ``work/name`` (built once and reused
    while the folder lives), in ``save_dtype`` when given; returns its folder and its parameter
    bytes in bf16."""
    path = os.path.join(work, name)
    marker = os.path.join(path, "ddo-built.json")
    if os.path.exists(marker):
        with open(marker) as f:
            return path, json.load(f)["bytes"]
    t = time.perf_counter()
    model = random_model(cls, **config)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    if save_dtype is not None:
        model = model.to(save_dtype)
    model.save_pretrained(path)
    del model
    with open(marker, "w") as f:
        json.dump({"bytes": nbytes, "parameters": params}, f)
    print(f"built and saved a {label} model: {params / 1e9:.2f} B parameters ({nbytes / 2**30:.2f} GiB) "
          f"in {time.perf_counter() - t:.0f} s", flush=True)
    return path, nbytes


def saved_flux(work: str, double: int, single: int) -> tuple[str, int]:
    """A Flux-style model with ``double`` + ``single`` blocks saved under ``work``."""
    from diffusers import FluxTransformer2DModel

    return saved_model(work, f"flux-{double}-{single}", FluxTransformer2DModel, "Flux-style",
                       num_layers=double, num_single_layers=single)


# SD3.5-Large-shaped SD3Transformer2DModel (8.1 B parameters, 15 GiB in bf16): the second model
# family of the benchmark, so nothing is tuned to Flux's block shapes.
SD3_LARGE = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
    num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
    pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm",
)


def saved_sd3(work: str) -> tuple[str, int]:
    """The SD3.5-Large-shaped model saved under ``work``."""
    from diffusers import SD3Transformer2DModel

    return saved_model(work, "sd3-large", SD3Transformer2DModel, "SD3-style", **SD3_LARGE)


# Wan-2.1-14B-shaped WanTransformer3DModel (40 blocks of 5120 wide; fewer here), saved in fp32 as
# many published checkpoints are and loaded as bf16: the third family, and the conversion row.
WAN_14B = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)


def saved_wan(work: str, layers: int) -> tuple[str, int]:
    """The Wan-14B-shaped model with ``layers`` blocks saved in fp32 under ``work``."""
    from diffusers import WanTransformer3DModel

    return saved_model(work, f"wan-{layers}-fp32", WanTransformer3DModel, "Wan-style (saved in fp32)",
                       save_dtype=torch.float32, **dict(WAN_14B, num_layers=layers))


def wan_inputs(resolution: int, device, generator: torch.Generator) -> dict:
    """Three latent frames of ``resolution`` x ``resolution`` (8x VAE, 2x2 patches: 3 *
    (resolution / 16)^2 tokens) with 512 text tokens."""
    side = resolution // 8
    return dict(
        hidden_states=torch.randn(1, 16, 3, side, side, generator=generator).to(device, torch.bfloat16),
        encoder_hidden_states=torch.randn(1, 512, 4096, generator=generator).to(device, torch.bfloat16),
        timestep=torch.tensor([500]).to(device),
        return_dict=False,
    )


def sd3_inputs(resolution: int, device, generator: torch.Generator) -> dict:
    """Batch 1 at ``resolution`` ((resolution / 16)^2 image tokens after 2x2 patches of the 8x
    latents) with 333 text tokens (77 CLIP + 256 T5), as SD3 pipelines use."""
    side = resolution // 8
    return dict(
        hidden_states=torch.randn(1, 16, side, side, generator=generator).to(device, torch.bfloat16),
        encoder_hidden_states=torch.randn(1, 333, 4096, generator=generator).to(device, torch.bfloat16),
        pooled_projections=torch.randn(1, 2048, generator=generator).to(device, torch.bfloat16),
        timestep=torch.tensor([500.0], dtype=torch.bfloat16).to(device),
        return_dict=False,
    )


def flux_inputs(resolution: int, device, generator: torch.Generator) -> dict:
    """Batch 1 at ``resolution`` (2x2-packed latents: (resolution / 16)^2 image tokens) with 512
    text tokens."""
    tokens = (resolution // 16) ** 2
    return dict(
        hidden_states=torch.randn(1, tokens, 64, generator=generator).to(device, torch.bfloat16),
        encoder_hidden_states=torch.randn(1, 512, 4096, generator=generator).to(device, torch.bfloat16),
        pooled_projections=torch.randn(1, 768, generator=generator).to(device, torch.bfloat16),
        timestep=torch.tensor([0.5], dtype=torch.bfloat16).to(device),
        img_ids=torch.zeros(tokens, 3).to(device),
        txt_ids=torch.zeros(512, 3).to(device),
        return_dict=False,
    )


def link_speed(device="cuda:0") -> float:
    """Bytes per second of the best of five 1 GiB pinned host-to-device copies."""
    host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    target = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    best = 0.0
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        target.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, (1 << 30) / (time.perf_counter() - t))
    return best


def timed(fn, steps):
    """Runs ``fn`` ``steps`` times without grad, synchronizing around each; returns the seconds of
    each run and the last output."""
    times, out = [], None
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times, out
