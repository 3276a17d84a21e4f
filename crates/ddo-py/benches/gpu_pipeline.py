"""A full-size Flux-shaped pipeline on one GPU, loaded in one call under one GPU budget: the 12 B
transformer, a T5-XXL-sized text encoder (4.8 B), CLIP-L and the Flux VAE, with random bf16
weights saved as a Diffusers pipeline folder, generating at 1024x1024. Two processes: the
pipeline resident on the GPU, and the same folder through
``ddo.from_pretrained_pipeline_with_dynamic_offload`` (transformer and T5 streamed, CLIP and VAE
on Diffusers' leaf offload). Prints whether the images are equal bit for bit, the host memory
against the checkpoints' bytes, and the GPU peak (NVML, whole run) against budget + activations
(the peak of PyTorch's reserved pool, which also holds CLIP's and the VAE's onloaded leaves) +
CUDA context.

    python gpu_pipeline.py [--dir DIR] [--budget-gb 10] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

# The shared fixtures (tiny_pipelines, host) are in examples/ in the repository, beside this file in
# the GPU bundle.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..", "examples")]
from bench_gpu import GpuSampler, peak_rss, rss_now, rss_parts  # noqa: E402
from flux_workload import random_model  # noqa: E402
from tiny_pipelines import tokenizer  # noqa: E402

GIB = 2**30
PROMPT = "a red cat sitting on the mat photo"


def scaled(n: int, scale: float, unit: int = 1, least: int = 1) -> int:
    """``n`` times ``scale``, in multiples of ``unit`` and at least ``least`` (``n`` at scale 1)."""
    return n if scale >= 1 else max(least, round(n * scale / unit) * unit)


def build(folder: str, scale: float = 1.0) -> None:
    """The Flux-12B-shaped pipeline saved in ``folder``; ``scale`` < 1 shrinks its layer counts
    and widths (a pipeline of the same structure small enough for the CPU)."""
    import transformers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    t = time.perf_counter()
    t5_heads, clip_heads = scaled(64, scale), scaled(12, scale)
    # Flux.1-dev's shape: 19 + 38 blocks of 24 heads.
    transformer = random_model(
        FluxTransformer2DModel, num_layers=scaled(19, scale), num_single_layers=scaled(38, scale),
        num_attention_heads=scaled(24, scale), joint_attention_dim=t5_heads * 64, pooled_projection_dim=clip_heads * 64,
    )
    clip_config = transformers.CLIPTextConfig(
        vocab_size=49408, hidden_size=clip_heads * 64, intermediate_size=scaled(3072, scale),
        num_hidden_layers=scaled(12, scale), num_attention_heads=clip_heads, max_position_embeddings=77,
        projection_dim=clip_heads * 64, bos_token_id=0, eos_token_id=1, pad_token_id=0,
    )
    t5_config = transformers.T5Config(
        vocab_size=32128, d_model=t5_heads * 64, d_kv=64, d_ff=scaled(10240, scale), num_layers=scaled(24, scale),
        num_heads=t5_heads, feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, is_encoder_decoder=False,
    )
    vae = random_model(
        AutoencoderKL, in_channels=3, out_channels=3, latent_channels=16,
        block_out_channels=tuple(scaled(c, scale, 32, 32) for c in (128, 256, 512, 512)),
        layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611, sample_size=1024,
    )
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True), vae=vae,
        text_encoder=random_model(transformers.CLIPTextModel, config=clip_config), tokenizer=tokenizer(77),
        text_encoder_2=random_model(transformers.T5EncoderModel, config=t5_config), tokenizer_2=tokenizer(512),
        transformer=transformer,
    )
    save(pipe, folder, t)


def save(pipe, folder: str, started: float) -> None:
    """``pipe`` saved in ``folder``, then its marker (parameters per component), last."""
    pipe.save_pretrained(folder)
    sizes = {n: sum(p.numel() for p in m.parameters()) for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    with open(os.path.join(folder, "ddo-built.json"), "w") as f:
        json.dump(sizes, f)
    print(f"built and saved the pipeline in {time.perf_counter() - started:.0f} s: "
          + ", ".join(f"{n} {c / 1e9:.2f} B" for n, c in sizes.items()), flush=True)


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs if f.endswith(".safetensors"))


def generate(pipe, steps: int) -> np.ndarray:
    out = pipe(prompt=PROMPT, height=1024, width=1024, num_inference_steps=steps, guidance_scale=3.5,
               max_sequence_length=512, generator=torch.Generator().manual_seed(0), output_type="np")
    return np.asarray(out[0])


def child(a: argparse.Namespace) -> int:
    sampler = GpuSampler()
    import ddo
    from diffusers import FluxPipeline

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    gpu_context, rss_base, parts_base = sampler.used() - sampler.base, rss_now(), rss_parts()
    t = time.perf_counter()
    if a.variant == "resident":
        pipe = FluxPipeline.from_pretrained(a.folder, torch_dtype=torch.bfloat16).to("cuda")
        result = None
    else:
        leaf = ddo.ComponentPolicy(route="diffusers_group_offload")
        config = ddo.DynamicOffloadConfig(
            backend="vmm", components={"text_encoder_2": ddo.ComponentPolicy(route="dynamic"), "text_encoder": leaf, "vae": leaf}
        )
        result = ddo.from_pretrained_pipeline_with_dynamic_offload(
            a.folder, torch_dtype=torch.bfloat16, gpu_budget_gb=a.budget_gb, dynamic_offload_config=config
        )
        pipe = result.pipeline
    torch.cuda.synchronize()
    setup = time.perf_counter() - t
    first_t = time.perf_counter()
    generate(pipe, a.steps)
    torch.cuda.synchronize()
    first = time.perf_counter() - first_t
    t = time.perf_counter()
    image = generate(pipe, a.steps)
    torch.cuda.synchronize()
    row = dict(
        variant=a.variant, setup=setup, first=first, generate=time.perf_counter() - t, gpu_context=gpu_context,
        peak_gpu=sampler.peak - sampler.base, torch_peak=torch.cuda.max_memory_reserved(), rss=peak_rss(),
        rss_base=rss_base, rss_above={k: v - parts_base.get(k, 0) for k, v in rss_parts().items()},
    )
    if result is not None:
        row["budgets_gb"] = result.budgets_gb
        row["routes"] = {n: r.runtime_route for n, r in result.offload.items()}
        row["profiles"] = {n: s.format_profile() for n, s in result.metrics_snapshots().items()}
        row["arena_peak"] = sum(
            (s.as_dict().get("runtime", {}).get("peak_bytes") or 0) for s in result.metrics_snapshots().values()
        )
    np.save(os.path.join(a.dir, f"image-{a.variant}.npy"), image)
    sampler.stop = True
    print("ROW " + json.dumps(row), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ddo-pipeline"))
    ap.add_argument("--budget-gb", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--variant")
    ap.add_argument("--folder")
    a = ap.parse_args()
    if a.child:
        return child(a)
    folder = os.path.join(a.dir, "flux-pipeline")
    if not os.path.exists(os.path.join(folder, "ddo-built.json")):
        build(folder)
    checkpoints = folder_bytes(folder)
    rows = {}
    for variant in ("resident", "ddo"):
        cmd = [sys.executable, __file__, "--child", "--variant", variant, "--folder", folder, "--dir", a.dir,
               "--budget-gb", str(a.budget_gb), "--steps", str(a.steps)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        got = [json.loads(line[4:]) for line in p.stdout.splitlines() if line.startswith("ROW ")]
        if p.returncode != 0 or not got:
            print(f"{variant}: failed:\n{p.stderr[-3000:]}", flush=True)
            return 1
        rows[variant] = got[0]
    same = np.array_equal(np.load(os.path.join(a.dir, "image-resident.npy")), np.load(os.path.join(a.dir, "image-ddo.npy")))
    print(f"\ncheckpoints: {checkpoints / GIB:.2f} GiB of safetensors; budget {a.budget_gb} GiB; {a.steps} steps at 1024x1024")
    print("| variant | setup s | first generation s | generation s | peak GPU GiB | torch pool peak GiB | host RSS peak GiB (above base) | host after: anon / file GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for v, r in rows.items():
        above = r["rss_above"]
        print(f"| {v} | {r['setup']:.1f} | {r['first']:.2f} | {r['generate']:.2f} | {r['peak_gpu'] / GIB:.2f} | "
              f"{r['torch_peak'] / GIB:.2f} | {r['rss'] / GIB:.2f} ({(r['rss'] - r['rss_base']) / GIB:.2f}) | "
              f"{above.get('RssAnon', 0) / GIB:.2f} / {above.get('RssFile', 0) / GIB:.2f} |")
    d = rows["ddo"]
    bound = a.budget_gb * GIB + d["torch_peak"] + d["gpu_context"]
    print(f"\nimage equals the resident pipeline's: {'yes' if same else 'NO'}")
    print(f"ddo routes {d['routes']}; budgets {d['budgets_gb']}")
    print(f"ddo GPU peak {d['peak_gpu'] / GIB:.2f} GiB <= budget {a.budget_gb:.2f} + activations (torch's pool at its peak) {d['torch_peak'] / GIB:.2f} "
          f"+ CUDA context {d['gpu_context'] / GIB:.2f} = {bound / GIB:.2f} GiB: {'yes' if d['peak_gpu'] <= bound else 'NO'} "
          f"(arenas peaked at {d['arena_peak'] / GIB:.2f} GiB)")
    print(f"ddo host RSS above base: {(d['rss'] - d['rss_base']) / checkpoints:.2f}x the checkpoints' bytes at peak; after: "
          f"{(d['rss_above'].get('RssAnon', 0) + d['rss_above'].get('RssFile', 0)) / checkpoints:.2f}x")
    for name, profile in d["profiles"].items():
        print(f"-- {name}\n{profile.rstrip()}")
    return 0 if same and d["peak_gpu"] <= bound else 1


if __name__ == "__main__":
    raise SystemExit(main())
