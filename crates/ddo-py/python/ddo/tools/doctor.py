"""``python -m ddo doctor``: measures what ddo depends on here (the host-to-GPU link, free GPU
memory, host memory and its limits, disk reads) and, given a checkpoint, recommends a route, a
GPU weight budget and where host bytes come from, one line of reasons each."""

from __future__ import annotations

import json
import math
import mmap
import os
import resource
import statistics
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

from .. import _native

__all__ = ["diagnose", "format_report"]

GIB = 1 << 30
# Host-to-device copies: one 256 MiB tensor, timed with CUDA events after a warm-up copy.
LINK_BYTES = 256 << 20
LINK_REPEATS = 5
# GPU memory kept outside the weight budget for activations and the CUDA context.
GPU_HEADROOM_GB = 2.0
# Disk reads: a checkpoint is read up to this many bytes per method; a temp file has this size.
DISK_READ_BYTES = 1 << 30
DISK_SAMPLE_BYTES = 256 << 20
CHUNK = 8 << 20
# CapEff bit of CAP_IPC_LOCK (locking memory beyond RLIMIT_MEMLOCK).
CAP_IPC_LOCK = 14


def _gib(n: float) -> str:
    """Bytes in the unit that shows them: GiB from 1 GiB, MiB below."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.2f} MiB"


def _floor_gib(n: float) -> float:
    """``n`` bytes as GiB rounded down: whole GiB from 4 up, quarters below (whole 64 MiB
    segments either way)."""
    g = n / GIB
    return float(math.floor(g)) if g >= 4 else math.floor(g * 4) / 4


def _setting(value: float) -> str:
    return f"{value:g}"


# ---- measurements ----------------------------------------------------------------------------


def measure_gpu(device: str) -> Dict[str, Any]:
    """Free and total memory of ``device`` and its link speed: pinned and pageable host-to-device
    copies of :data:`LINK_BYTES`, each timed with CUDA events (median and best of
    :data:`LINK_REPEATS`). ``{"note": ...}`` when there is no such CUDA device."""
    import torch

    if not device.startswith("cuda"):
        return {"note": f"device {device} is not a CUDA device: nothing to measure on a GPU"}
    if not torch.cuda.is_available():
        return {"note": "no CUDA device: PyTorch sees none"}
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        return {"note": f"no CUDA device {device}: PyTorch sees {torch.cuda.device_count()}"}
    dev = torch.device("cuda", index)
    free, total = torch.cuda.mem_get_info(dev)
    out: Dict[str, Any] = {"device": str(dev), "name": torch.cuda.get_device_name(dev), "free_bytes": free, "total_bytes": total}
    target = torch.empty(LINK_BYTES, dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream(dev)
    for kind in ("pinned", "pageable"):
        host = torch.ones(LINK_BYTES, dtype=torch.uint8, pin_memory=kind == "pinned")
        seconds: List[float] = []
        for _ in range(LINK_REPEATS + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            target.copy_(host, non_blocking=True)
            end.record(stream)
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        seconds = seconds[1:]  # the first copy warms the path up
        out[f"{kind}_gbps"] = LINK_BYTES / statistics.median(seconds) / 1e9
        out[f"{kind}_best_gbps"] = LINK_BYTES / min(seconds) / 1e9
        del host
    out["copy_bytes"], out["repeats"] = LINK_BYTES, LINK_REPEATS
    return out


def _status_field(name: str) -> Optional[str]:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == name:
                    return value.strip()
    except OSError:
        return None
    return None


def _cgroup_v1_memory() -> Optional[Dict[str, Any]]:
    """The cgroup v1 memory controller's limit and usage of this process, when it has one (ddo's
    admission reads cgroup v2 only, so a v1 limit is reported for the reader)."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" not in controllers.split(","):
            continue
        base = os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
        try:
            with open(os.path.join(base, "memory.limit_in_bytes"), encoding="ascii") as f:
                limit = int(f.read())
            with open(os.path.join(base, "memory.usage_in_bytes"), encoding="ascii") as f:
                usage = int(f.read())
        except (OSError, ValueError):
            return None
        # The kernel writes "no limit" as a page-rounded maximum.
        return {"path": path, "limit_bytes": limit if limit < 1 << 60 else None, "usage_bytes": usage}
    return None


def observe_host() -> Dict[str, Any]:
    """The native observation (``ddo._native.observe_host_memory()``: RSS, MemAvailable, commit
    accounting, overcommit mode, cgroup v2 levels, RLIMIT_AS and RLIMIT_MEMLOCK) with what it
    does not carry: RLIMIT_MEMLOCK's hard limit, CAP_IPC_LOCK, VmSize, a cgroup v1 memory limit
    and WSL."""
    out = json.loads(_native.observe_host_memory())
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    out["rlimit_memlock_hard_bytes"] = None if hard == resource.RLIM_INFINITY else hard
    caps = _status_field("CapEff")
    out["cap_ipc_lock"] = bool(int(caps, 16) >> CAP_IPC_LOCK & 1) if caps else None
    size = _status_field("VmSize")
    out["vm_size_bytes"] = int(size.split()[0]) * 1024 if size else None
    out["cgroup_v1"] = _cgroup_v1_memory()
    out["wsl"] = _native.running_on_wsl()
    return out


def usable_host_bytes(host: Dict[str, Any], headroom_gb: float) -> Tuple[int, str]:
    """Host bytes ddo could grow into: the tightest of MemAvailable, each cgroup level's room
    (limit minus current), CommitLimit - Committed_AS in strict overcommit, RLIMIT_AS - VmSize and a
    cgroup v1 limit, minus ``headroom_gb``; with the bound that decided it."""
    bounds: List[Tuple[int, str]] = []
    if host.get("mem_available_bytes") is not None:
        bounds.append((host["mem_available_bytes"], f"MemAvailable {_gib(host['mem_available_bytes'])}"))
    for level in host.get("cgroups", []):
        limits = [v for v in (level.get("max"), level.get("high")) if v is not None]
        if limits:
            held = level["current"] - level.get("reclaimable", 0)
            room = max(min(limits) - held, 0)
            bounds.append((room, f"cgroup {level['path']} room {_gib(room)}"))
    if host.get("overcommit_mode") == "strict" and host.get("commit_limit_bytes") is not None:
        room = max(host["commit_limit_bytes"] - host.get("committed_bytes", 0), 0)
        bounds.append((room, f"CommitLimit - Committed_AS {_gib(room)} (strict overcommit)"))
    if host.get("rlimit_as_bytes") is not None and host.get("vm_size_bytes") is not None:
        room = max(host["rlimit_as_bytes"] - host["vm_size_bytes"], 0)
        bounds.append((room, f"RLIMIT_AS - VmSize {_gib(room)}"))
    v1 = host.get("cgroup_v1")
    if v1 and v1.get("limit_bytes") is not None:
        room = max(v1["limit_bytes"] - v1["usage_bytes"], 0)
        bounds.append((room, f"cgroup v1 {v1['path']} room {_gib(room)}"))
    if not bounds:
        return 0, "no host memory observation could be read"
    room, why = min(bounds)
    return max(int(room - headroom_gb * GIB), 0), f"{why} - {headroom_gb:g} GiB system_ram_headroom_gb"


def _read_direct(path: str, limit: int) -> int:
    """Reads up to ``limit`` bytes of ``path`` with O_DIRECT into a page-aligned buffer; raises
    OSError when the file system refuses it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, CHUNK)
        try:
            total = 0
            while total < limit:
                n = os.readv(fd, [buf])
                total += n
                if n < CHUNK:
                    break
            return total
        finally:
            buf.close()
    finally:
        os.close(fd)


def _read_buffered(path: str, limit: int) -> int:
    """Reads up to ``limit`` bytes of ``path`` through the page cache, after asking the kernel to
    drop the file's cached pages (pages mapped by a process stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        total = 0
        while total < limit:
            n = os.readv(fd, [view])
            total += n
            if n < CHUNK:
                break
        return total
    finally:
        os.close(fd)


def _timed_reads(files: List[str], limit: int, read: Any) -> Tuple[int, float]:
    t = time.perf_counter()
    total = 0
    for path in files:
        if total >= limit:
            break
        total += read(path, limit - total)
    return total, time.perf_counter() - t


def measure_disk(files: List[str], limit: int = DISK_READ_BYTES) -> Dict[str, Any]:
    """Sequential read speed of ``files`` (up to ``limit`` bytes in all): with O_DIRECT (the page
    cache bypassed) and buffered (after dropping the files' cached pages). When O_DIRECT is
    refused (tmpfs, some network file systems) only the buffered figure is given, with a note."""
    out: Dict[str, Any] = {"files": files}
    try:
        if not hasattr(os, "O_DIRECT"):
            raise OSError("this platform has no O_DIRECT")
        read, seconds = _timed_reads(files, limit, _read_direct)
        out["direct_gbps"] = read / seconds / 1e9 if seconds > 0 else None
    except OSError as e:
        out["direct_gbps"] = None
        out["direct_note"] = (
            f"O_DIRECT refused ({e.strerror or e}): the file system serves reads through the page cache only "
            "(tmpfs?); buffered figure only"
        )
    read, seconds = _timed_reads(files, limit, _read_buffered)
    out["buffered_gbps"] = read / seconds / 1e9 if seconds > 0 else None
    out["bytes_read"] = read
    return out


def measure_disk_in(directory: str) -> Dict[str, Any]:
    """:func:`measure_disk` on a temp file of :data:`DISK_SAMPLE_BYTES` written (and synced) in
    ``directory``, removed afterwards."""
    if not os.path.isdir(directory):
        raise _native.DynamicOffloadError(f"--dir {directory} is not a directory; pass an existing folder on the disk to measure")
    fd, path = tempfile.mkstemp(prefix=".ddo-doctor-", dir=directory)
    try:
        block = os.urandom(CHUNK)
        with os.fdopen(fd, "wb") as f:
            for _ in range(DISK_SAMPLE_BYTES // CHUNK):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        out = measure_disk([path], DISK_SAMPLE_BYTES)
        out["files"] = [f"{directory} (a {DISK_SAMPLE_BYTES >> 20} MiB temp file)"]
        return out
    finally:
        os.unlink(path)


def inspect_model(path: str) -> Dict[str, Any]:
    """Bytes of a checkpoint as stored, and the blocks ddo would stream: units found by the
    session's rule on the module tree its tensor names imply."""
    info = json.loads(_native.inspect_checkpoint(path))
    tensors = info["tensors"]
    total = sum(int(t["len"]) for t in tensors)
    modules: Dict[str, bool] = {"": False}
    for t in tensors:
        parts = t["name"].split(".")[:-1]
        for i in range(1, len(parts) + 1):
            modules.setdefault(".".join(parts[:i]), False)
            if i < len(parts) and parts[i].isdigit():
                modules[".".join(parts[:i])] = True
    params = [(t["name"], i) for i, t in enumerate(tensors)]
    units = _native.unit_paths(sorted(modules.items()), params)
    sizes = {u: sum(int(t["len"]) for t in tensors if t["name"].startswith(u + ".")) for u in units}
    return {
        "path": path,
        "files": len(info["files"]),
        "file_paths": info["files"],
        "tensors": len(tensors),
        "bytes": total,
        "blocks": len(units),
        "largest_block_bytes": max(sizes.values(), default=0),
        "outside_blocks_bytes": total - sum(sizes.values()),
    }


def inspect_pipeline(folder: str) -> Dict[str, Any]:
    """Each model component of the pipeline folder ``folder`` (``model_index.json``) stored as
    safetensors: its class, weight bytes, stored dtypes and blocks; and which is the denoiser
    (``transformer`` or ``unet``, else the largest), whose recommendations ``diagnose`` makes."""
    index_path = os.path.join(folder, "model_index.json")
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise _native.DynamicOffloadCheckpointError(f"{index_path} cannot be read as JSON: {e}") from None
    components = []
    for name, spec in index.items():
        sub = os.path.join(folder, name)
        if name.startswith("_") or not isinstance(spec, list) or not os.path.isdir(sub):
            continue
        if not any(f.endswith(".safetensors") for f in os.listdir(sub)):
            continue
        model = inspect_model(sub)
        dtypes: Dict[str, int] = {}
        for t in json.loads(_native.inspect_checkpoint(sub))["tensors"]:
            dtypes[t["dtype"]] = dtypes.get(t["dtype"], 0) + int(t["len"])
        model.update(name=name, cls=".".join(str(x) for x in spec), dtypes=dict(sorted(dtypes.items(), key=lambda kv: -kv[1])))
        components.append(model)
    if not components:
        raise _native.DynamicOffloadCheckpointError(f"{folder} is a pipeline folder with no model component stored as safetensors")
    names = [c["name"] for c in components]
    denoiser = next((n for n in ("transformer", "unet") if n in names), max(components, key=lambda c: c["bytes"])["name"])
    return {"path": folder, "class": index.get("_class_name"), "components": components, "denoiser": denoiser}


def _fits(components: List[Dict[str, Any]], gpu: Dict[str, Any], host: Dict[str, Any]) -> None:
    """Whether each component's weights fit the device whole: the GPU's free memory when one
    was measured, else the host's available memory (the CPU runs them)."""
    free = gpu.get("free_bytes")
    where = "gpu free" if free is not None else "host MemAvailable"
    room = free if free is not None else host.get("mem_available_bytes")
    for c in components:
        c["fits_device"] = None if room is None else c["bytes"] <= room
        c["fits_against"] = where


# ---- recommendations -------------------------------------------------------------------------


def recommend(
    model: Dict[str, Any], gpu: Dict[str, Any], host: Dict[str, Any], disk: Dict[str, Any]
) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """One recommendation per decision (``setting``, ``value``, ``why``) and the configuration
    they make, from the measurements. Headrooms and the prefetch depth are the native route's as
    this process resolves them (preset, ``DDO_*`` variables)."""
    from ..config import DynamicOffloadConfig
    from ..settings import resolve_settings

    values = resolve_settings("transformer", config=DynamicOffloadConfig(backend="vmm")).values
    size = model["bytes"]
    slots = max(int(values["prefetch_depth"]) + 1, 2)
    working_set = model["outside_blocks_bytes"] + slots * model["largest_block_bytes"]
    recs: List[Dict[str, Any]] = []
    config: Dict[str, Any] = {}
    pinned_gbps = gpu.get("pinned_gbps")
    if "free_bytes" not in gpu:
        config.update(backend="vmm", execution_device="cpu")
        recs.append({
            "setting": "backend", "value": "vmm",
            "why": "a safetensors checkpoint -> the native route (preset auto = vmm_fast) streams its blocks from it; "
            "host memory holds the model once",
        })
        recs.append({
            "setting": "execution_device", "value": "cpu",
            "why": f"{gpu['note']} -> the host backend (CPU memory) runs the route; a GPU budget needs a CUDA device "
            "(run doctor where one is, --device cuda:N)",
        })
        recs.append({
            "setting": "vmm_resident_weight_budget_gb", "value": None,
            "why": "no GPU memory measured: a budget needs free VRAM (torch.cuda.mem_get_info) on a CUDA device",
        })
    else:
        room = gpu["free_bytes"] - GPU_HEADROOM_GB * GIB
        if size <= room:
            config.update(route="none")
            recs.append({
                "setting": "route", "value": "none",
                "why": f"model {_gib(size)} <= free VRAM {_gib(gpu['free_bytes'])} - {GPU_HEADROOM_GB:g} GiB headroom "
                "-> keep it resident (route none): nothing to stream",
            })
        else:
            budget = _floor_gib(room)
            config.update(backend="vmm")
            recs.append({
                "setting": "backend", "value": "vmm",
                "why": f"model {_gib(size)} > free VRAM {_gib(gpu['free_bytes'])} - {GPU_HEADROOM_GB:g} GiB headroom -> the "
                "native route (preset auto = vmm_fast) streams its blocks from the checkpoint",
            })
            if budget * GIB < working_set:
                recs.append({
                    "setting": "vmm_resident_weight_budget_gb", "value": None,
                    "why": f"free VRAM - headroom = {_gib(max(room, 0))} is below the working set {_gib(working_set)} "
                    f"({slots} slots of the largest block {_gib(model['largest_block_bytes'])} + "
                    f"{_gib(model['outside_blocks_bytes'])} outside blocks): free GPU memory, or lower prefetch_depth",
                })
            else:
                config["vmm_resident_weight_budget_gb"] = budget
                streamed = max(size - (budget * GIB - slots * model["largest_block_bytes"]), 0)
                floor = f"; about {_gib(streamed)} streamed per forward" + (
                    f", >= {streamed / (pinned_gbps * 1e9):.3f} s per forward at the measured {pinned_gbps:.1f} GB/s"
                    if pinned_gbps else ""
                )
                recs.append({
                    "setting": "vmm_resident_weight_budget_gb", "value": budget,
                    "why": f"model {_gib(size)} > free VRAM {_gib(gpu['free_bytes'])} - {GPU_HEADROOM_GB:g} GiB headroom "
                    f"-> backend vmm, vmm_resident_weight_budget_gb={_setting(budget)}{floor}",
                })
    if config.get("route") == "none":
        DynamicOffloadConfig(**config).to_json()  # validated natively, as a host would pass it
        return recs, config
    usable, bound = usable_host_bytes(host, float(values["system_ram_headroom_gb"]))
    disk_gbps = disk.get("direct_gbps") or disk.get("buffered_gbps")

    def per_pass(n: float) -> str:
        return f" (about {n / (disk_gbps * 1e9):.2f} s per forward at the measured {disk_gbps:.2f} GB/s)" if disk_gbps else ""

    if size <= usable:
        config["vmm_source_cache_gb"] = 0
        recs.append({
            "setting": "vmm_source_cache_gb", "value": 0,
            "why": f"model {_gib(size)} <= usable host memory {_gib(usable)} ({bound}) -> map the checkpoint: host "
            "memory holds it once, in the page cache",
        })
        registered = size
    elif usable >= GIB:
        cache = _floor_gib(usable)
        config["vmm_source_cache_gb"] = cache
        rest = size - cache * GIB
        recs.append({
            "setting": "vmm_source_cache_gb", "value": cache,
            "why": f"model {_gib(size)} > usable host memory {_gib(usable)} ({bound}) -> retain {_setting(cache)} GiB, "
            f"read the other {_gib(rest)} from disk on each forward{per_pass(rest)}",
        })
        registered = int(cache * GIB)
    else:
        config["load_safetensors_backend"] = "direct"
        recs.append({
            "setting": "load_safetensors_backend", "value": "direct",
            "why": f"usable host memory {_gib(usable)} ({bound}) cannot hold weights -> read them from disk with "
            f"O_DIRECT on each forward{per_pass(size)}",
        })
        registered = 0
    limit = host.get("rlimit_memlock_bytes")
    if registered and host.get("rlimits_observed") and limit is not None and limit < registered and not host.get("cap_ipc_lock"):
        hard = host.get("rlimit_memlock_hard_bytes")
        pageable = gpu.get("pageable_gbps")
        speed = f" ({pageable:.1f} GB/s measured against {pinned_gbps:.1f} pinned)" if pageable and pinned_gbps else ""
        recs.append({
            "setting": "ulimit -l", "value": "unlimited",
            "why": f"RLIMIT_MEMLOCK {_gib(limit)} < {_gib(registered)} ddo registers, without CAP_IPC_LOCK -> what does "
            f"not fit is copied unregistered, at the pageable speed{speed}; raise `ulimit -l` (hard limit "
            f"{'unlimited' if hard is None else _gib(hard)})",
        })
    DynamicOffloadConfig(**config).to_json()  # validated natively, as a host would pass it
    return recs, config


def diagnose(checkpoint: Optional[str] = None, device: str = "cuda:0", directory: Optional[str] = None) -> Dict[str, Any]:
    """Every measurement, and with ``checkpoint`` the recommendations; a dict that JSON carries.
    Disk reads measure the checkpoint's files, else a temp file in ``directory`` (default: the
    system's temp folder)."""
    import torch

    report: Dict[str, Any] = {"ddo": _native.version(), "torch": torch.__version__, "device": device}
    model = None
    if checkpoint is not None:
        if not os.path.exists(checkpoint):
            raise _native.DynamicOffloadCheckpointError(
                f"--checkpoint {checkpoint} does not exist; pass a .safetensors file, an index .json or a model folder"
            )
        if os.path.isfile(os.path.join(checkpoint, "model_index.json")):
            # A pipeline folder: every model component reported, the denoiser recommended for.
            pipeline = inspect_pipeline(checkpoint)
            report["pipeline"] = pipeline
            model = dict(next(c for c in pipeline["components"] if c["name"] == pipeline["denoiser"]))
            for c in pipeline["components"]:
                c.pop("file_paths")
        else:
            model = inspect_model(checkpoint)
    report["gpu"] = measure_gpu(device)
    report["host"] = observe_host()
    if "pipeline" in report:
        _fits(report["pipeline"]["components"], report["gpu"], report["host"])
    if model is not None and directory is None:
        report["disk"] = measure_disk([str(f) for f in model.pop("file_paths")])
    else:
        if model is not None:
            model.pop("file_paths")
        report["disk"] = measure_disk_in(directory or tempfile.gettempdir())
    if model is not None:
        report["model"] = model
        report["recommendations"], report["config"] = recommend(model, report["gpu"], report["host"], report["disk"])
    return report


def _config_lines(config: Dict[str, Any]) -> List[str]:
    keys = dict(_native.setting_keys())
    python = ", ".join(f"{k}={v!r}" for k, v in config.items())
    names = {"backend": "BACKEND", "route": "TRANSFORMER_ROUTE", **keys}
    variables = " ".join(f"DDO_{names[k]}={v}" for k, v in config.items())
    return [f"  ddo.DynamicOffloadConfig({python})", f"  {variables}"]


def format_report(report: Dict[str, Any]) -> str:
    """The report as text, one line per measurement and per recommendation."""
    lines = [f"ddo doctor (ddo {report['ddo']}, torch {report['torch']})"]
    gpu = report["gpu"]
    if "free_bytes" in gpu:
        lines.append(f"gpu      {gpu['device']} {gpu['name']}: {_gib(gpu['free_bytes'])} free of {_gib(gpu['total_bytes'])}")
        lines.append(
            f"link     pinned {gpu['pinned_gbps']:.1f} GB/s (best {gpu['pinned_best_gbps']:.1f}), pageable "
            f"{gpu['pageable_gbps']:.1f} GB/s (best {gpu['pageable_best_gbps']:.1f}); {gpu['copy_bytes'] >> 20} MiB "
            f"host-to-device copies x{gpu['repeats']}, CUDA events"
        )
    else:
        lines.append(f"gpu      {report['device']}: {gpu['note']}")
    host = report["host"]
    memlock = host.get("rlimit_memlock_bytes")
    memlock_text = "unlimited" if memlock is None and host.get("rlimits_observed") else _gib(memlock or 0)
    cgroups = host.get("cgroups") or []
    cgroup_text = "; ".join(
        f"{c['path']} max {_gib(c['max']) if c.get('max') is not None else 'none'} high "
        f"{_gib(c['high']) if c.get('high') is not None else 'none'} current {_gib(c['current'])} "
        f"(reclaimable {_gib(c.get('reclaimable', 0))})"
        for c in cgroups
    ) or "no memory controller"
    lines.append(
        f"ram      MemAvailable {_gib(host.get('mem_available_bytes') or 0)} of {_gib(host.get('mem_total_bytes') or 0)}; "
        f"this process RSS {_gib(host.get('rss_bytes') or 0)}; overcommit {host.get('overcommit_mode', 'unknown')} "
        f"(CommitLimit {_gib(host.get('commit_limit_bytes') or 0)}, Committed_AS {_gib(host.get('committed_bytes') or 0)})"
    )
    lines.append(f"cgroup   {cgroup_text}")
    v1 = host.get("cgroup_v1")
    if v1:
        limit = _gib(v1["limit_bytes"]) if v1["limit_bytes"] is not None else "none"
        lines.append(f"cgroup   v1 {v1['path']}: limit {limit}, usage {_gib(v1['usage_bytes'])} (ddo's admission reads v2 only)")
    lines.append(
        f"limits   RLIMIT_MEMLOCK {memlock_text} (registration; CAP_IPC_LOCK {'yes' if host.get('cap_ipc_lock') else 'no'}); "
        f"RLIMIT_AS {'unlimited' if host.get('rlimit_as_bytes') is None else _gib(host['rlimit_as_bytes'])}"
        f"{'; WSL' if host.get('wsl') else ''}"
    )
    disk = report["disk"]
    files = disk["files"]
    where = files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more"
    direct = f"O_DIRECT {disk['direct_gbps']:.2f} GB/s" if disk.get("direct_gbps") else "O_DIRECT -"
    buffered = f"{disk['buffered_gbps']:.2f} GB/s" if disk.get("buffered_gbps") else "-"
    lines.append(f"disk     {where}: {direct}, buffered {buffered} (cold), {_gib(disk['bytes_read'])} read")
    if disk.get("direct_note"):
        lines.append(f"         {disk['direct_note']}")
    pipeline = report.get("pipeline")
    if pipeline is not None:
        lines.append(f"pipeline {pipeline['path']}: {pipeline['class']}, {len(pipeline['components'])} model component(s)")
        for c in pipeline["components"]:
            fits = {True: "fits", False: "does not fit", None: "fit unknown"}[c["fits_device"]]
            dtypes = ", ".join(f"{d} {_gib(b)}" for d, b in c["dtypes"].items())
            lines.append(
                f"  {c['name']:<16} {c['cls']}: {_gib(c['bytes'])} ({dtypes}), {c['blocks']} blocks; {fits} whole in "
                f"{c['fits_against']}{'  <- denoiser, recommended for below' if c['name'] == pipeline['denoiser'] else ''}"
            )
    model = report.get("model")
    if model is not None:
        lines.append(
            f"model    {model['path']}: {_gib(model['bytes'])} in {model['files']} file(s), {model['tensors']} tensors; "
            f"{model['blocks']} blocks, largest {_gib(model['largest_block_bytes'])}, {_gib(model['outside_blocks_bytes'])} "
            "outside blocks"
        )
        lines.append("recommend")
        for r in report["recommendations"]:
            value = "-" if r["value"] is None else _setting(r["value"]) if isinstance(r["value"], float) else r["value"]
            lines.append(f"  {r['setting']} = {value}: {r['why']}")
        if report["config"]:
            lines.append("config")
            lines.extend(_config_lines(report["config"]))
    else:
        lines.append("recommend  pass --checkpoint PATH for a route, a GPU budget and a host route")
    return "\n".join(lines) + "\n"
