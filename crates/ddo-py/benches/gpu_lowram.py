"""Low host memory, proved on one GPU: the Wan-2.1-14B shape with all 40 blocks saved in bf16
(26.6 GiB) at 640x640, run by ddo's vmm route (3 GiB weight budget, no host-tier setting: no
source cache, no preset) in a process whose host memory is held under a ceiling, against a
resident run outside it. The ceiling is a cgroup v2 ``memory.max`` (swap 0) the child joins
before it imports torch; where no cgroup can be made, a holder process takes anonymous memory
until about the ceiling is left in MemAvailable. ddo chooses its host tier itself from what host
memory admits. The summary gives the tier and why, the step against the disk's floor (disk bytes
per pass / the disk's cold O_DIRECT read speed), the host peak against the ceiling, OOM kills and
whether the output equals the resident run's bit for bit; it is written to $OUT/lowram.json when
OUT is set. Exits non-zero on a mismatch, an OOM kill or a failed child.

    python gpu_lowram.py [--dir DIR] [--ceiling-gb 8] [--steps 3] [--timeout 500]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

GIB = 2**30
RESOLUTION = 640
LAYERS = 40
FOLDER = f"wan-{LAYERS}-bf16"
CGROUP_ROOT = "/sys/fs/cgroup"
# Seconds kept back from --timeout for stopping a child and cleaning up.
RESERVE_S = 15


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def vmstat_oom_kills() -> int | None:
    """OOM kills since boot (/proc/vmstat), for the holder's method."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
    except OSError:
        pass
    return None


def own_cgroup() -> str:
    with open("/proc/self/cgroup") as f:
        return next((line.strip().split("::", 1)[1] for line in f if line.startswith("0::")), "?")


def result(data: dict) -> None:
    print("RESULT " + json.dumps(data), flush=True)


# --- the children --------------------------------------------------------------------------


def model_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def child_build(a: argparse.Namespace) -> int:
    """The bf16 model under DIR, made room for: a partial build of it, then other model folders
    (largest first), are deleted while the disk cannot hold it."""
    import torch
    from diffusers import WanTransformer3DModel

    from flux_workload import WAN_14B, saved_wan

    target = os.path.join(a.dir, FOLDER)
    if not os.path.exists(os.path.join(target, "ddo-built.json")):
        if os.path.isdir(target):
            print(f"deleting {target}: a build that did not finish", flush=True)
            shutil.rmtree(target)
        with torch.device("meta"):
            params = sum(p.numel() for p in WanTransformer3DModel(**WAN_14B).parameters())
        need = params * 2 + 2 * GIB
        others = []
        for name in os.listdir(a.dir):
            folder = os.path.join(a.dir, name)
            if name == FOLDER or not os.path.isdir(folder):
                continue
            files = os.listdir(folder)
            if "ddo-built.json" in files or any(f.endswith((".safetensors", ".gguf")) for f in files):
                others.append((model_bytes(folder), folder))
        for size, folder in sorted(others, reverse=True):
            if shutil.disk_usage(a.dir).free >= need:
                break
            print(f"deleting {folder} ({size / GIB:.1f} GiB) to make room for the {params * 2 / GIB:.1f} GiB model", flush=True)
            shutil.rmtree(folder)
        free = shutil.disk_usage(a.dir).free
        if free < need:
            print(f"warning: {free / GIB:.1f} GiB free under {a.dir}, the build needs about {need / GIB:.1f}", flush=True)
    path, nbytes = saved_wan(a.dir, LAYERS, save_dtype=torch.bfloat16)
    result(dict(path=path, nbytes=nbytes))
    return 0


def steps_of(model, dev, steps: int) -> tuple[list[float], str]:
    """Step seconds on the fixed inputs and the last output's digest (as bench_gpu computes it)."""
    import hashlib

    import torch

    from flux_workload import timed, wan_inputs

    x = wan_inputs(RESOLUTION, dev, torch.Generator().manual_seed(1))
    times, out = timed(lambda: model(**x)[0], steps)
    digest = hashlib.sha256(out.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:12]
    return times, digest


def child_run(a: argparse.Namespace) -> int:
    """``resident``: Diffusers' model on the GPU; ``ddo``: the vmm route with no host-tier
    setting. Both after a one-block warm-up of CUDA's kernels."""
    cgroup = own_cgroup()  # before torch: the ddo child joined its cgroup before it started
    import torch

    from bench_gpu import peak_rss, rss_now, rss_parts, warm_up

    dev = torch.device("cuda:0")
    warm_up(dev, [RESOLUTION], "wan")
    rss_base, parts_base = rss_now(), rss_parts()
    t = time.perf_counter()
    native = None
    if a.child == "resident":
        from diffusers import WanTransformer3DModel

        model = WanTransformer3DModel.from_pretrained(a.path, torch_dtype=torch.bfloat16).to(dev).eval()
    else:
        import ddo

        loaded = ddo.from_pretrained_with_dynamic_offload(
            a.path, torch_dtype=torch.bfloat16, apply_dynamic=True, component="transformer",
            dynamic_offload_config=ddo.DynamicOffloadConfig(backend="vmm", vmm_resident_weight_budget_gb=3),
        )
        native, model = loaded.offload, loaded.module
    torch.cuda.synchronize()
    setup = time.perf_counter() - t
    times, digest = steps_of(model, dev, a.steps)
    out = dict(
        cgroup=cgroup, setup_s=setup, times=times, step=statistics.median(times[1:] or times), digest=digest,
        rss_peak=peak_rss(), rss_base=rss_base,
        rss_parts_above_base={k: v - parts_base.get(k, 0) for k, v in rss_parts().items()},
    )
    if native is not None:
        snapshot = native.metrics_snapshot()
        d = snapshot.as_dict()
        setup_d, runtime = d.get("setup", {}), d.get("runtime", {})
        for k in ("host_source", "host_tier_reason", "retained_bytes", "unretained_bytes", "staging_bytes",
                  "staging_read", "streamed_bytes_per_pass", "registered_bytes"):
            out[k] = setup_d.get(k)
        for k in ("disk_bytes_per_pass", "disk_bytes_per_second", "read_stall_seconds", "passes"):
            out[k] = runtime.get(k)
        out["profile"] = snapshot.format_profile()
    result(out)
    return 0


def hold(gib: float) -> int:
    """Takes anonymous memory (populated, locked where the host allows) until about ``gib`` GiB
    is left in MemAvailable, says so on stdout, and keeps it until stdin closes."""
    import ctypes

    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")  # the process under test, not the holder, is the one to kill
    except OSError:
        pass
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page, target, chunks, locked = os.sysconf("SC_PAGE_SIZE"), int(gib * GIB), [], True
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    for _ in range(100_000):
        over = mem_available() - target
        if over < 16 << 20:
            break
        n = max(page, min(256 << 20, over // 2) // page * page)
        try:
            m = mmap.mmap(-1, n, flags=flags)
        except OSError:
            break
        view = ctypes.c_char.from_buffer(m)
        ok = libc.mlock(ctypes.addressof(view), n) == 0
        del view
        if not ok:
            locked = False
            for off in range(0, n, page):  # touched, in case populating did not
                m[off] = 1
        chunks.append(m)
    print(f"HELD {sum(len(m) for m in chunks)} {mem_available()} {'locked' if locked else 'touched'}", flush=True)
    sys.stdin.read()
    return 0


# --- the parent ----------------------------------------------------------------------------


class Child:
    """A child process in its own session, its output passed through with a prefix and its
    RESULT line kept; stopped (TERM, then KILL) on timeout."""

    def __init__(self, cmd: list[str], tag: str, **kw) -> None:
        self.tag, self.result, self.tail = tag, None, []
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True, **kw)
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self) -> None:
        for line in self.p.stdout:
            if line.startswith("RESULT "):
                self.result = json.loads(line[7:])
                continue
            self.tail = (self.tail + [line.rstrip()])[-20:]
            print(f"  [{self.tag}] {line.rstrip()}", flush=True)

    def wait(self, timeout: float) -> int:
        try:
            rc = self.p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            print(f"{self.tag}: timed out after {timeout:.0f} s; stopping it", flush=True)
            rc = 124
        finally:
            # On a timeout, and when the parent itself is stopped (TERM, Ctrl-C).
            if self.p.poll() is None:
                self.stop()
        self.reader.join(timeout=5)
        return rc

    def stop(self) -> None:
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.p.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                continue


def run_child(mode: str, a: argparse.Namespace, deadline: float, path: str | None = None) -> tuple[dict | None, str | None]:
    """Runs a child outside any ceiling; returns its result or why it failed."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--dir", a.dir, "--steps", str(a.steps)]
    if path:
        cmd += ["--path", path]
    c = Child(cmd, mode)
    rc = c.wait(deadline - time.monotonic() - RESERVE_S)
    if rc != 0 or c.result is None:
        return None, f"exit {rc}: {(c.tail or ['?'])[-1]}"
    return c.result, None


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def make_cgroup(limit: int) -> tuple[str | None, str]:
    """A cgroup v2 under the root with ``memory.max`` = ``limit`` and no swap, or None and why
    not."""
    controllers = read(os.path.join(CGROUP_ROOT, "cgroup.controllers"))
    if controllers is None:
        return None, f"no cgroup v2 hierarchy at {CGROUP_ROOT}"
    if "memory" not in controllers.split():
        return None, "the cgroup v2 hierarchy has no memory controller"
    path = os.path.join(CGROUP_ROOT, f"ddo-lowram-{os.getpid()}")
    try:
        if "memory" not in (read(os.path.join(CGROUP_ROOT, "cgroup.subtree_control")) or "").split():
            write(os.path.join(CGROUP_ROOT, "cgroup.subtree_control"), "+memory")
        os.mkdir(path)
    except OSError as e:
        return None, f"cannot make {path}: {e}"
    try:
        write(os.path.join(path, "memory.max"), str(limit))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
            write(os.path.join(path, "memory.swap.max"), "0")
    except OSError as e:
        remove_cgroup(path)
        return None, f"cannot set {path}'s limits: {e}"
    return path, "cgroup"


def remove_cgroup(path: str) -> None:
    if os.path.exists(os.path.join(path, "cgroup.kill")):
        try:
            write(os.path.join(path, "cgroup.kill"), "1")
        except OSError:
            pass
    for _ in range(100):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    print(f"warning: could not remove {path}", flush=True)


def cgroup_events(path: str) -> dict:
    text = read(os.path.join(path, "memory.events")) or ""
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if line.strip())}


class MemSampler:
    """The lowest MemAvailable while active, every 50 ms."""

    def __init__(self) -> None:
        self.low, self.stop = mem_available(), threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.low = min(self.low, mem_available())


def run_limited(a: argparse.Namespace, path: str, deadline: float) -> dict:
    """The ddo child under the ceiling: in a cgroup when one can be made, else beside a holder."""
    limit = int(a.ceiling_gb * GIB)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "ddo", "--path", path, "--steps", str(a.steps)]
    out: dict = dict(ceiling_bytes=limit)
    cgroup, why = (None, "--no-cgroup") if a.no_cgroup else make_cgroup(limit)
    holder = None
    oom_before = vmstat_oom_kills()
    try:
        if cgroup is not None:
            out["method"] = f"cgroup v2 memory.max ({cgroup}, swap 0)"
            # The shell joins the cgroup, then becomes the child: nothing runs outside it.
            procs = os.path.join(cgroup, "cgroup.procs")
            cmd = ["sh", "-c", 'echo $$ > "$0" || { echo "cannot join $0" >&2; exit 97; }; exec "$@"', procs] + cmd
        else:
            print(f"no cgroup ({why}): a holder process leaves about {a.ceiling_gb:g} GiB of MemAvailable instead", flush=True)
            holder = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--hold", str(a.ceiling_gb)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
            line = holder.stdout.readline().split()
            if not line or line[0] != "HELD":
                out["error"] = "the holder process failed"
                return out
            out["method"] = (f"holder process ({why}): {int(line[1]) / GIB:.1f} GiB of anonymous memory {line[3]}, "
                             f"MemAvailable {int(line[2]) / GIB:.2f} GiB at the start")
            out["held_bytes"], out["mem_available_at_start"] = int(line[1]), int(line[2])
        print(f"ddo under {a.ceiling_gb:g} GiB: {out['method']}", flush=True)
        sampler = MemSampler()
        c = Child(cmd, "ddo")
        rc = c.wait(deadline - time.monotonic() - RESERVE_S)
        sampler.stop.set()
        out["lowest_mem_available"] = sampler.low
        out["rc"], out["run"] = rc, c.result
        if rc != 0 or c.result is None:
            out["error"] = f"exit {rc}: {(c.tail or ['?'])[-1]}"
        if cgroup is not None:
            peak = read(os.path.join(cgroup, "memory.peak"))
            out["cgroup_memory_peak"] = int(peak) if peak and peak.strip().isdigit() else None
            out["cgroup_events"] = cgroup_events(cgroup)
            out["oom_kills"] = out["cgroup_events"].get("oom_kill")
        else:
            after = vmstat_oom_kills()
            out["oom_kills"] = None if after is None or oom_before is None else after - oom_before
            out["holder_alive"] = holder.poll() is None
            if not out["holder_alive"]:
                out["error"] = "the holder process died during the run: the ceiling did not hold"
        return out
    finally:
        if holder is not None:
            holder.stdin.close()
            try:
                holder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(holder.pid, signal.SIGKILL)
                holder.wait()
        if cgroup is not None:
            remove_cgroup(cgroup)


def summarize(s: dict) -> list[str]:
    run, limited, resident = s.get("ddo") or {}, s.get("limited") or {}, s.get("resident") or {}
    lines = [f"lowram: Wan-14B-shaped, {LAYERS} blocks, bf16 ({s.get('nbytes', 0) / GIB:.2f} GiB) at {RESOLUTION}x{RESOLUTION}, "
             f"host memory held under {s['ceiling_gb']:g} GiB by {limited.get('method', '?')}"]
    lines.append(f"  host tier: {run.get('host_source')} ({run.get('host_tier_reason') or 'no reason reported'})")
    if run.get("retained_bytes") is not None:
        lines.append(f"  retained {run['retained_bytes'] / GIB:.2f} GiB, unretained {(run.get('unretained_bytes') or 0) / GIB:.2f} GiB")
    if run.get("times"):
        step = f"  step {run['step']:.3f} s (steps {', '.join(f'{t:.3f}' for t in run['times'])}; set-up {run['setup_s']:.1f} s)"
        if resident.get("step"):
            step += f"; resident {resident['step']:.4f} s"
        lines.append(step)
    per_pass, disk = run.get("disk_bytes_per_pass"), s.get("disk_gbps")
    if per_pass and disk and run.get("step"):
        floor = per_pass / (disk * 1e9)
        got = f", the route read at {run['disk_bytes_per_second'] / 1e9:.2f} GB/s" if run.get("disk_bytes_per_second") else ""
        lines.append(f"  disk floor {floor:.3f} s = {per_pass / GIB:.2f} GiB per pass / {disk:.2f} GB/s (cold O_DIRECT){got}: "
                     f"{run['step'] / floor:.3f}x the disk floor")
    elif run:
        lines.append(f"  disk: {per_pass or 0} bytes per pass (cold O_DIRECT read {disk or 0:.2f} GB/s)")
    peak, host = limited.get("cgroup_memory_peak"), []
    if peak:
        host.append(f"{peak / GIB:.2f} GiB (cgroup memory.peak, page cache included)")
    if run.get("rss_peak"):
        host.append(f"VmHWM {run['rss_peak'] / GIB:.2f} GiB")
    if limited.get("lowest_mem_available") is not None:
        host.append(f"lowest MemAvailable {limited['lowest_mem_available'] / GIB:.2f} GiB")
    host.append(f"ceiling {s['ceiling_gb']:g} GiB")
    lines.append("  host peak: " + "; ".join(host))
    lines.append(f"  OOM kills: {limited.get('oom_kills')}" + (f" (memory.events {limited['cgroup_events']})" if limited.get("cgroup_events") else ""))
    lines.append(f"  output equals resident: {s.get('digest_equal')} (ddo {run.get('digest')}, resident {resident.get('digest')})")
    for e in s.get("errors", []):
        lines.append(f"  FAILED: {e}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ddo-bench"))
    ap.add_argument("--ceiling-gb", type=float, default=8.0, help="host memory the ddo run may use, GiB")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=500, help="seconds for the whole command")
    ap.add_argument("--no-cgroup", action="store_true", help="hold memory with a holder process instead of a cgroup")
    ap.add_argument("--child", choices=["build", "resident", "ddo"])
    ap.add_argument("--hold", type=float)
    ap.add_argument("--path")
    a = ap.parse_args()
    if a.hold is not None:
        return hold(a.hold)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if a.child == "build":
        return child_build(a)
    if a.child:
        return child_run(a)
    deadline = time.monotonic() + a.timeout
    # A TERM (the machine's own limit) still stops the children and removes the cgroup.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.makedirs(a.dir, exist_ok=True)
    s: dict = dict(ceiling_gb=a.ceiling_gb, resolution=RESOLUTION, steps=a.steps, errors=[])
    built, err = run_child("build", a, deadline)
    if err:
        s["errors"].append(f"build: {err} (a later call reuses what is saved)")
    else:
        path, s["nbytes"] = built["path"], built["nbytes"]
        s["resident"], err = run_child("resident", a, deadline, path)
        if err:
            s["errors"].append(f"resident: {err}")
        from flux_workload import cached_fraction, checkpoint_files, disk_read_speed, evict_from_cache

        files = checkpoint_files(path)
        s["nbytes_on_disk"] = sum(os.path.getsize(f) for f in files)
        largest = max(files, key=os.path.getsize)
        try:
            s["disk_gbps"] = disk_read_speed(largest) / 1e9
            print(f"disk cold read (O_DIRECT, 8 threads, 16 MiB requests in file order, {os.path.getsize(largest) / GIB:.2f} GiB "
                  f"{os.path.basename(largest)}): {s['disk_gbps']:.2f} GB/s", flush=True)
        except (OSError, RuntimeError) as e:
            print(f"disk cold read failed: {e}", flush=True)
        # The ddo run starts with none of the checkpoint cached (cached pages charged elsewhere
        # would be memory it did not pay for).
        s["evicted_by"], s["cached_after_evict"] = evict_from_cache(files), cached_fraction(files)
        if deadline - time.monotonic() < RESERVE_S + 60:
            s["errors"].append("ddo: no time left for the run under the ceiling (run the command again: the model is kept)")
        else:
            s["limited"] = run_limited(a, path, deadline)
            s["ddo"] = s["limited"].pop("run", None)
            if s["limited"].get("error"):
                s["errors"].append(f"ddo: {s['limited']['error']}")
        if s.get("ddo") and s.get("resident"):
            s["digest_equal"] = s["ddo"]["digest"] == s["resident"]["digest"]
            if not s["digest_equal"]:
                s["errors"].append("the ddo output differs from the resident output")
        if (s.get("limited") or {}).get("oom_kills"):
            s["errors"].append(f"{s['limited']['oom_kills']} OOM kill(s) under the ceiling")
    if (s.get("ddo") or {}).get("profile"):
        print(s["ddo"]["profile"].rstrip(), flush=True)
    print("\n".join(summarize(s)), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "lowram.json"), "w") as f:
            json.dump(s, f, indent=1)
    return 1 if s["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
