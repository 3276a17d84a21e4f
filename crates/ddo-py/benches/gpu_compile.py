"""GPU check of torch.compile beside offload: a Flux-style transformer (random bf16 weights, 5.0 B
parameters by default) compiled regionally (Diffusers' compile_repeated_blocks(fullgraph=True),
inductor), timed resident-compiled, offloaded-uncompiled and offloaded-compiled (vmm_fast_runtime
with a budget that streams part of it). Prints seconds per step, the copy floor (streamed bytes
per pass / pinned copy speed measured in this run), the ratio offloaded-compiled /
max(resident-compiled, floor), whether the offloaded-compiled output equals the resident-compiled
one bit for bit, and whether anything compiled again after the first pass.

    python crates/ddo-py/benches/gpu_compile.py --budget-gb 8 --steps 6 [--resolution 1024]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
from torch._dynamo.utils import counters

import ddo
from flux_workload import flux_inputs, link_speed, saved_flux, timed


def step_seconds(fn, steps: int) -> tuple[float, float, torch.Tensor]:
    """The first step (compilation included) and the median of the others, and the last output."""
    times, out = timed(fn, steps)
    return times[0], statistics.median(times[1:]), out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-gb", type=float, default=8.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--double", type=int, default=8)
    ap.add_argument("--single", type=int, default=16)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    from diffusers import FluxTransformer2DModel

    dev = torch.device("cuda:0")
    path, nbytes = saved_flux(a.dir or tempfile.mkdtemp(prefix="ddo-compile-"), a.double, a.single)
    x = flux_inputs(a.resolution, dev, torch.Generator().manual_seed(1))
    link = link_speed(dev)
    print(f"Flux-style model {nbytes / 2**30:.2f} GiB, {a.resolution} px, budget {a.budget_gb} GiB, {a.steps} steps; "
          f"pinned copy {link / 1e9:.1f} GB/s")

    resident = FluxTransformer2DModel.from_pretrained(path, torch_dtype=torch.bfloat16).to(dev).eval()
    resident.compile_repeated_blocks(fullgraph=True)
    r_first, r_step, ref = step_seconds(lambda: resident(**x)[0], a.steps)
    resident.to("meta")  # its GPU memory back before the offloaded runs
    torch.cuda.empty_cache()

    loaded = ddo.from_pretrained_with_dynamic_offload(
        path, model_loader=FluxTransformer2DModel, torch_dtype=torch.bfloat16, apply_dynamic=True,
        component="transformer", config=ddo.DynamicOffloadConfig(backend="vmm", vmm_resident_weight_budget_gb=a.budget_gb),
    )
    module = loaded.module
    setup = loaded.offload.metrics_snapshot().as_dict()["setup"]
    floor = setup["streamed_bytes_per_pass"] / link
    _, u_step, _ = step_seconds(lambda: module(**x)[0], a.steps)
    module.compile_repeated_blocks(fullgraph=True)
    c_first, _, _ = step_seconds(lambda: module(**x)[0], 2)  # compiles (the resident run compiled the same blocks)
    graphs = counters["stats"]["unique_graphs"]
    _, c_step, out = step_seconds(lambda: module(**x)[0], a.steps)
    recompiled = counters["stats"]["unique_graphs"] - graphs + sum(counters["recompiles"].values())
    same = torch.equal(out, ref)

    print(f"plan: {setup['resident_units']} resident / {setup['streamed_units']} streamed units, "
          f"{setup['streamed_bytes_per_pass'] / 2**30:.2f} GiB streamed per pass")
    print("\n| run | first step | step | ")
    print("|---|---|---|")
    print(f"| resident, compiled | {r_first:.3f} s | {r_step:.4f} s |")
    print(f"| offloaded, uncompiled | - | {u_step:.4f} s |")
    print(f"| offloaded, compiled | {c_first:.3f} s | {c_step:.4f} s |")
    print(f"\ncopy floor {floor:.4f} s; offloaded-compiled / max(resident-compiled, floor) = {c_step / max(r_step, floor):.3f}; "
          f"compiled / uncompiled offloaded = {c_step / u_step:.3f}")
    print(f"offloaded-compiled output equals resident-compiled bit for bit: {same}; "
          f"graphs compiled after the first passes: {recompiled}")
    loaded.offload.remove()
    return 0 if same and recompiled == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
