"""The side-by-side GPU benchmark on the reference workload: Flux-style FluxTransformer2DModel
with random bf16 weights (5.0 B parameters at 512/1024/2048 and 11.9 B at 1024 by default), batch
1, 512 text tokens. Variants: resident, Diffusers leaf+stream, Diffusers block+stream, ddo
linear_runtime, ddo vmm_fast_runtime at a 3 GiB weight budget (everything streamed) and at larger
budgets (``vmm@GIB``: more resident units, fewer streamed bytes). Each variant runs in its own
process, so its setup time, peak host RSS and peak GPU memory (driver-level, sampled every 2 ms
through NVML) are its own; each process first runs a one-block model at every resolution, so
first-step times exclude CUDA's one-time kernel loading. "above base" is host RSS beyond what the
process held before loading weights (interpreter, torch, CUDA context, kernels).

Rows are kept in DIR/rows.jsonl (a later call replaces the rows it measures again), so a table too
long for one command can be measured in several calls on one machine; every call prints the table
of all rows so far. The floor of a row is max(resident step, bytes the variant streams per step /
pinned host-to-device copy speed measured in the same call).

    python bench_gpu.py [--configs 5:512,5:1024,5:2048,12:1024] [--variants ...] [--steps 4] [--dir DIR]
    python bench_gpu.py --table --dir DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import torch

from flux_workload import (
    SD3_LARGE, WAN_14B, flux_inputs, link_speed, saved_flux, saved_flux_q8, saved_sd3, saved_wan, sd3_inputs, timed,
    wan_inputs,
)

# Model sizes of --configs: Flux-style 5 B and 11.9 B, the SD3.5-Large-shaped "sd3" (8.1 B),
# "wan": the Wan-2.1-14B shape with 12 of its 40 blocks (4.4 B) and "wan40": all 40 (14 B), both
# saved in fp32 and loaded as bf16; "fp8": the 11.9 B Flux saved in fp8 (E4M3) and loaded as bf16;
# "q8": the 11.9 B Flux as a Q8_0 GGUF file, run by Diffusers' GGUF modules.
SIZES = {"5": (8, 16), "12": (19, 38), "sd3": None, "wan": 12, "wan40": 40, "fp8": (19, 38), "q8": (19, 38)}
# Variants each size runs (others are skipped): a GGUF model runs resident or streamed natively.
ONLY = {"q8": {"resident", "vmm"}}


def family(size: str) -> str:
    return {"sd3": "sd3", "wan": "wan", "wan40": "wan", "q8": "q8"}.get(size, "flux")


def label(size: str) -> str:
    return {
        "sd3": "SD3-L 8.1 B", "wan": "Wan-14B-shaped, 12 blocks, fp32 file", "wan40": "Wan-14B-shaped, 40 blocks, fp32 file",
        "fp8": "Flux 12 B, fp8 file", "q8": "Flux 12 B, GGUF Q8_0",
    }.get(size, f"Flux {size} B")


def inputs_of(fam: str):
    return {"sd3": sd3_inputs, "wan": wan_inputs}.get(fam, flux_inputs)


def gguf_file(path: str) -> str:
    return next(f for f in os.listdir(path) if f.endswith(".gguf"))
VARIANTS = ["resident", "diffusers_leaf", "diffusers_block", "linear", "vmm", "vmm@6", "vmm@9"]
# Also measurable with --variants: vmm_fast_runtime fed from retained host windows holding the
# whole model (vmm_source_cache_gb) instead of the checkpoint's mapping.
OPTIONAL = ["vmm_retained"]
# `vmm@GIB` (a weight budget of GIB), `vmm+dN` (prefetch depth N), or both: `vmm@6+d5`;
# `vmm@auto` is auto_budget_policy = balanced (the budget from the card's free memory), and a
# `%GIB` suffix simulates a smaller card: everything but GIB of the GPU's free memory is held by
# another allocation before the model loads (`vmm@auto%16`, `vmm@6%16`). A `~enc` suffix streams
# the bf16 weights entropy-coded (vmm_weight_encoding = on), `~auto` where the device decodes
# faster than the link copies (auto): their "x raw floor" column divides the step by the floor
# of the bytes the raw route streams at the same budget.
VMM_VARIANT = re.compile(r"^vmm(?:@([0-9.]+|auto))?(?:\+d([0-9]+))?(?:%([0-9.]+))?(~enc|~auto)?$")
# The budget of `vmm`: every unit streamed for the 5 B model.
STREAMING_BUDGET_GB = 3.0


class GpuSampler:
    """Peak driver-level used memory of GPU 0, sampled every 2 ms."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.base = self.used()
        self.peak = self.base
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def used(self) -> int:
        return self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used

    def run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, self.used())
            time.sleep(0.002)


def peak_rss() -> int:
    """This process's peak resident bytes (VmHWM). Not ``ru_maxrss``: Linux carries the parent's
    peak into it across fork and exec, so a parent that built a model inflates every variant."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_parts() -> dict:
    """Resident host bytes now, split into anonymous memory (the process's own) and file pages
    (a mapping's cached pages, which the kernel can drop and read again)."""
    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssFile", "RssShmem"):
                parts[name] = int(value.split()[0]) * 1024
    return parts


def warm_up(dev, resolutions: list[int], fam: str) -> None:
    """Runs a one-block model of the same shapes at every resolution and frees it, so first-step
    figures show the offloader's cold pass, not CUDA's one-time kernel loading that every variant
    pays."""
    import torch
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel

    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        if fam == "sd3":
            model = SD3Transformer2DModel(**dict(SD3_LARGE, num_layers=1)).eval()
        elif fam == "wan":
            model = WanTransformer3DModel(**dict(WAN_14B, num_layers=1)).eval()
        else:
            model = FluxTransformer2DModel(num_layers=1, num_single_layers=1).eval()
    torch.set_default_dtype(torch.float32)
    g = torch.Generator().manual_seed(2)
    for res in resolutions:
        with torch.no_grad():
            model(**inputs_of(fam)(res, dev, g))
    del model
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


class BackgroundCopies:
    """Host-to-device copies of 256 MiB from pinned memory, back to back on their own stream while
    active: what streaming puts on the link, without the model needing it (``+copy`` variants
    measure what the copies alone cost the compute)."""

    def __init__(self, dev) -> None:
        self.src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
        self.dst = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        self.stream = torch.cuda.Stream(dev)
        self.stop = threading.Event()
        self.copied = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            with torch.cuda.stream(self.stream):
                self.dst.copy_(self.src, non_blocking=True)
            self.stream.synchronize()
            self.copied += self.src.numel()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stop.set()
        self.thread.join()


def child(a: argparse.Namespace) -> int:
    sampler = GpuSampler()
    import torch

    import ddo
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel

    fam = a.family
    copying = a.variant.endswith("+copy")
    a.variant = a.variant.removesuffix("+copy")
    cls = {"sd3": SD3Transformer2DModel, "wan": WanTransformer3DModel}.get(fam, FluxTransformer2DModel)
    quantized = fam == "q8"

    dev = torch.device("cuda:0")
    resolutions = [int(r) for r in a.resolutions.split(",")]
    warm_up(dev, resolutions, "flux" if quantized else fam)
    # What the process holds before any weight: the interpreter, torch, the CUDA context and
    # the kernels every variant loads.
    card = VMM_VARIANT.match(a.variant)
    card = float(card.group(3)) if card and card.group(3) else None
    held = None
    if card is not None:
        free, _ = torch.cuda.mem_get_info(dev)
        held = torch.empty(max(0, free - int(card * 2**30)), dtype=torch.uint8, device=dev)
    rss_base, gpu_context = rss_now(), sampler.used() - sampler.base
    parts_base = rss_parts()
    sampler.peak = sampler.used()
    t = time.perf_counter()
    streamed, arena, native = None, None, None
    if a.variant == "resident" and quantized:
        from diffusers import GGUFQuantizationConfig

        model = cls.from_single_file(
            os.path.join(a.path, gguf_file(a.path)), config=a.path, torch_dtype=torch.bfloat16,
            quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16),
        ).to(dev).eval()
    elif a.variant == "resident":
        model = cls.from_pretrained(a.path, torch_dtype=torch.bfloat16).to(dev).eval()
    elif a.variant.startswith("diffusers"):
        from diffusers.hooks import apply_group_offloading

        model = cls.from_pretrained(a.path, torch_dtype=torch.bfloat16).eval()
        kind = "leaf_level" if a.variant == "diffusers_leaf" else "block_level"
        extra = {} if kind == "leaf_level" else {"num_blocks_per_group": 1}
        apply_group_offloading(model, onload_device=dev, offload_device=torch.device("cpu"), offload_type=kind, use_stream=True, **extra)
    else:
        if a.variant == "linear":
            config = ddo.DynamicOffloadConfig(backend="linear")
        elif a.variant == "vmm_retained":
            storage = min(32.0, float(int(a.nbytes / 2**30) + 1))
            config = ddo.DynamicOffloadConfig(
                backend="vmm", vmm_resident_weight_budget_gb=STREAMING_BUDGET_GB, vmm_source_cache_gb=storage
            )
        else:
            m = VMM_VARIANT.match(a.variant)
            extra_config = {"prefetch_depth": int(m.group(2))} if m.group(2) else {}
            if m.group(1) == "auto":
                extra_config["auto_budget_policy"] = "balanced"
                budget = STREAMING_BUDGET_GB
            else:
                budget = float(m.group(1)) if m.group(1) else STREAMING_BUDGET_GB
            if m.group(4):
                os.environ["DDO_VMM_WEIGHT_ENCODING"] = "on" if m.group(4) == "~enc" else "auto"
            config = ddo.DynamicOffloadConfig(backend="vmm", vmm_resident_weight_budget_gb=budget, **extra_config)
        extra = {"gguf_file": gguf_file(a.path)} if quantized else {}
        model = ddo.from_pretrained_with_dynamic_offload(
            a.path, torch_dtype=torch.bfloat16, apply_dynamic=True, component="transformer", dynamic_offload_config=config,
            **extra,
        )
        native = model.offload
        model = model.module
    torch.cuda.synchronize()
    setup = time.perf_counter() - t
    if native is not None:
        streamed = native.metrics_snapshot().as_dict()["setup"]["streamed_bytes_per_pass"]
    g = torch.Generator().manual_seed(1)
    for res in resolutions:
        x = inputs_of(fam)(res, dev, g)
        if copying:
            timed(lambda: model(**x)[0], 1)
            with BackgroundCopies(dev) as copies:
                t = time.perf_counter()
                times, out = timed(lambda: model(**x)[0], a.steps)
                copy_gbps = copies.copied / (time.perf_counter() - t) / 1e9
        else:
            warm_up_s = None
            if a.variant.endswith("~auto"):
                # auto times raw passes first and may switch to encoded streaming after them
                # (encoding then): those passes are not the steps measured.
                warm_up_s = sum(timed(lambda: model(**x)[0], 6)[0])
            times, out = timed(lambda: model(**x)[0], a.steps)
        digest = hashlib.sha256(out.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:12]
        if native is not None:
            after = native.metrics_snapshot().as_dict()
            arena = after["runtime"]["peak_bytes"]
            # An automatic budget plans again after the first pass: the steps stream this much.
            streamed = after["setup"]["streamed_bytes_per_pass"]
        row = dict(
            variant=a.variant, resolution=res, first=times[0], step=statistics.median(times[1:]), setup=setup,
            peak_gpu=sampler.peak - sampler.base, gpu_context=gpu_context, arena=arena, streamed=streamed,
            rss=peak_rss(), rss_base=rss_base, digest=digest,
            rss_parts_above_base={k: v - parts_base.get(k, 0) for k, v in rss_parts().items()},
        )
        if not copying and warm_up_s is not None:
            row["auto_warm_up_s"] = warm_up_s
        if held is not None:
            row["card_gib"], row["held_bytes"] = card, held.numel()
            row["peak_gpu"] -= held.numel()
            row["gpu_context"] -= held.numel()
        if native is not None and "auto_budget" in after["setup"]:
            row["auto_budget"] = after["setup"]["auto_budget"]
            row["gpu_budget_bytes"] = after["setup"]["gpu_budget_bytes"]
        if copying:
            row["variant"] = a.variant + "+copy"
            row["background_copy_gbps"] = copy_gbps
        if native is not None:
            snapshot = native.metrics_snapshot()
            row["runtime"] = snapshot.as_dict()["runtime"]
            row["profile"] = snapshot.format_profile()
            row["host_ms_per_step"] = host_ms_per_step(native.runtime, lambda: model(**x), 3)
        row["enqueue_ms"] = enqueue_ms(lambda: model(**x), 3)
        print("ROW " + json.dumps(row), flush=True)
    sampler.stop = True
    return 0


class _TimedSession:
    """A session whose calls add their host seconds to ``spent`` (wraps the native session)."""

    def __init__(self, session, spent: list) -> None:
        self._session, self._spent = session, spent
        # Events on the compute stream around each acquire: the time between them is the time
        # the GPU waited for the unit's upload.
        self.waits: list = []

    def __getattr__(self, name):
        f = getattr(self._session, name)
        if name not in ("acquire", "release", "begin_pass", "end_pass"):
            return f

        def timed_call(*args):
            if name == "acquire":
                before = torch.cuda.Event(enable_timing=True)
                before.record()
            t = time.perf_counter()
            try:
                return f(*args)
            finally:
                self._spent[0] += time.perf_counter() - t
                if name == "acquire":
                    after = torch.cuda.Event(enable_timing=True)
                    after.record()
                    self.waits.append((before, after))

        return timed_call


def host_ms_per_step(runtime, step, steps: int) -> dict:
    """Host milliseconds per step in ddo's calls (acquire/release/pass marks) and in its checks at
    the start of a forward, measured in extra steps after the timed ones."""
    spent, checks = [0.0], [0.0]
    check = runtime._check_module

    def timed_check(*args):
        t = time.perf_counter()
        try:
            return check(*args)
        finally:
            checks[0] += time.perf_counter() - t

    session = runtime.session
    runtime.session, runtime._check_module = _TimedSession(session, spent), timed_check
    try:
        timed(step, steps)
    finally:
        waits = runtime.session.waits
        runtime.session = session
        del runtime._check_module
    torch.cuda.synchronize()
    gpu_wait = sum(a.elapsed_time(b) for a, b in waits) / steps
    return {"session_calls": spent[0] * 1e3 / steps, "checks": checks[0] * 1e3 / steps, "gpu_waits_for_uploads": gpu_wait}


def enqueue_ms(step, steps: int) -> dict:
    """Milliseconds until a step's forward returns on the host (its work enqueued) and until the
    GPU finishes it: a host-bound step finishes soon after it is enqueued."""
    host, total = 0.0, 0.0
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            step()
        host += time.perf_counter() - t
        torch.cuda.synchronize()
        total += time.perf_counter() - t
    return {"enqueued": host * 1e3 / steps, "finished": total * 1e3 / steps}


def load_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def key(r: dict) -> tuple:
    return (r["size"], r["resolution"], r["variant"])


def table(rows: list[dict]) -> None:
    order = {v: i for i, v in enumerate(VARIANTS + OPTIONAL)}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["size"], r["resolution"]), []).append(r)
    print("\n| model | res | variant | streamed GiB/step | step s | x floor | first s (x step) | setup s | "
          "peak GPU GiB (arena) | peak RSS GiB (x model; above base) | output = resident |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (size, res), group in sorted(groups.items(), key=lambda kv: (kv[0][0] == "sd3", kv[0][0], kv[0][1])):
        group.sort(key=lambda r: order.get(r["variant"], len(order)))
        resident = next((r for r in group if r["variant"] == "resident" and "step" in r), None)
        nbytes = group[0]["nbytes"]
        for r in group:
            if "error" in r:
                print(f"| {label(size)} | {res} | {r['variant']} | | failed: {r['error'][:80]} | | | | | | |")
                continue
            streamed = nbytes if r["variant"] != "resident" and r.get("streamed") is None else (r.get("streamed") or 0)
            floor = max(resident["step"] if resident else 0.0, streamed / r["link"])
            arena = f" ({r['arena'] / 2**30:.2f})" if r.get("arena") else ""
            same = "" if resident is None else ("yes" if r["digest"] == resident["digest"] else "NO")
            plain = re.sub(r"~(enc|auto)$", "", r["variant"])
            raw = next((q for q in group if q["variant"] == plain and "step" in q), None)
            raw_floor = ""
            if plain != r["variant"] and raw is not None:
                raw_streamed = raw.get("streamed") or nbytes
                raw_floor = f"; x raw floor {r['step'] / max(resident['step'] if resident else 0.0, raw_streamed / r['link']):.3f}"
            print(f"| {label(size)} | {res} | {r['variant']} | {streamed / 2**30:.2f} | {r['step']:.4f} | {r['step'] / floor:.3f}{raw_floor} | "
                  f"{r['first']:.4f} ({r['first'] / r['step']:.2f}) | {r['setup']:.1f} | {r['peak_gpu'] / 2**30:.2f}{arena} | "
                  f"{r['rss'] / 2**30:.2f} ({r['rss'] / nbytes:.2f}; {(r['rss'] - r['rss_base']) / nbytes:.2f}) | {same} |")
        for r in group:
            parts = r.get("rss_parts_above_base")
            if parts:
                print(f"| {label(size)} | {res} | {r['variant']}: host memory after the steps, above base: "
                      f"anonymous {parts.get('RssAnon', 0) / 2**30:.2f} GiB, file pages {parts.get('RssFile', 0) / 2**30:.2f} GiB | | | | | | | | |")
        if resident:
            print(f"| {label(size)} | {res} | (resident model {nbytes / 2**30:.2f} GiB; copy {group[0]['link'] / 1e9:.1f} GB/s; "
                  f"CUDA context {resident['gpu_context'] / 2**30:.2f} GiB) | | | | | | | | |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="5:512,5:1024,5:2048,12:1024")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ddo-bench"))
    ap.add_argument("--table", action="store_true", help="print the table of the rows in DIR and stop")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--variant-timeout", type=float, default=300, help="seconds one variant may take")
    ap.add_argument("--variant")
    ap.add_argument("--family", default="flux")
    ap.add_argument("--path")
    ap.add_argument("--nbytes", type=int)
    ap.add_argument("--resolutions")
    a = ap.parse_args()
    if a.child:
        return child(a)
    os.makedirs(a.dir, exist_ok=True)
    rows_path = os.path.join(a.dir, "rows.jsonl")
    if a.table:
        table(load_rows(rows_path))
        return 0
    by_size: dict[str, list[int]] = {}
    for c in a.configs.split(","):
        size, res = c.split(":")
        if size not in SIZES:
            raise SystemExit(f"unknown model size {size!r} in --configs; sizes: {', '.join(SIZES)}")
        by_size.setdefault(size, []).append(int(res))
    unknown = [
        v for v in a.variants.split(",")
        if v.removesuffix("+copy") not in VARIANTS + OPTIONAL and not VMM_VARIANT.match(v.removesuffix("+copy"))
    ]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS + OPTIONAL)}, vmm@GIB, vmm+dDEPTH")
    explicit = a.variants != ap.get_default("variants")
    link = link_speed()
    print(f"pinned host->device copy: {link / 1e9:.1f} GB/s", flush=True)
    failed = False
    for size, resolutions in by_size.items():
        if size == "sd3":
            path, nbytes = saved_sd3(a.dir)
        elif size in ("wan", "wan40"):
            path, nbytes = saved_wan(a.dir, SIZES[size])
        elif size == "fp8":
            path, nbytes = saved_flux(a.dir, *SIZES[size], save_dtype=torch.float8_e4m3fn)
        elif size == "q8":
            path, nbytes = saved_flux_q8(a.dir, *SIZES[size])
        else:
            path, nbytes = saved_flux(a.dir, *SIZES[size])
        for variant in a.variants.split(","):
            if size != "5" and "@" in variant and not explicit:
                continue  # the default budget sweep runs on the 5 B model
            base = variant.removesuffix("+copy")
            if base not in ONLY.get(size, {base}) and not (size in ONLY and VMM_VARIANT.match(base)):
                continue
            t = time.perf_counter()
            cmd = [sys.executable, __file__, "--child", "--variant", variant, "--path", path, "--nbytes", str(nbytes),
                   "--family", family(size),
                   "--resolutions", ",".join(map(str, resolutions)), "--steps", str(a.steps)]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.variant_timeout)
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                p = subprocess.CompletedProcess(cmd, 124, out, f"timed out after {a.variant_timeout} s")
            got = [json.loads(line[4:]) for line in p.stdout.splitlines() if line.startswith("ROW ")]
            new = [dict(r, size=size, nbytes=nbytes, link=link) for r in got]
            if p.returncode != 0 or len(got) < len(resolutions):
                failed = True
                err = (p.stderr.strip().splitlines() or ["?"])[-1]
                print(f"{label(size)} {variant}: failed: {err}", flush=True)
                new += [dict(size=size, nbytes=nbytes, link=link, variant=variant, resolution=r, error=err) for r in resolutions[len(got):]]
            else:
                print(f"{label(size)} {variant}: done in {time.perf_counter() - t:.0f} s", flush=True)
                for r in got:
                    if r.get("profile"):
                        print(f"  at {r['resolution']}:\n" + r["profile"].rstrip(), flush=True)
                    if r.get("host_ms_per_step"):
                        print(f"  host ms per step in ddo: {r['host_ms_per_step']}", flush=True)
                for r in got:
                    if r.get("enqueue_ms"):
                        print(f"  ms per step, enqueued / finished: {r['enqueue_ms']}", flush=True)
                    if r.get("background_copy_gbps"):
                        print(f"  background copies beside the steps: {r['background_copy_gbps']:.1f} GB/s", flush=True)
            kept = [r for r in load_rows(rows_path) if key(r) not in {key(n) for n in new}]
            with open(rows_path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept + new)
    table(load_rows(rows_path))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
