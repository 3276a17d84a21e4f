"""The ddo demo: offload a real Diffusers model.

Builds a small Flux-style ``FluxTransformer2DModel`` with random weights, saves it as a
safetensors checkpoint, loads it back with ``ddo.from_pretrained_with_dynamic_offload`` (the
linear route: weights stay in host memory and are streamed block by block), runs a few forwards on
CUDA when present (otherwise on the CPU), checks that every output equals the resident model's
bit for bit, and prints the offload profile; then does the same on the native route, streaming from
the checkpoint through the weight arena under a small budget. Last, it saves a tiny Flux pipeline
(CLIP and T5 text encoders, transformer, VAE, tokenizers) and loads the whole folder in one call,
text encoders and transformer streamed from their checkpoints, and checks that it generates what Diffusers' own
loading generates.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch

import ddo


def forwards(module, inputs, reference, device: str, steps: int = 3) -> bool:
    """Runs ``steps`` forwards, printing each one's time; whether every output equals
    ``reference`` bit for bit."""
    for step in range(steps):
        t = time.perf_counter()
        with torch.no_grad():
            got = module(**inputs)[0]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        same = torch.equal(got, reference)
        print(f"step {step}: {time.perf_counter() - t:.4f} s, output equals the resident model: {same}")
        if not same:
            return False
    return True


def main() -> int:
    from diffusers import FluxTransformer2DModel

    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join("target", "demo", "flux-transformer")
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        in_channels=16,
        num_layers=4,
        num_single_layers=8,
        attention_head_dim=64,
        num_attention_heads=4,
        joint_attention_dim=128,
        pooled_projection_dim=64,
        axes_dims_rope=[16, 24, 24],
    ).eval()
    if dtype != torch.float32:
        model = model.to(dtype)
    model.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"saved a FluxTransformer2DModel with {params / 1e6:.1f} M random parameters to {out}")

    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 256, 16, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(1, 32, 128, generator=g).to(dtype),
        pooled_projections=torch.randn(1, 64, generator=g).to(dtype),
        timestep=torch.tensor([0.5]).to(dtype),
        img_ids=torch.zeros(256, 3),
        txt_ids=torch.zeros(32, 3),
        return_dict=False,
    )
    resident = copy.deepcopy(model).to(device)
    with torch.no_grad():
        reference = resident(**{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in inputs.items()})[0]
    del resident, model

    loaded = ddo.from_pretrained_with_dynamic_offload(
        out,
        torch_dtype=dtype,
        apply_dynamic=True,
        component="transformer",
        dynamic_offload_config=ddo.DynamicOffloadConfig(execution_device=device),
    )
    result = loaded.offload
    print(f"bound {loaded.bound} of {len(loaded.source['tensors'])} checkpoint tensors; route {result.runtime_route} on {device}")
    if not forwards(loaded.module, inputs, reference, device):
        return 1
    print(result.metrics_snapshot(collect_completed=True).format_profile(), end="")
    result.remove()

    # The native route: weights stream from the checkpoint's registered mapping through a GPU
    # weight arena (on the CPU, the same arena on the host backend) under a 24 MiB budget.
    native = ddo.from_pretrained_with_dynamic_offload(
        out,
        torch_dtype=dtype,
        apply_dynamic=True,
        component="transformer",
        dynamic_offload_config=ddo.DynamicOffloadConfig(
            backend="vmm", execution_device=device, vmm_resident_weight_budget_gb=24 / 1024
        ),
    )
    print(f"\nroute {native.offload.runtime_route} on {device}, 24 MiB weight budget")
    if not forwards(native.module, inputs, reference, device):
        return 1
    print(native.offload.metrics_snapshot(collect_completed=True).format_profile(), end="")
    native.offload.remove()
    return pipeline(os.path.join(os.path.dirname(out), "flux-pipeline"), device)


def pipeline(folder: str, device: str) -> int:
    """A whole pipeline folder in one call: text encoders and transformer streamed from their
    checkpoints, the tiny VAE resident."""
    from diffusers import DiffusionPipeline

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tiny_pipelines import flux_pipeline, generate, own_memory

    torch.manual_seed(0)
    pipe, extra = flux_pipeline()
    pipe.save_pretrained(folder)
    reference = own_memory(DiffusionPipeline.from_pretrained(folder).to(device))
    want = generate(reference, extra)
    del reference
    # Text encoders stream through the arena too (presets give them Diffusers' leaf offload); the
    # tiny VAE stays resident. 60 MiB of GPU weight budget, split by weight bytes.
    policies = {n: ddo.ComponentPolicy(route="dynamic") for n in ("text_encoder", "text_encoder_2")}
    policies["vae"] = ddo.ComponentPolicy(route="none")
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device=device, components=policies)
    result = ddo.from_pretrained_pipeline_with_dynamic_offload(folder, dynamic_offload_config=config, gpu_budget_gb=0.06)
    print(f"\npipeline {type(result.pipeline).__name__} from {folder}: " + ", ".join(
        f"{n} {r.runtime_route} ({result.budgets_gb.get(n, 0) * 1024:.1f} MiB)" for n, r in result.offload.items()))
    t = time.perf_counter()
    same = bool((generate(result.pipeline, extra) == want).all())
    print(f"generated in {time.perf_counter() - t:.2f} s; image equals Diffusers' own pipeline: {same}")
    for name, snapshot in result.metrics_snapshots().items():
        print(snapshot.format_profile(), end="")
    result.remove()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
