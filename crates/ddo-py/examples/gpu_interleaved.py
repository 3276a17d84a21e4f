"""Side-by-side steps in one process, interleaved: the resident model and ddo at several budgets
are loaded together (one mapping of the checkpoint feeds every session) and stepped in turn,
round after round, so a drift in the machine's speed (a shared host's CPU, clocks) falls on every
variant alike. Each variant's step is the median over the rounds; its floor is max(resident step,
bytes it streams per step / the pinned link speed measured in the same process).

Variants: ``resident``, ``vmm@GIB`` (a weight budget), with ``+dN`` (prefetch depth N) and a
``~peer`` suffix (the streamed units held in this GPU's own memory: the same budget, copies from
device memory instead of over the host link). ``vmm@GIB~bare`` is a diagnostic for budgets that
stream nothing: after its first pass ddo's hooks and pass entry are taken off, so the module runs
as plain PyTorch on weights in arena memory. Against ``resident`` it measures what the memory
costs; against ``vmm@GIB`` what ddo's per-pass and per-block host work costs. The ``host s``
column is the time until the forward returned (the host's enqueue time): near the step, the host
sets the pace.

    python gpu_interleaved.py --model sd3|flux12|q8 [--variants resident,vmm@3,vmm@6] [--rounds 8] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import statistics
import time

import torch

from flux_workload import flux_inputs, link_speed, saved_flux, saved_flux_q8, saved_sd3, sd3_inputs

VARIANT = re.compile(r"^vmm@([0-9.]+)(?:\+d([0-9]+))?(~peer|~bare)?$")


def load(variant: str, model: str, path: str):
    import ddo
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    cls = SD3Transformer2DModel if model == "sd3" else FluxTransformer2DModel
    gguf = next((f for f in os.listdir(path) if f.endswith(".gguf")), None) if model == "q8" else None
    dev = torch.device("cuda:0")
    if variant == "resident":
        if gguf:
            from diffusers import GGUFQuantizationConfig

            return cls.from_single_file(
                os.path.join(path, gguf), config=path, torch_dtype=torch.bfloat16,
                quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16),
            ).to(dev).eval(), None
        return cls.from_pretrained(path, torch_dtype=torch.bfloat16).to(dev).eval(), None
    m = VARIANT.match(variant)
    if m is None:
        raise SystemExit(f"unknown variant {variant!r}: resident, vmm@GIB, vmm@GIB+dN, vmm@GIB~peer, vmm@GIB~bare")
    extra = {"prefetch_depth": int(m.group(2))} if m.group(2) else {}
    if m.group(3) == "~peer":
        extra["vmm_peer_store_device"] = "cuda:0"
    config = ddo.DynamicOffloadConfig(backend="vmm", vmm_resident_weight_budget_gb=float(m.group(1)), **extra)
    loaded = ddo.from_pretrained_with_dynamic_offload(
        path, torch_dtype=torch.bfloat16, apply_dynamic=True, component="transformer", dynamic_offload_config=config,
        **({"gguf_file": gguf} if gguf else {}),
    )
    return loaded.module, loaded.offload


def strip_ddo(module, offload) -> None:
    """Diagnostic only: takes ddo's hooks and pass entry off a module whose units are all
    resident (their views stay published), so it runs as plain PyTorch on arena memory."""
    streamed = offload.metrics_snapshot().as_dict()["setup"]["streamed_units"]
    if streamed:
        raise SystemExit(f"~bare needs a budget that streams nothing; this one streams {streamed} units")
    runtime = offload.runtime
    for handle in runtime.handles:
        handle.remove()
    for name in runtime.entries:
        delattr(module, name)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="sd3", choices=["sd3", "flux12", "q8"])
    ap.add_argument("--variants", default="resident,vmm@3,vmm@6,vmm@10.5,vmm@14.5,vmm@14.5~peer")
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ddo-bench"))
    a = ap.parse_args()
    variants = a.variants.split(",")
    if "resident" not in variants:
        raise SystemExit("--variants needs resident: it sets every floor and output to compare")
    os.makedirs(a.dir, exist_ok=True)
    if a.model == "sd3":
        path, nbytes = saved_sd3(a.dir)
    elif a.model == "q8":
        path, nbytes = saved_flux_q8(a.dir, 19, 38)
    else:
        path, nbytes = saved_flux(a.dir, 19, 38)
    dev = torch.device("cuda:0")
    link = link_speed()
    models, offloads = {}, {}
    for v in variants:
        t = time.perf_counter()
        models[v], offloads[v] = load(v, a.model, path)
        print(f"{v}: loaded in {time.perf_counter() - t:.1f} s", flush=True)
    g = torch.Generator().manual_seed(1)
    x = (sd3_inputs if a.model == "sd3" else flux_inputs)(a.resolution, dev, g)
    steps: dict = {v: [] for v in variants}
    hosts: dict = {v: [] for v in variants}
    digests: dict = {}
    with torch.no_grad():
        for v in variants:  # warm-up: each variant's first pass learns its order
            models[v](**x)
            if v.endswith("~bare"):
                strip_ddo(models[v], offloads[v])
        for r in range(a.rounds):
            # A rotating order: no variant always runs right after the same other one.
            for v in variants[r % len(variants):] + variants[: r % len(variants)]:
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = models[v](**x)[0]
                hosts[v].append(time.perf_counter() - t)
                torch.cuda.synchronize()
                steps[v].append(time.perf_counter() - t)
                if r == 0:
                    digests[v] = hashlib.sha256(out.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:12]
    resident = statistics.median(steps["resident"])
    print(f"\n{a.model} at {a.resolution}: {nbytes / 2**30:.2f} GiB, pinned link {link / 1e9:.1f} GB/s, "
          f"{a.rounds} interleaved rounds\n")
    print("| variant | streamed GiB/step | step s (median; min-max) | host s | floor s | x floor | x resident | output = resident |")
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        s = statistics.median(steps[v])
        streamed = 0
        if offloads[v] is not None:
            streamed = offloads[v].metrics_snapshot().as_dict()["setup"]["streamed_bytes_per_pass"] or 0
        peer = v.endswith("~peer")
        floor = resident if peer else max(resident, streamed / link)
        print(f"| {v} | {streamed / 2**30:.2f}{' (device memory)' if peer else ''} | {s:.4f} ({min(steps[v]):.4f}-{max(steps[v]):.4f}) | "
              f"{statistics.median(hosts[v]):.4f} | {floor:.4f} | {s / floor:.3f} | {s / resident:.3f} | {'yes' if digests[v] == digests['resident'] else 'NO'} |", flush=True)
    return 0 if all(d == digests["resident"] for d in digests.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
