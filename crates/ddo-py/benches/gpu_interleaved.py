"""Side-by-side steps in one process, interleaved: the resident model and ddo at several budgets
are loaded together (one mapping of the checkpoint feeds every session) and stepped in turn,
round after round, so a drift in the machine's speed (a shared host's CPU, clocks) falls on every
variant alike. Each variant's step is the median over the rounds; its floor is max(resident step,
bytes it streams per step / the pinned link speed measured in the same process).

``--trace N`` then profiles N more steps of each variant (CUDA activity only) and splits each
step's GPU time four ways: the compute stream and the host-to-device copies both busy, only
the kernels, only the copies, neither (the GPU waiting for the host or a fence). A step at its
copy floor is copies all the way (no kernel-only or idle time); one at its compute floor is
kernels all the way. It also prices the kernels against the resident model's (the median
duration of each kernel name there): the extra kernel time of kernels that ran beside a copy,
and of those that did not.

Variants: ``resident``, ``vmm@GIB`` (a weight budget), with ``+dN`` (prefetch depth N) and a
``~peer`` suffix (the streamed units held in this GPU's own memory: the same budget, copies from
device memory instead of over the host link), and a ``/PATTERN`` suffix (only blocks matching
``PATTERN`` stream: ``vmm_module_pattern``). ``vmm@GIB~bare`` is a diagnostic for budgets that
stream nothing: after its first pass ddo's hooks and pass entry are taken off, so the module runs
as plain PyTorch on weights in arena memory. Against ``resident`` it measures what the memory
costs; against ``vmm@GIB`` what ddo's per-pass and per-block host work costs. The ``host s``
column is the time until the forward returned (the host's enqueue time): near the step, the host
sets the pace. ``resident+copy@GIB`` is the resident model with GIB of unrelated host-to-device
copies enqueued beside each step: what streaming that many bytes costs the GPU with no offloader
in the step.

``--chain K`` (default 4) then times K steps back to back with one synchronize at the end, as a
pipeline runs them: the host enqueues a step while the GPU ends the last one, and uploads for
the next pass's first units overlap the last pass's end (each round above synchronizes after
every step, so they count in it).

``--dump FILE`` writes the traces and a per-block timeline of 4 steps of each variant (taken
before any profiling, which slows the host afterwards): when the GPU reached each block, got its
weights and ended it, and how far it ran behind the host.

    python gpu_interleaved.py --model sd3|flux12|q8 [--variants resident,vmm@3,vmm@6] [--rounds 8] [--trace N] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import tempfile
import time

import torch

from flux_workload import flux_inputs, link_speed, saved_flux, saved_flux_q8, saved_sd3, sd3_inputs

VARIANT = re.compile(r"^vmm@([0-9.]+)(?:\+d([0-9]+))?(~peer|~bare)?(?:/(.+))?$")
BESIDE = re.compile(r"^resident\+copy@([0-9.]+)$")


class CopiesBeside:
    """Diagnostic only: each step of the resident model with GIB of unrelated host-to-device
    copies (page-locked memory, 256 MiB each) enqueued on another stream as the step begins,
    what an offloader streaming GIB per step adds to the GPU with no offloader around it."""

    def __init__(self, model, gib: float) -> None:
        self.model, self.nbytes = model, int(gib * 2**30)
        self.chunk = 256 << 20
        self.src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
        self.dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
        self.stream = torch.cuda.Stream("cuda:0")

    def __call__(self, **x):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            done = 0
            while done < self.nbytes:
                n = min(self.chunk, self.nbytes - done)
                at = done % (1 << 30) if done % (1 << 30) + n <= 1 << 30 else 0
                self.dst[at:at + n].copy_(self.src[at:at + n], non_blocking=True)
                done += n
        out = self.model(**x)
        torch.cuda.current_stream().wait_stream(self.stream)
        return out


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
        raise SystemExit(
            f"unknown variant {variant!r}: resident, resident+copy@GIB, vmm@GIB, vmm@GIB+dN, vmm@GIB~peer, vmm@GIB~bare, vmm@GIB/PATTERN"
        )
    extra = {"prefetch_depth": int(m.group(2))} if m.group(2) else {}
    if m.group(3) == "~peer":
        extra["vmm_peer_store_device"] = "cuda:0"
    if m.group(4):
        extra["vmm_module_pattern"] = m.group(4)
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


def traced_steps(step, steps: int) -> list[dict]:
    """Runs ``steps`` steps under torch.profiler (CUDA activity only) and returns, per step, its
    compute-stream kernels and host-to-device copies as (start, end, name) in microseconds."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda.synchronize()
            time.sleep(0.03)  # a gap on the GPU that separates the steps in the trace
            with torch.no_grad():
                step()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        raw = os.path.join(d, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw) as f:
            events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    if not kernels:
        raise SystemExit("the trace holds no kernels: this torch records no CUDA activity")
    per_stream: dict = {}
    for k in kernels:
        per_stream.setdefault(k.get("args", {}).get("stream"), []).append(k)
    ks = max(per_stream.values(), key=lambda v: sum(k["dur"] for k in v))
    spans = sorted([(k["ts"], k["ts"] + k["dur"], "k", k["name"]) for k in ks]
                   + [(c["ts"], c["ts"] + c["dur"], "c", c.get("args", {}).get("bytes", 0)) for c in copies])
    out, cur, end = [], [], None
    for e in spans:  # steps are separated by an idle GPU of 30 ms
        if end is not None and e[0] - end > 15_000:
            out.append(cur)
            cur = []
        cur.append(e)
        end = e[1] if end is None else max(end, e[1])
    out.append(cur)
    return [{"kernels": [(a, b, n) for a, b, t, n in c if t == "k"],
             "copies": [(a, b, n) for a, b, t, n in c if t == "c"]} for c in out]


def union(spans) -> list:
    merged: list = []
    for a, b, *_ in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def overlap(a: float, b: float, merged: list) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged)


def states(k: list, c: list, start: float, end: float) -> list:
    """The step's time as (start, end, state) runs, state one of "both", "kernels only",
    "copies only", "neither", from the merged kernel and copy spans."""
    cuts = sorted({start, end, *(x for a, b in k + c for x in (a, b) if start <= x <= end)})
    runs: list = []
    ki = ci = 0
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        while ki < len(k) and k[ki][1] <= mid:
            ki += 1
        while ci < len(c) and c[ci][1] <= mid:
            ci += 1
        kb = ki < len(k) and k[ki][0] <= mid
        cb = ci < len(c) and c[ci][0] <= mid
        state = "both" if kb and cb else "kernels only" if kb else "copies only" if cb else "neither"
        if runs and runs[-1][2] == state:
            runs[-1] = (runs[-1][0], b, state)
        else:
            runs.append((a, b, state))
    return runs


def split_step(step: dict, reference: dict) -> dict:
    """One step's GPU time four ways (milliseconds) from its first kernel or copy to its last,
    copies of the next step's first units after the last kernel included (a synchronized step
    waits for them), its kernels priced against ``reference`` (kernel name -> median
    microseconds in the resident model), and its longest runs of each state but "both"."""
    ks, cs = step["kernels"], step["copies"]
    start = min(x[0] for x in ks + cs)
    end = max(x[1] for x in ks + cs)
    last_kernel = max(b for _, b, _ in ks)
    k, c = union(ks), union(cs)
    runs = states(k, c, start, end)
    total = {s: 0.0 for s in ("both", "kernels only", "copies only", "neither")}
    for a, b, st in runs:
        total[st] += b - a
    beside = alone = 0.0
    for a, b, name in ks:
        ref = reference.get(name)
        if ref is None:
            continue
        if overlap(a, b, c) > (b - a) / 2:
            beside += (b - a) - ref
        else:
            alone += (b - a) - ref
    longest = sorted((r for r in runs if r[2] != "both"), key=lambda r: r[0] - r[1])[:6]
    return {
        "span": (end - start) / 1e3, **{s: t / 1e3 for s, t in total.items()},
        "after last kernel": (end - last_kernel) / 1e3,
        "copy GB": sum(n for _, _, n in cs) / 1e9,
        "copy busy": sum(b - a for a, b in c) / 1e3,
        "extra beside copies": beside / 1e3, "extra alone": alone / 1e3,
        "longest": [f"{st} {(b - a) / 1e3:.1f} ms at {(a - start) / 1e3:.1f}" for a, b, st in sorted(longest)],
    }


def report_traces(traces: dict, link: float) -> None:
    ref_steps = traces["resident"]
    durations: dict = {}
    for st in ref_steps:
        for a, b, name in st["kernels"]:
            durations.setdefault(name, []).append(b - a)
    reference = {n: statistics.median(d) for n, d in durations.items()}
    print("\nPer step on the GPU (ms, the median over the traced steps; 'both' = kernels beside copies; "
          "'extra' = kernel time over the resident model's for the same kernels):\n")
    cols = ["span", "both", "kernels only", "copies only", "neither", "after last kernel", "copy busy", "copy GB",
            "extra beside copies", "extra alone"]
    print("| variant | " + " | ".join(cols) + " | copy GB/s while busy |")
    print("|---|" + "---|" * (len(cols) + 1))
    longest = {}
    for v, steps in traces.items():
        rows = [split_step(st, reference) for st in steps]
        med = {c: statistics.median(r[c] for r in rows) for c in cols}
        longest[v] = rows[len(rows) // 2]["longest"]
        rate = med["copy GB"] / (med["copy busy"] / 1e3) if med["copy busy"] else 0.0
        print(f"| {v} | " + " | ".join(f"{med[c]:.2f}" if c == "copy GB" else f"{med[c]:.1f}" for c in cols)
              + f" | {rate:.1f} (pinned link {link / 1e9:.1f}) |", flush=True)
    print("\nLongest runs of one state (a traced step of each variant; ms from the step's start):")
    for v, runs in longest.items():
        print(f"  {v}: " + "; ".join(runs))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="sd3", choices=["sd3", "flux12", "q8"])
    ap.add_argument("--variants", default="resident,vmm@3,vmm@6,vmm@10.5,vmm@14.5,vmm@14.5~peer")
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--chain", type=int, default=4,
                    help="then time this many steps back to back (one synchronize at the end), as a pipeline runs them")
    ap.add_argument("--trace", type=int, default=0, help="steps of each variant to profile after the rounds")
    ap.add_argument("--host", action="store_true", help="then time ddo's host work per step of each ddo variant")
    ap.add_argument("--dump", help="write the traced steps and per-block timelines (4 steps, taken before any profiling) of each variant to this JSON file")
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ddo-bench"))
    a = ap.parse_args()
    variants = a.variants.split(",")
    if a.rounds < 1 or a.chain < 0:
        raise SystemExit("--rounds must be 1 or more and --chain 0 or more")
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
        if BESIDE.match(v):
            continue
        t = time.perf_counter()
        models[v], offloads[v] = load(v, a.model, path)
        print(f"{v}: loaded in {time.perf_counter() - t:.1f} s", flush=True)
    g = torch.Generator().manual_seed(1)
    x = (sd3_inputs if a.model == "sd3" else flux_inputs)(a.resolution, dev, g)
    call = {v: (lambda v=v: models[v](**x)) for v in models}
    for v in variants:
        m = BESIDE.match(v)
        if m:  # the resident model itself, with copies beside it
            models[v], offloads[v] = models["resident"], None
            call[v] = lambda c=CopiesBeside(models["resident"], float(m.group(1))): c(**x)
    steps: dict = {v: [] for v in variants}
    hosts: dict = {v: [] for v in variants}
    digests: dict = {}
    with torch.no_grad():
        for v in variants:  # warm-up: each variant's first pass learns its order
            call[v]()
            if v.endswith("~bare"):
                strip_ddo(models[v], offloads[v])
        for r in range(a.rounds):
            # A rotating order: no variant always runs right after the same other one.
            for v in variants[r % len(variants):] + variants[: r % len(variants)]:
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = call[v]()[0]
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
    streamed_bytes: dict = {}
    for v in variants:
        s = statistics.median(steps[v])
        streamed = 0
        if offloads[v] is not None:
            streamed = offloads[v].metrics_snapshot().as_dict()["setup"]["streamed_bytes_per_pass"] or 0
        beside = BESIDE.match(v)
        if beside:
            streamed = float(beside.group(1)) * 2**30
        streamed_bytes[v] = streamed
        peer = v.endswith("~peer")
        floor = resident if peer else max(resident, streamed / link)
        what = " (device memory)" if peer else " (unrelated copies)" if beside else ""
        print(f"| {v} | {streamed / 2**30:.2f}{what} | {s:.4f} ({min(steps[v]):.4f}-{max(steps[v]):.4f}) | "
              f"{statistics.median(hosts[v]):.4f} | {floor:.4f} | {s / floor:.3f} | {s / resident:.3f} | {'yes' if digests[v] == digests['resident'] else 'NO'} |", flush=True)
    if a.chain:
        # A pipeline's steps follow each other with no synchronize between them: the host
        # enqueues the next step while the GPU ends the last, and uploads for the next pass's
        # first units overlap the last pass's end.
        chained: dict = {v: [] for v in variants}
        with torch.no_grad():
            for r in range(a.rounds):
                for v in variants[r % len(variants):] + variants[: r % len(variants)]:
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for _ in range(a.chain):
                        call[v]()
                    torch.cuda.synchronize()
                    chained[v].append((time.perf_counter() - t) / a.chain)
        resident_chained = statistics.median(chained["resident"])
        print(f"\n{a.chain} steps back to back (one synchronize at the end), per step:\n")
        print("| variant | step s (median; min-max) | floor s | x floor | x resident |")
        print("|---|---|---|---|---|")
        for v in variants:
            s = statistics.median(chained[v])
            floor = resident_chained if v.endswith("~peer") else max(resident_chained, streamed_bytes[v] / link)
            print(f"| {v} | {s:.4f} ({min(chained[v]):.4f}-{max(chained[v]):.4f}) | {floor:.4f} | {s / floor:.3f} | "
                  f"{s / resident_chained:.3f} |", flush=True)
    if a.dump:
        # Before any profiling or timing wrapper: the profiler leaves the host slower after it.
        from bench_gpu import timeline

        lines = {v: timeline(models[v], call[v], 4) for v in variants}
    if a.host:
        from bench_gpu import host_ms_per_step, host_threads

        print("\nUploads (every pass so far): host microseconds to enqueue one, copies per upload")
        for v in variants:
            if offloads[v] is not None:
                rt = offloads[v].metrics_snapshot().as_dict()["runtime"]
                if rt.get("uploads"):
                    print(f"  {v}: {rt['uploads']} uploads, {rt['upload_seconds'] / rt['uploads'] * 1e6:.0f} us each, "
                          f"{rt['upload_copies'] / rt['uploads']:.1f} copies each", flush=True)

        print("\nHost work per step (ms): in ddo's session calls, in its per-forward check, GPU waits for "
              "uploads; the forward thread's wall and CPU time")
        for v in variants:
            step = call[v]
            spent = host_ms_per_step(offloads[v].runtime, step, 3) if offloads[v] is not None else {}
            threads = host_threads(step, 3)
            print(f"  {v}: " + ", ".join(f"{k} {val:.2f}" for k, val in spent.items())
                  + f"; wall {threads['wall_ms']}, forward CPU {threads['forward_cpu_ms']}", flush=True)
        import cProfile
        import pstats

        for v in variants:
            prof = cProfile.Profile()
            with torch.no_grad():
                prof.enable()
                for _ in range(3):
                    call[v]()
                prof.disable()
            torch.cuda.synchronize()
            print(f"\n{v}: the host's functions with the most own time over 3 steps (cProfile)")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    traces: dict = {}
    if a.trace:
        print("\nPlans (units in module order; S streamed, R resident, P pinned):")
        for v in variants:
            if offloads[v] is not None:
                session = offloads[v].runtime.session
                streamed = {u for u, _ in session.streamed_units()}
                print(f"  {v}: " + "".join("P" if pinned else "S" if u in streamed else "R" for u, _, pinned in session.units()))
        traces = {v: traced_steps(call[v], a.trace) for v in variants}
        report_traces(traces, link)
    if a.dump:
        with open(a.dump, "w") as f:
            json.dump({"link": link, "steps": {v: statistics.median(steps[v]) for v in variants},
                       "hosts": {v: statistics.median(hosts[v]) for v in variants},
                       "traces": traces, "timelines": lines}, f)
    return 0 if all(d == digests["resident"] for d in digests.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
