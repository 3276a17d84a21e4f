"""What the arena's memory itself costs the kernels: one SD3-shaped model, every unit resident
through ddo (nothing streamed), ddo's hooks and pass entry taken off after its first pass, then
stepped in turn on three sets of the same weights:

- ``arena``: the views ddo published (arena memory);
- ``torch``: each weight cloned into PyTorch's own allocation;
- ``torch@arena-offset``: each weight in PyTorch's allocation at the address its arena view has
  modulo 2 MiB (the same alignment, other memory);
- ``torch@256``: each weight at an address that is a multiple of 256 and not of 512.

``arena`` against ``torch`` is what the memory costs; ``torch@arena-offset`` against both tells
whether alignment or the mapping is the cause. Prints the steps (median over rounds) and the
alignment of the arena's weights; every output must equal the others bit for bit.

    python gpu_arena_memory.py [--model sd3|flux12] [--budget-gb 18] [--rounds 14] [--dir DIR]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch

from flux_workload import flux_inputs, saved_flux, saved_sd3, sd3_inputs
from gpu_interleaved import load, strip_ddo

SPAN = 2 << 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="sd3", choices=["sd3", "flux12"])
    ap.add_argument("--budget-gb", type=float, default=18.0)
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ddo-bench"))
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    path, _ = saved_sd3(a.dir) if a.model == "sd3" else saved_flux(a.dir, 19, 38)
    dev = torch.device("cuda:0")
    module, offload = load(f"vmm@{a.budget_gb}", a.model, path)
    x = (sd3_inputs if a.model == "sd3" else flux_inputs)(a.resolution, dev, torch.Generator().manual_seed(1))
    with torch.no_grad():
        module(**x)
    strip_ddo(module, offload)
    places = [(m, n, p) for m in module.modules() for n, p in m._parameters.items() if p is not None]
    arena = [p.detach() for _, _, p in places]
    aligned = collections.Counter(min(p.data_ptr() & -p.data_ptr(), 4096) for p in arena)
    print("arena weights by address alignment (bytes: count):", dict(sorted(aligned.items())), flush=True)
    own = [p.clone() for p in arena]
    same = []
    for p in arena:
        buffer = torch.empty(p.numel() * p.element_size() + SPAN, dtype=torch.uint8, device=dev)
        shift = (p.data_ptr() - buffer.data_ptr()) % SPAN
        t = buffer[shift : shift + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        t.copy_(p)
        assert t.data_ptr() % SPAN == p.data_ptr() % SPAN
        same.append(t)
    at256 = []
    for p in arena:
        # 256-byte aligned and no more: the alignment the layout gives weight matrices.
        buffer = torch.empty(p.numel() * p.element_size() + 512, dtype=torch.uint8, device=dev)
        shift = (256 - buffer.data_ptr()) % 512
        t = buffer[shift : shift + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        t.copy_(p)
        at256.append(t)
    weights = {"arena": arena, "torch": own, "torch@arena-offset": same, "torch@256": at256}

    def use(name: str) -> None:
        for (m, n, _), t in zip(places, weights[name]):
            m._parameters[n] = torch.nn.Parameter(t, requires_grad=False)

    steps: dict = {k: [] for k in weights}
    outs = {}
    names = list(weights)
    with torch.no_grad():
        for r in range(a.rounds + 1):
            for name in names[r % len(names):] + names[: r % len(names)]:
                use(name)
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = module(**x)[0]
                torch.cuda.synchronize()
                if r:
                    steps[name].append(time.perf_counter() - t)
                else:
                    outs[name] = out.clone()
    base = statistics.median(steps["torch"])
    print(f"\n{a.model} at {a.resolution}, {a.rounds} interleaved rounds, {len(places)} weights\n")
    print("| weights | step s (median; min-max) | x torch | output = torch |")
    print("|---|---|---|---|")
    same_out = True
    for name in names:
        s = statistics.median(steps[name])
        equal = torch.equal(outs[name], outs["torch"])
        same_out &= equal
        print(f"| {name} | {s:.4f} ({min(steps[name]):.4f}-{max(steps[name]):.4f}) | {s / base:.3f} | {'yes' if equal else 'NO'} |")
    return 0 if same_out else 1


if __name__ == "__main__":
    raise SystemExit(main())
