"""GPU check of the linear route on the reference workload: a Flux-style FluxTransformer2DModel
with random bf16 weights (5.0 B parameters: 8 double and 16 single blocks), batch 1, 512 text
tokens. In one run it measures the pinned host->device copy speed, the resident step, and the
linear route's first and steady steps, checks that the linear route's output equals the resident
output bit for bit, and prints a table with the ratio to the floor
max(resident step, streamed bytes / measured copy speed).

    python crates/ddo-py/benches/gpu_linear.py [--resolution 1024] [--steps 5]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

import ddo
from flux_workload import flux_inputs, link_speed, random_model, timed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--double", type=int, default=8)
    ap.add_argument("--single", type=int, default=16)
    a = ap.parse_args()
    from diffusers import FluxTransformer2DModel

    dev = torch.device("cuda:0")
    model = random_model(FluxTransformer2DModel, num_layers=a.double, num_single_layers=a.single)
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = (a.resolution // 16) ** 2
    g = torch.Generator().manual_seed(1)
    inputs = flux_inputs(a.resolution, "cpu", g)
    on_dev = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in inputs.items()}

    link = link_speed(dev)

    model.to(dev)
    resident_times, reference = timed(lambda: model(**on_dev)[0], a.steps)
    resident = statistics.median(resident_times[1:])
    model.to("cpu")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)

    t = time.perf_counter()
    result = ddo.enable_offload(model, component="transformer", execution_device=dev, use_environment=False)
    setup = time.perf_counter() - t
    times, out = timed(lambda: model(**inputs)[0], a.steps)
    equal = torch.equal(out.to(dev), reference)
    steady = statistics.median(times[1:])
    snapshot = result.metrics_snapshot(collect_completed=True).as_dict()
    streamed = snapshot["setup"]["streamed_bytes_per_pass"]
    floor = max(resident, streamed / link)
    peak_gpu = snapshot["runtime"]["peak_bytes"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"\nFluxTransformer2DModel {params / 1e9:.2f} B parameters ({nbytes / 2**30:.2f} GiB), {a.resolution}x{a.resolution}, "
          f"{tokens} image + 512 text tokens, torch {torch.__version__}")
    print("| measure | value |")
    print("|---|---|")
    print(f"| pinned copy speed (same run) | {link / 1e9:.1f} GB/s |")
    print(f"| resident step (median) | {resident:.4f} s |")
    print(f"| floor max(resident, {streamed / 2**30:.2f} GiB / copy speed) | {floor:.4f} s |")
    print(f"| linear_runtime first step | {times[0]:.4f} s ({times[0] / steady:.2f} x steady) |")
    print(f"| linear_runtime steady step (median) | {steady:.4f} s ({steady / floor:.3f} x floor) |")
    print(f"| linear_runtime output equals resident bit for bit | {equal} |")
    print(f"| linear_runtime arena peak (weights on the GPU) | {peak_gpu / 2**30:.2f} GiB |")
    print(f"| peak host RSS | {rss / 2**30:.2f} GiB ({rss / nbytes:.2f} x model) |")
    print(f"| attach (registration in place) | {setup:.1f} s |")
    print(result.metrics_snapshot(collect_completed=True).format_profile(), end="")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
