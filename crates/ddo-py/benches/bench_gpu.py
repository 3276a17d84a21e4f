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

Variants that read the disk have floors of the disk's cold read speed (evicted from the page cache,
then read with O_DIRECT by 8 threads in 16 MiB requests in file order), measured once per call when one is asked:
``disk`` (the disk route vmm_runtime, preset nvme_baseline: every pass read into staging) at
max(resident step, disk bytes per pass / disk speed), and ``vmm_retained_half`` (half the model
retained in host memory, the rest read from disk into staging every pass) at max(resident step,
retained bytes streamed / link + disk bytes per pass / disk speed). A ``^cold`` suffix on any
variant (``vmm^cold``, ``resident^cold``) evicts the checkpoint's files from the page cache before
the model loads and records the seconds from the start of loading to the end of the first step,
beside the time the disk takes to read those files.

With DDO_BENCH_TRACE=FOLDER set, each row also runs two steps under torch.profiler, saves their
Chrome trace in FOLDER and records its summary: the compute stream's kernel, busy and idle
milliseconds per step, the host's milliseconds in the forward, copy milliseconds and bytes, the
largest idle gaps and the kernels with the most time.

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
    SD3_LARGE, WAN_14B, cached_fraction, checkpoint_files, disk_read_speed, evict_from_cache, flux_inputs, link_speed,
    saved_flux, saved_flux_q8, saved_sd3, saved_wan, sd3_inputs, timed, wan_inputs, warm_files,
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
# whole model (vmm_source_cache_gb) instead of the checkpoint's mapping, or half of it (the rest
# read from disk into staging every pass), the disk route (vmm_runtime, every pass from disk), and
# the streamed units held in the last GPU's memory (vmm_peer_store_device).
OPTIONAL = ["vmm_retained", "vmm_retained_half", "disk", "vmm_peer"]
# Variants whose floor is the disk's read speed.
DISK_VARIANTS = {"vmm_retained_half", "disk"}
# `vmm@GIB` (a weight budget of GIB), `vmm+dN` (prefetch depth N), or both: `vmm@6+d5`;
# `vmm@auto` is auto_budget_policy = balanced (the budget from the card's free memory), and a
# `%GIB` suffix simulates a smaller card: everything but GIB of the GPU's free memory is held by
# another allocation before the model loads (`vmm@auto%16`, `vmm@6%16`). A `~enc` suffix streams
# the bf16 weights entropy-coded (vmm_weight_encoding = on), `~auto` where the device decodes
# faster than the link copies (auto): their "x raw floor" column divides the step by the floor
# of the bytes the raw route streams at the same budget.
# A `~peer` suffix holds the streamed units in the last GPU's memory (as `vmm_peer`, at the
# variant's budget), `~retained` feeds them from retained host windows holding the whole model (as
# `vmm_retained`): the same budget with copies from device memory or from anonymous host memory
# instead of the checkpoint's mapping.
VMM_VARIANT = re.compile(r"^vmm(?:@([0-9.]+|auto))?(?:\+d([0-9]+))?(?:%([0-9.]+))?(~enc|~auto|~peer|~retained)?$")
# The budget of `vmm`: every unit streamed for the 5 B model.
STREAMING_BUDGET_GB = 3.0


def base_of(variant: str) -> str:
    """The variant without its ``^cold`` and ``+copy`` suffixes (in that order: ``vmm+copy^cold``)."""
    return variant.removesuffix("^cold").removesuffix("+copy")


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
    full = a.variant
    cold = a.variant.endswith("^cold")
    a.variant = a.variant.removesuffix("^cold")
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
    if cold:
        files = checkpoint_files(a.path)
        evicted_by = evict_from_cache(files)
        cached_after = cached_fraction(files)
    sampler.peak = sampler.used()
    t = load_start = time.perf_counter()
    streamed, arena, native, stages = None, None, None, None
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
        elif a.variant == "vmm_retained_half":
            # Read with O_DIRECT (the windows at load, the rest every pass): pread would serve the
            # rest from the page cache after the first pass, not from the disk the floor counts.
            config = ddo.DynamicOffloadConfig(
                backend="vmm", vmm_resident_weight_budget_gb=STREAMING_BUDGET_GB,
                vmm_source_cache_gb=round(a.nbytes / 2 / 2**30, 2), load_safetensors_backend="direct",
            )
        elif a.variant == "vmm_peer":
            # The streamed units in the last GPU's memory: another GPU's where the machine has two
            # (over the peer link), else this one's (a same-device store).
            config = ddo.DynamicOffloadConfig(
                backend="vmm", vmm_resident_weight_budget_gb=STREAMING_BUDGET_GB,
                vmm_peer_store_device=f"cuda:{torch.cuda.device_count() - 1}",
            )
        elif a.variant == "disk":
            config = ddo.DynamicOffloadConfig(
                backend="vmm", preset="nvme_baseline", vmm_resident_weight_budget_gb=STREAMING_BUDGET_GB
            )
        else:
            m = VMM_VARIANT.match(a.variant)
            extra_config = {"prefetch_depth": int(m.group(2))} if m.group(2) else {}
            if m.group(1) == "auto":
                extra_config["auto_budget_policy"] = "balanced"
                budget = STREAMING_BUDGET_GB
            else:
                budget = float(m.group(1)) if m.group(1) else STREAMING_BUDGET_GB
            if m.group(4) == "~peer":
                extra_config["vmm_peer_store_device"] = f"cuda:{torch.cuda.device_count() - 1}"
            elif m.group(4) == "~retained":
                extra_config["vmm_source_cache_gb"] = min(32.0, float(int(a.nbytes / 2**30) + 1))
            elif m.group(4):
                os.environ["DDO_VMM_WEIGHT_ENCODING"] = "on" if m.group(4) == "~enc" else "auto"
            config = ddo.DynamicOffloadConfig(backend="vmm", vmm_resident_weight_budget_gb=budget, **extra_config)
        extra = {"gguf_file": gguf_file(a.path)} if quantized else {}
        model = ddo.from_pretrained_with_dynamic_offload(
            a.path, torch_dtype=torch.bfloat16, apply_dynamic=True, component="transformer", dynamic_offload_config=config,
            **extra,
        )
        native = model.offload
        stages = dict(model.stage_seconds, read_ahead_bytes=model.read_ahead_bytes)
        model = model.module
    torch.cuda.synchronize()
    setup = time.perf_counter() - t
    if native is not None:
        streamed = native.metrics_snapshot().as_dict()["setup"]["streamed_bytes_per_pass"]
    # The end of the first step, for a cold start.
    first_end: list[float] = []

    def step():
        out = model(**x)[0]
        if not first_end:
            torch.cuda.synchronize()
            first_end.append(time.perf_counter())
        return out

    g = torch.Generator().manual_seed(1)
    for res in resolutions:
        x = inputs_of(fam)(res, dev, g)
        if copying:
            timed(step, 1)
            host_alone = host_work_ms()
            with BackgroundCopies(dev) as copies:
                t = time.perf_counter()
                times, out = timed(step, a.steps)
                copy_gbps = copies.copied / (time.perf_counter() - t) / 1e9
                # What the copies cost the host: enqueueing a step, and plain interpreter work.
                enqueue_copying = enqueue_ms(lambda: model(**x), 3)
                host_copying = host_work_ms()
        else:
            warm_up_s = None
            if a.variant.endswith("~auto"):
                # auto times raw passes first and may switch to encoded streaming after them
                # (encoding then): those passes are not the steps measured.
                warm_up_s = sum(timed(step, 6)[0])
            times, out = timed(step, a.steps)
        digest = hashlib.sha256(out.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:12]
        if native is not None:
            after = native.metrics_snapshot().as_dict()
            arena = after["runtime"]["peak_bytes"]
            # An automatic budget plans again after the first pass: the steps stream this much.
            streamed = after["setup"]["streamed_bytes_per_pass"]
        row = dict(
            variant=full, resolution=res, first=times[0], step=statistics.median(times[1:]), setup=setup,
            peak_gpu=sampler.peak - sampler.base, gpu_context=gpu_context, arena=arena, streamed=streamed,
            rss=peak_rss(), rss_base=rss_base, digest=digest,
            rss_parts_above_base={k: v - parts_base.get(k, 0) for k, v in rss_parts().items()},
        )
        # PyTorch's allocator under the card's ceiling: retries are cudaMalloc failures it met
        # by freeing its cache (each a device-wide synchronize).
        stats = torch.cuda.memory_stats(dev)
        row["alloc_retries"] = stats.get("num_alloc_retries", 0)
        row["torch_reserved_peak"] = stats.get("reserved_bytes.all.peak", 0) - (held.numel() if held is not None else 0)
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
            row["background_copy_gbps"] = copy_gbps
            row["enqueue_ms_copying"] = enqueue_copying
            row["host_work_ms"] = {"alone": host_alone, "copying": host_copying}
        if native is not None:
            snapshot = native.metrics_snapshot()
            row["runtime"] = snapshot.as_dict()["runtime"]
            row["profile"] = snapshot.format_profile()
            row["host_ms_per_step"] = host_ms_per_step(native.runtime, lambda: model(**x), 3)
            # What the disk floors need (absent on routes that read no disk).
            for k in ("disk_bytes_per_pass", "disk_bytes_per_second", "read_stall_seconds", "passes"):
                if row["runtime"].get(k) is not None:
                    row[k] = row["runtime"][k]
            for k in (
                "host_source", "host_tier_reason", "retained_bytes", "unretained_bytes", "staging_read",
                "peer_store_device", "peer_store_units", "peer_store_bytes", "peer_link_bytes_per_second",
            ):
                if after["setup"].get(k) is not None:
                    row[k] = after["setup"][k]
        if a.variant == "vmm_retained_half":
            row["source_cache_gb"] = round(a.nbytes / 2 / 2**30, 2)
        if stages is not None:
            setup_of = after["setup"]
            row["stages"] = dict(stages, **{
                k: setup_of[k] for k in (
                    "source_seconds", "read_in_bytes", "read_in_seconds", "registration_seconds", "resident_upload_seconds"
                ) if setup_of.get(k) is not None
            })
        if cold and res == resolutions[0]:
            row["cold_start_s"] = first_end[0] - load_start
            row["nbytes_on_disk"] = sum(os.path.getsize(f) for f in files)
            row["evicted_by"], row["cached_after_evict"] = evicted_by, cached_after
        row["enqueue_ms"] = enqueue_ms(lambda: model(**x), 3)
        row["host_threads"] = host_threads(lambda: model(**x), 3)
        if os.environ.get("DDO_BENCH_TIMELINE"):
            row["timeline"] = timeline(model, lambda: model(**x), 2)
        if os.environ.get("DDO_BENCH_TRACE"):
            row["trace"] = traced(lambda: model(**x), 2, os.environ["DDO_BENCH_TRACE"], f"{fam}-{full}-{res}")
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
        if name not in ("acquire", "release", "reached", "begin_pass", "end_pass"):
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
    """Host milliseconds per step in ddo's calls (acquire/release/reached/pass marks) and in its checks at
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


def host_work_ms() -> float:
    """Milliseconds of a fixed piece of interpreter work (dictionary and list operations): the
    host's own speed, beside what else the machine does at the time."""
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        d: dict = {}
        for i in range(200_000):
            d[i & 1023] = [i, i + 1]
        best = min(best, time.perf_counter() - t)
    return best * 1e3


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


def _thread_sample() -> dict:
    """Each thread of this process: name, nanoseconds on a CPU and waiting in the run queue
    (schedstat), voluntary and involuntary context switches, and the CPU it last ran on."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        base = f"/proc/self/task/{tid}"
        try:
            with open(f"{base}/schedstat") as f:
                run, wait = (int(v) for v in f.read().split()[:2])
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"{base}/stat") as f:
                cpu = int(f.read().rsplit(")", 1)[1].split()[36])
        except (OSError, ValueError, IndexError):
            continue
        out[int(tid)] = dict(
            name=name, run=run, wait=wait, cpu=cpu,
            voluntary=int(status.get("voluntary_ctxt_switches", 0)),
            involuntary=int(status.get("nonvoluntary_ctxt_switches", 0)),
        )
    return out


def _siblings(cpu: int) -> str:
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            return f.read().strip()
    except OSError:
        return "?"


def host_threads(step, steps: int) -> dict:
    """Where the host's time goes over ``steps`` steps, per step: the forward's thread's wall and
    CPU milliseconds (CPU well below wall: it blocked in the driver, a lock or a syscall) and, for
    it and every thread that ran 0.5 ms or more, CPU and run-queue milliseconds (waiting for a
    CPU: contention) and context switches; with the CPUs they last ran on and those CPUs' SMT
    siblings (two busy threads on siblings share one core)."""
    main = threading.get_native_id()
    torch.cuda.synchronize()
    before, wall, cpu = _thread_sample(), time.perf_counter(), time.thread_time()
    with torch.no_grad():
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    after = _thread_sample()
    threads = []
    for tid, a in after.items():
        b = before.get(tid, dict(run=0, wait=0, voluntary=0, involuntary=0))
        run = (a["run"] - b["run"]) / 1e6 / steps
        if tid != main and run < 0.5:
            continue
        threads.append(dict(
            name=a["name"] + (" (forward)" if tid == main else ""), cpu_ms=round(run, 2),
            runqueue_ms=round((a["wait"] - b["wait"]) / 1e6 / steps, 2),
            voluntary=round((a["voluntary"] - b["voluntary"]) / steps, 1),
            involuntary=round((a["involuntary"] - b["involuntary"]) / steps, 1),
            last_cpu=a["cpu"], siblings=_siblings(a["cpu"]),
        ))
    threads.sort(key=lambda t: -t["cpu_ms"])
    return {"wall_ms": round(wall * 1e3 / steps, 2), "forward_cpu_ms": round(cpu * 1e3 / steps, 2),
            "cpus": len(os.sched_getaffinity(0)), "threads": threads}


def timeline(model, step, steps: int) -> dict:
    """Per block of ``model`` (each child, each element of a ModuleList), over ``steps`` steps: when
    the GPU reached its start (before ddo's acquire), its weights (after the acquire's wait) and
    its end, and how far the GPU ran behind the host at its start (a slack near zero: the GPU
    waited for the host to enqueue work). Events on the current stream, host times beside them;
    the two clocks are aligned at an idle GPU."""
    blocks = []
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            blocks += [(f"{name}.{i}", m) for i, m in enumerate(child)]
        else:
            blocks.append((name, child))
    marks: list = []

    def mark(kind, name):
        def hook(*_args):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            marks.append((kind, name, time.perf_counter(), e))
        return hook

    handles = []
    for name, m in blocks:
        handles.append(m.register_forward_pre_hook(mark("start", name), prepend=True))
        handles.append(m.register_forward_pre_hook(mark("ready", name)))
        handles.append(m.register_forward_hook(mark("end", name), prepend=True))
    out = []
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            time.sleep(0.01)
            zero = torch.cuda.Event(enable_timing=True)
            zero.record()
            h0 = time.perf_counter()
            marks.clear()
            with torch.no_grad():
                step()
            torch.cuda.synchronize()
            rows: dict = {}
            for kind, name, h, e in marks:
                g = zero.elapsed_time(e)
                r = rows.setdefault(name, {})
                r[kind] = round(g, 3)
                if kind == "start":
                    r["slack"] = round(g - (h - h0) * 1e3, 3)
            out.append([dict(block=n, **r) for n, r in rows.items()])
    finally:
        for h in handles:
            h.remove()
    return {"steps": out}


def traced(step, steps: int, folder: str, name: str) -> dict:
    """Runs ``steps`` steps under torch.profiler (CUDA activity), saves the Chrome trace as
    FOLDER/trace-NAME.json.gz and returns its summary (see ``trace_summary``)."""
    import gzip

    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with torch.no_grad(), record_function("ddo_bench_step"):
                step()
            torch.cuda.synchronize()
    os.makedirs(folder, exist_ok=True)
    raw = os.path.join(folder, "trace-" + re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".json")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as f:
        trace = json.load(f)
    with gzip.open(raw + ".gz", "wt") as f:
        json.dump(trace, f)
    os.remove(raw)
    return trace_summary(trace, steps)


def trace_summary(trace: dict, steps: int) -> dict:
    """Per step: the compute stream's kernel milliseconds, its busy and idle time within the
    step's span on the GPU, host-to-device copy milliseconds and bytes, the host's milliseconds
    in the forward, the largest idle gaps with the kernels around them, and the kernels with the
    most time."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    host = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == "ddo_bench_step"]
    per_stream: dict = {}
    for k in kernels:
        per_stream.setdefault(k.get("args", {}).get("stream", k.get("tid")), []).append(k)
    if not per_stream:
        return {"error": "no kernels in the trace"}
    stream, ks = max(per_stream.items(), key=lambda kv: sum(k["dur"] for k in kv[1]))
    ks.sort(key=lambda k: k["ts"])
    busy, gaps, end = 0.0, [], None
    for a, k in enumerate(ks):
        if end is not None and k["ts"] > end:
            gaps.append((k["ts"] - end, ks[a - 1]["name"][:60], k["name"][:60]))
        s = k["ts"] if end is None else max(k["ts"], end)
        busy += max(0.0, k["ts"] + k["dur"] - s)
        end = max(end or 0.0, k["ts"] + k["dur"])
    span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
    by_name: dict = {}
    for k in ks:
        n = by_name.setdefault(k["name"][:80], [0, 0.0])
        n[0] += 1
        n[1] += k["dur"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    gaps.sort(reverse=True)
    return {
        "compute_stream": stream,
        "kernels": len(ks) / steps,
        "kernel_ms": sum(k["dur"] for k in ks) / steps / 1e3,
        "busy_ms": busy / steps / 1e3,
        "idle_ms": (span - busy) / steps / 1e3,
        "host_forward_ms": sum(e["dur"] for e in host) / steps / 1e3,
        "copy_ms": sum(c["dur"] for c in copies) / steps / 1e3,
        "copy_gb": sum(c.get("args", {}).get("bytes", 0) for c in copies) / steps / 1e9,
        "other_streams_kernel_ms": {str(s): sum(k["dur"] for k in v) / steps / 1e3 for s, v in per_stream.items() if s != stream},
        "gaps_us": [(round(g), a, b) for g, a, b in gaps[:12]],
        "top_kernels": [(n, c / steps, round(t / steps)) for n, (c, t) in top],
    }


def load_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def key(r: dict) -> tuple:
    return (r["size"], r["resolution"], r["variant"])


def floor_of(r: dict, resident_step: float, streamed: float) -> tuple[float | None, str]:
    """A row's floor in seconds (None where its disk speed or disk bytes are unknown) and what
    it counts: the link, the disk, or both."""
    base = base_of(r["variant"])
    if base == "vmm_peer" or base.endswith("~peer"):
        # Streamed over the peer link (measured at attach between two GPUs); a same-device store
        # has no link to floor it.
        peer = r.get("peer_link_bytes_per_second")
        return (max(resident_step, streamed / peer) if peer else resident_step), " (peer)"
    if base not in DISK_VARIANTS:
        return max(resident_step, streamed / r["link"]), ""
    disk, per_pass = r.get("disk_gbps"), r.get("disk_bytes_per_pass")
    if not disk or per_pass is None:
        return None, ""
    if base == "disk":
        return max(resident_step, per_pass / (disk * 1e9)), " (disk)"
    return max(resident_step, max(0, streamed - per_pass) / r["link"] + per_pass / (disk * 1e9)), " (link + disk)"


def table(rows: list[dict]) -> None:
    order = {v: i for i, v in enumerate(VARIANTS + OPTIONAL)}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["size"], r["resolution"]), []).append(r)
    print("\n| model | res | variant | streamed GiB/step | step s | x floor | first s (x step) | setup s | "
          "peak GPU GiB (arena) | peak RSS GiB (x model; above base) | output = resident |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (size, res), group in sorted(groups.items(), key=lambda kv: (kv[0][0] == "sd3", kv[0][0], kv[0][1])):
        group.sort(key=lambda r: (order.get(base_of(r["variant"]), len(order)), r["variant"]))
        resident = next((r for r in group if r["variant"] == "resident" and "step" in r), None)
        nbytes = group[0]["nbytes"]
        for r in group:
            if "error" in r:
                print(f"| {label(size)} | {res} | {r['variant']} | | failed: {r['error'][:80]} | | | | | | |")
                continue
            streamed = nbytes if base_of(r["variant"]) != "resident" and r.get("streamed") is None else (r.get("streamed") or 0)
            floor, counts = floor_of(r, resident["step"] if resident else 0.0, streamed)
            x_floor = "? (no disk speed)" if floor is None else f"{r['step'] / floor:.3f}{counts}"
            arena = f" ({r['arena'] / 2**30:.2f})" if r.get("arena") else ""
            same = "" if resident is None else ("yes" if r["digest"] == resident["digest"] else "NO")
            plain = re.sub(r"~(enc|auto)$", "", r["variant"].removesuffix("^cold"))
            raw = next((q for q in group if q["variant"] == plain and "step" in q), None)
            raw_floor = ""
            if plain != r["variant"].removesuffix("^cold") and raw is not None:
                raw_streamed = raw.get("streamed") or nbytes
                raw_floor = f"; x raw floor {r['step'] / max(resident['step'] if resident else 0.0, raw_streamed / r['link']):.3f}"
            print(f"| {label(size)} | {res} | {r['variant']} | {streamed / 2**30:.2f} | {r['step']:.4f} | {x_floor}{raw_floor} | "
                  f"{r['first']:.4f} ({r['first'] / r['step']:.2f}) | {r['setup']:.1f} | {r['peak_gpu'] / 2**30:.2f}{arena} | "
                  f"{r['rss'] / 2**30:.2f} ({r['rss'] / nbytes:.2f}; {(r['rss'] - r['rss_base']) / nbytes:.2f}) | {same} |")
        for r in group:
            parts = r.get("rss_parts_above_base")
            if parts:
                print(f"| {label(size)} | {res} | {r['variant']}: host memory after the steps, above base: "
                      f"anonymous {parts.get('RssAnon', 0) / 2**30:.2f} GiB, file pages {parts.get('RssFile', 0) / 2**30:.2f} GiB | | | | | | | | |")
        for r in group:
            if "error" not in r and r.get("alloc_retries") is not None:
                print(f"| {label(size)} | {res} | {r['variant']}: PyTorch's pool peaked at "
                      f"{r['torch_reserved_peak'] / 2**30:.2f} GiB, {r['alloc_retries']} allocation retries "
                      f"(cache freed to allocate again) | | | | | | | | |")
            if r.get("peer_store_units") is not None:
                link = r.get("peer_link_bytes_per_second")
                print(f"| {label(size)} | {res} | {r['variant']}: {r['peer_store_units']} units "
                      f"({r['peer_store_bytes'] / 2**30:.2f} GiB) in {r['peer_store_device']}'s memory"
                      + (f", peer link {link / 1e9:.1f} GB/s" if link else ", the computing GPU's own (no second GPU)")
                      + " | | | | | | | | |")
        for r in group:
            if "error" not in r and r.get("disk_bytes_per_pass") is not None:
                print(f"| {label(size)} | {res} | {r['variant']}: {disk_note(r)} | | | | | | | | |")
        for r in group:
            if r.get("cold_start_s") is not None:
                print(f"| {label(size)} | {res} | {r['variant']}: {cold_note(r)} | | | | | | | | |")
        if resident:
            disk = next((r["disk_gbps"] for r in group if r.get("disk_gbps")), None)
            disk = "" if disk is None else f"; cold disk read {disk:.2f} GB/s"
            print(f"| {label(size)} | {res} | (resident model {nbytes / 2**30:.2f} GiB; copy {group[0]['link'] / 1e9:.1f} GB/s{disk}; "
                  f"CUDA context {resident['gpu_context'] / 2**30:.2f} GiB) | | | | | | | | |")


def disk_note(r: dict) -> str:
    """What a row that reads the disk read: bytes per pass, the speed the route got beside the
    disk's, the stalls, and the retained bytes it streamed over the link instead."""
    passes = max(1, r.get("passes") or 1)
    text = f"disk {r['disk_bytes_per_pass'] / 2**30:.2f} GiB per pass"
    if r.get("disk_bytes_per_second"):
        text += f", read at {r['disk_bytes_per_second'] / 1e9:.2f} GB/s"
    if r.get("disk_gbps"):
        text += f" (the disk's cold O_DIRECT read: {r['disk_gbps']:.2f} GB/s)"
    if r.get("read_stall_seconds") is not None:
        text += f", uploads stalled {r['read_stall_seconds'] / passes:.3f} s per pass"
    if r.get("retained_bytes"):
        text += f"; {r['retained_bytes'] / 2**30:.2f} GiB retained"
        if r.get("streamed") is not None:
            text += f", {max(0, r['streamed'] - r['disk_bytes_per_pass']) / 2**30:.2f} GiB of it streamed per pass"
    return text


def cold_note(r: dict) -> str:
    """A cold start beside the time the disk takes to read the checkpoint's files."""
    text = f"cold start {r['cold_start_s']:.1f} s from loading to the end of the first step"
    if r.get("disk_gbps"):
        read = r["nbytes_on_disk"] / (r["disk_gbps"] * 1e9)
        text += f", {r['cold_start_s'] / read:.2f}x reading its {r['nbytes_on_disk'] / 2**30:.2f} GiB of files ({read:.1f} s)"
    else:
        text += f" ({r['nbytes_on_disk'] / 2**30:.2f} GiB of files)"
    cached = r.get("cached_after_evict")
    text += f"; evicted by {r.get('evicted_by')}" + ("" if cached is None else f", {cached:.1%} cached after")
    st = r.get("stages")
    if st:
        text += "; stages: " + ", ".join(
            f"{k} {st[k]:.2f} s" for k in (
                "validate", "load", "attach", "source_seconds", "read_in_seconds", "registration_seconds",
                "resident_upload_seconds",
            ) if st.get(k) is not None
        ) + f", {st.get('read_ahead_bytes', 0) / 2**30:.2f} GiB read ahead while the module was built"
    return text


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
    variants = a.variants.split(",")
    unknown = [v for v in variants if base_of(v) not in VARIANTS + OPTIONAL and not VMM_VARIANT.match(base_of(v))]
    if unknown:
        raise SystemExit(
            f"unknown variants {unknown}; known: {', '.join(VARIANTS + OPTIONAL)}, vmm@GIB, vmm@auto, vmm+dDEPTH, "
            "vmm%CARD_GIB, vmm~enc, vmm~auto, vmm~peer, vmm~retained (combinable: vmm@6+d5%16~enc), each optionally +copy then ^cold"
        )
    explicit = a.variants != ap.get_default("variants")
    link = link_speed()
    print(f"pinned host->device copy: {link / 1e9:.1f} GB/s", flush=True)
    # The disk's cold read speed, measured once on the first model's largest file when a variant
    # reads the disk or starts cold.
    needs_disk = any(base_of(v) in DISK_VARIANTS or v.endswith("^cold") for v in variants)
    disk = None
    # Evicting drops every model's pages (drop_caches): the files read back into the page cache
    # since then, so a variant that is not cold finds its checkpoint cached as before.
    evicted, warmed = False, set()
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
        if needs_disk and disk is None:
            largest = max(checkpoint_files(path), key=os.path.getsize)
            try:
                disk = disk_read_speed(largest) / 1e9
                print(f"disk cold read (O_DIRECT, 8 threads, 16 MiB requests in file order, {os.path.getsize(largest) / 2**30:.2f} GiB "
                      f"{os.path.basename(largest)}): {disk:.2f} GB/s", flush=True)
            except (OSError, RuntimeError) as e:
                print(f"disk cold read failed ({e}): disk floors are not computed", flush=True)
                needs_disk = False
            evicted, warmed = True, set()
        for variant in variants:
            if size != "5" and "@" in variant and not explicit:
                continue  # the default budget sweep runs on the 5 B model
            base = base_of(variant)
            if base not in ONLY.get(size, {base}) and not (size in ONLY and VMM_VARIANT.match(base)):
                continue
            if variant.endswith("^cold"):
                evicted, warmed = True, set()
            elif evicted and path not in warmed and base not in DISK_VARIANTS:
                # (the disk variants read with O_DIRECT, past the page cache)
                print(f"read {label(size)} back into the page cache after evicting it: "
                      f"{warm_files(checkpoint_files(path)):.0f} s", flush=True)
                warmed.add(path)
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
            if disk is not None:
                new = [dict(r, disk_gbps=disk) for r in new]
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
                    if r.get("host_threads"):
                        h = r["host_threads"]
                        print(f"  host per step: wall {h['wall_ms']} ms, forward thread CPU {h['forward_cpu_ms']} ms "
                              f"({h['cpus']} CPUs); threads: " + "; ".join(
                                  f"{t['name']} cpu {t['cpu_ms']} runq {t['runqueue_ms']} sw {t['voluntary']}/{t['involuntary']} "
                                  f"on {t['last_cpu']} [{t['siblings']}]" for t in h["threads"]), flush=True)
                    if r.get("trace"):
                        t = r["trace"]
                        print("  trace per step: " + ", ".join(
                            f"{k} {t[k]:.2f}" for k in ("kernels", "kernel_ms", "busy_ms", "idle_ms", "host_forward_ms", "copy_ms", "copy_gb")
                            if isinstance(t.get(k), (int, float))
                        ), flush=True)
                    if r.get("enqueue_ms_copying"):
                        print(f"  beside the copies: ms per step, enqueued / finished: {r['enqueue_ms_copying']}; "
                              f"host work ms alone / copying: {r['host_work_ms']}", flush=True)
                    if r.get("background_copy_gbps"):
                        print(f"  background copies beside the steps: {r['background_copy_gbps']:.1f} GB/s", flush=True)
                for r in new:
                    if r.get("disk_bytes_per_pass") is not None:
                        print(f"  at {r['resolution']}: {disk_note(r)}", flush=True)
                    if r.get("cold_start_s") is not None:
                        print(f"  at {r['resolution']}: {cold_note(r)}", flush=True)
            kept = [r for r in load_rows(rows_path) if key(r) not in {key(n) for n in new}]
            with open(rows_path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept + new)
    table(load_rows(rows_path))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
