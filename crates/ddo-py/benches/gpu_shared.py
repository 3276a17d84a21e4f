"""One host copy of a checkpoint feeding several GPUs, sessions or processes. A Flux-style 5 B model
(bf16, 9.4 GiB) at 1024x1024 through ddo's vmm route (3 GiB weight budget each), measured three
ways after a resident run that gives the reference output:

1. ``one``: one process, one session on cuda:0.
2. ``two sessions``: one process, two sessions of the same checkpoint, session k on
   cuda:(k mod GPUs): on one GPU both share it, on two each has its own. The second maps the
   files the first mapped and joins its page-locked registration.
3. ``two processes``: two processes at once, process k on cuda:(k mod GPUs): each maps the files,
   the page cache holds them once.

Per run: the process's host memory above its base, split into anonymous memory and file pages
(RssFile, the mapping's pages), for the two processes the drop of the host's free memory while
they run beside their own anonymous memory (the files were cached by the runs before: a second
copy of the weights would show as more), each session's registration seconds and registered GiB, the step of each
session, and whether every output equals the resident run's bit for bit. Written to
$OUT/shared.json when OUT is set; exits non-zero on a mismatch or a failed child.

    python gpu_shared.py [--dir DIR] [--steps 4] [--timeout 400]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

GIB = 2**30
RESOLUTION = 1024


def meminfo(name: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {name} in /proc/meminfo")


def rss_parts() -> dict:
    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssFile"):
                parts[name] = int(value.split()[0]) * 1024
    return parts


def digest(t) -> str:
    import torch

    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:12]


def child(a: argparse.Namespace) -> int:
    import torch

    import ddo
    from diffusers import FluxTransformer2DModel
    from flux_workload import flux_inputs, timed

    gpus = torch.cuda.device_count()
    devices = [torch.device(f"cuda:{(a.first + k) % gpus}") for k in range(a.sessions)]
    for d in devices:
        torch.empty(1, device=d)  # contexts first: the base holds them
    base = rss_parts()
    models, stages = [], []
    for d in devices:
        if a.resident:
            models.append(FluxTransformer2DModel.from_pretrained(a.path, torch_dtype=torch.bfloat16).to(d).eval())
            continue
        config = ddo.DynamicOffloadConfig(backend="vmm", vmm_resident_weight_budget_gb=3.0, execution_device=str(d))
        r = ddo.from_pretrained_with_dynamic_offload(
            a.path, torch_dtype=torch.bfloat16, apply_dynamic=True, component="transformer", dynamic_offload_config=config,
        )
        setup = r.offload.metrics_snapshot().as_dict()["setup"]
        stages.append({
            "device": str(d),
            "registration_seconds": setup.get("registration_seconds"),
            "registered_gib": round(setup.get("registered_bytes", 0) / GIB, 2),
            "attach_seconds": r.stage_seconds.get("attach"),
        })
        models.append(r.module)
    if a.barrier:
        # Both processes loaded: start stepping together.
        open(a.barrier + f".{a.first}", "w").close()
        while not all(os.path.exists(a.barrier + f".{k}") for k in range(a.peers)):
            time.sleep(0.01)
    steps, digests = [], []
    for m, d in zip(models, devices):
        with torch.cuda.device(d):
            x = flux_inputs(RESOLUTION, d, torch.Generator().manual_seed(1))
            times, out = timed(lambda: m(**x)[0], a.steps)
        steps.append(round(statistics.median(times[1:]), 4))
        digests.append(digest(out))
    now = rss_parts()
    print("RESULT " + json.dumps({
        "devices": [str(d) for d in devices], "steps": steps, "digests": digests, "sessions": stages,
        "rss_above_base_gib": {k: round((now[k] - base.get(k, 0)) / GIB, 2) for k in now},
    }), flush=True)
    return 0


def run(cmd: list[str], timeout: float) -> dict:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    got = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if p.returncode != 0 or not got:
        err = (p.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": err}
    return got[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ddo-bench"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--path")
    ap.add_argument("--sessions", type=int, default=1)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--resident", action="store_true")
    ap.add_argument("--barrier")
    ap.add_argument("--peers", type=int, default=1)
    a = ap.parse_args()
    if a.child:
        return child(a)
    import torch

    from flux_workload import saved_flux

    started = time.perf_counter()
    path, nbytes = saved_flux(a.dir, 8, 16)
    gpus = torch.cuda.device_count()
    me = [sys.executable, __file__, "--child", "--path", path, "--steps", str(a.steps)]
    left = lambda: max(30.0, a.timeout - (time.perf_counter() - started))  # noqa: E731
    summary: dict = {"model_gib": round(nbytes / GIB, 2), "gpus": gpus}
    summary["resident"] = run(me + ["--resident"], left())
    summary["one"] = run(me, left())
    summary["two_sessions"] = run(me + ["--sessions", "2"], left())
    free_before = meminfo("MemFree")
    barrier = os.path.join(a.dir, f"shared-barrier-{os.getpid()}")
    procs = [
        subprocess.Popen(me + ["--first", str(k), "--barrier", barrier, "--peers", "2"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for k in range(2)
    ]
    least_free = free_before
    while any(p.poll() is None for p in procs) and time.perf_counter() - started < a.timeout:
        least_free = min(least_free, meminfo("MemFree"))
        time.sleep(0.05)
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        got = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
        results.append(got[0] if p.returncode == 0 and got else {"error": (err.strip().splitlines() or ["?"])[-1]})
    for k in range(2):
        try:
            os.remove(barrier + f".{k}")
        except OSError:
            pass
    # The files were cached by the runs before: a second copy of the weights would take free
    # memory beside the two processes' own anonymous memory.
    anon = sum(r.get("rss_above_base_gib", {}).get("RssAnon", 0) for r in results)
    summary["two_processes"] = {
        "processes": results, "free_memory_drop_gib": round((free_before - least_free) / GIB, 2),
        "anonymous_above_base_gib": round(anon, 2),
    }
    reference = summary["resident"].get("digests", [None])[0]
    outputs = [d for r in (summary["one"], summary["two_sessions"], *results) for d in r.get("digests", [])]
    failed = any("error" in r for r in (summary["resident"], summary["one"], summary["two_sessions"], *results))
    summary["outputs_equal_resident"] = bool(outputs) and reference is not None and all(d == reference for d in outputs)
    print(json.dumps(summary, indent=1), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "shared.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if failed or not summary["outputs_equal_resident"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
