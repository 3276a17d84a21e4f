"""The side-by-side GPU benchmark on the reference workload: Flux-style FluxTransformer2DModel
with random bf16 weights (5.0 B parameters at 512/1024/2048 and 11.9 B at 1024 by default), batch
1, 512 text tokens. Variants: resident, Diffusers leaf+stream, Diffusers block+stream, ddo
linear_runtime, ddo vmm_fast_runtime. Each variant runs in its own process, so peak host RSS and
peak GPU memory (driver-level, sampled every 2 ms through NVML) are its own. One table.

    python bench_gpu.py [--configs 5:512,5:1024,5:2048,12:1024] [--steps 4] [--budget-gb 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from flux_workload import flux_inputs, link_speed, random_model

SIZES = {"5": (8, 16), "12": (19, 38)}
VARIANTS = ["resident", "diffusers_leaf", "diffusers_block", "linear", "vmm"]


def build(path: str, double: int, single: int) -> int:
    from diffusers import FluxTransformer2DModel

    model = random_model(FluxTransformer2DModel, num_layers=double, num_single_layers=single)
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())




class GpuSampler:
    """Peak driver-level used memory of GPU 0, sampled every 2 ms."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.base = pynvml.nvmlDeviceGetMemoryInfo(self.handle).used
        self.peak = self.base
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
            time.sleep(0.002)


def child(a: argparse.Namespace) -> int:
    sampler = GpuSampler()
    import torch

    import ddo
    from diffusers import FluxTransformer2DModel

    dev = torch.device("cuda:0")
    t = time.perf_counter()
    if a.variant == "resident":
        model = FluxTransformer2DModel.from_pretrained(a.path, torch_dtype=torch.bfloat16).to(dev).eval()
    elif a.variant.startswith("diffusers"):
        from diffusers.hooks import apply_group_offloading

        model = FluxTransformer2DModel.from_pretrained(a.path, torch_dtype=torch.bfloat16).eval()
        kind = "leaf_level" if a.variant == "diffusers_leaf" else "block_level"
        extra = {} if kind == "leaf_level" else {"num_blocks_per_group": 1}
        apply_group_offloading(model, onload_device=dev, offload_device=torch.device("cpu"), offload_type=kind, use_stream=True, **extra)
    else:
        backend = "linear" if a.variant == "linear" else "vmm"
        config = ddo.DynamicOffloadConfig(backend=backend, vmm_resident_weight_budget_gb=a.budget_gb)
        model = ddo.from_pretrained_with_dynamic_offload(
            a.path, torch_dtype=torch.bfloat16, apply_dynamic=True, component="transformer", dynamic_offload_config=config
        ).module
    torch.cuda.synchronize()
    setup = time.perf_counter() - t
    g = torch.Generator().manual_seed(1)
    for res in [int(r) for r in a.resolutions.split(",")]:
        x = flux_inputs(res, dev, g)
        times = []
        out = None
        for _ in range(a.steps):
            torch.cuda.synchronize()
            s = time.perf_counter()
            with torch.no_grad():
                out = model(**x)[0]
            torch.cuda.synchronize()
            times.append(time.perf_counter() - s)
        checksum = float(out.double().abs().sum().item())
        row = dict(
            variant=a.variant, resolution=res, first=times[0], step=statistics.median(times[1:]), setup=setup,
            peak_gpu=sampler.peak - sampler.base, rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            checksum=checksum,
        )
        print("ROW " + json.dumps(row), flush=True)
    sampler.stop = True
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="5:512,5:1024,5:2048,12:1024")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget-gb", type=float, default=3.0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--variant")
    ap.add_argument("--path")
    ap.add_argument("--resolutions")
    a = ap.parse_args()
    if a.child:
        return child(a)
    work = a.dir or tempfile.mkdtemp(prefix="ddo-bench-")
    by_size: dict[str, list[int]] = {}
    for c in a.configs.split(","):
        size, res = c.split(":")
        by_size.setdefault(size, []).append(int(res))
    link = link_speed()
    print(f"pinned host->device copy: {link / 1e9:.1f} GB/s", flush=True)
    rows = []
    for size, resolutions in by_size.items():
        double, single = SIZES[size]
        path = os.path.join(work, f"flux-{size}b")
        t = time.perf_counter()
        nbytes = build(path, double, single)
        print(f"built and saved {size} B model ({nbytes / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s", flush=True)
        for variant in a.variants.split(","):
            cmd = [sys.executable, __file__, "--child", "--variant", variant, "--path", path,
                   "--resolutions", ",".join(map(str, resolutions)), "--steps", str(a.steps), "--budget-gb", str(a.budget_gb)]
            p = subprocess.run(cmd, capture_output=True, text=True)
            got = [json.loads(l[4:]) for l in p.stdout.splitlines() if l.startswith("ROW ")]
            for r in got:
                r.update(size=size, nbytes=nbytes)
                rows.append(r)
            if p.returncode != 0 or len(got) < len(resolutions):
                err = (p.stderr.strip().splitlines() or ["?"])[-1]
                print(f"{size} B {variant}: failed: {err}", flush=True)
                rows.extend(dict(size=size, nbytes=nbytes, variant=variant, resolution=r, error=err) for r in resolutions[len(got):])
            else:
                print(f"{size} B {variant}: done", flush=True)
    print("\n| model | res | variant | step s | x floor | first s | setup s | peak GPU GiB | peak RSS GiB (x model) | checksum |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size, resolutions in by_size.items():
        for res in resolutions:
            group = [r for r in rows if r["size"] == size and r["resolution"] == res]
            resident = next((r for r in group if r["variant"] == "resident" and "step" in r), None)
            nbytes = group[0]["nbytes"]
            floor = max(resident["step"] if resident else 0.0, nbytes / link)
            for r in group:
                if "error" in r:
                    print(f"| {size} B | {res} | {r['variant']} | failed: {r['error'][:60]} | | | | | | |")
                    continue
                print(f"| {size} B | {res} | {r['variant']} | {r['step']:.4f} | {r['step'] / floor:.3f} | {r['first']:.4f} | "
                      f"{r['setup']:.1f} | {r['peak_gpu'] / 2**30:.2f} | {r['rss'] / 2**30:.2f} ({r['rss'] / nbytes:.2f}) | {r['checksum']:.6e} |")
            print(f"| {size} B | {res} | floor | {floor:.4f} | 1.000 | | | | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
