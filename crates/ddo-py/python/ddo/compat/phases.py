"""Helpers for a host's phase boundaries (after the text encoders, before the transformer, after
the run): each is off unless ``enabled=True``, acts only at a quiescent boundary, synchronizes
the device at most once itself, and reports what it did as a :class:`DynamicOffloadMetrics`
whose ``phase`` echoes the caller's label.

ddo runs on Linux: the Windows standby-list purge of the published library answers
``{"purged": False, "reason": "non_windows"}`` here, and its CLI flags are accepted so a host's
command line keeps working."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .. import _native
from ..metrics import DynamicOffloadMetrics
from ..settings import load_dynamic_offload_settings_from_env

__all__ = [
    "DEFAULT_LIFECYCLE_PHASES",
    "add_dynamic_offload_lifecycle_arguments",
    "detach_auxiliary_cpu_sources",
    "maybe_purge_windows_standby_cache",
    "purge_windows_standby_cache",
    "purge_windows_standby_cache_event",
    "release_native_vmm_idle_cache",
    "release_pytorch_host_cache",
]

DEFAULT_LIFECYCLE_PHASES = ("before_run", "after_text_encoder", "before_transformer", "after_run")
DEFAULT_MAX_COPY_BYTES = 16 << 20


def _metrics(route: str, section: str, values: Dict[str, Any]) -> DynamicOffloadMetrics:
    """An observation snapshot of ``route`` carrying ``values`` as ``runtime[section]``."""
    return DynamicOffloadMetrics(route=route, runtime={section: values})


def _cuda_device(device: Union[str, int, torch.device, None]) -> Optional[torch.device]:
    """The CUDA device a helper acts on (``None``: the current one); ``None`` when ``device`` is
    not a CUDA device. Never initializes CUDA."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else torch.device("cuda")
    try:
        d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    except (RuntimeError, TypeError) as e:
        raise _native.DynamicOffloadConfigError(
            f"device {device!r} is not a device ({e}): pass 'cuda', 'cuda:N', an index or 'cpu'"
        ) from None
    if d.type not in ("cuda", "cpu"):
        raise _native.DynamicOffloadConfigError(
            f"device {device!r}: ddo runs components on CUDA devices or on the host backend ('cpu'), not {d.type}"
        )
    if d.type != "cuda":
        return None
    if d.index is None and torch.cuda.is_initialized():
        d = torch.device("cuda", torch.cuda.current_device())
    return d


# ---- PyTorch's pinned host cache -------------------------------------------------------------


def _host_allocator_bytes() -> Optional[int]:
    """Bytes PyTorch's pinned host allocator holds (blocks in use and cached), when this PyTorch
    reports them."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    value = stats().get("allocated_bytes.current")
    return int(value) if value is not None else None


def release_pytorch_host_cache(
    *, enabled: bool = False, phase: str = "", device: Union[str, int, torch.device, None] = None
) -> DynamicOffloadMetrics:
    """Route ``pytorch_host_cache_release``: collects garbage, synchronizes ``device`` once
    (default the current CUDA device) and returns the pinned host blocks PyTorch's allocator
    caches to the driver (``torch._C._host_emptyCache``). Status ``disabled``,
    ``cuda_not_initialized`` (CUDA was never used in this process: nothing is cached, and CUDA is
    not initialized for it), ``unsupported`` (``reason`` says why) or ``released``, with the
    allocator's bytes before and after. ddo's own host memory (registered checkpoint ranges,
    retained windows) is not PyTorch's cache and is untouched."""
    section: Dict[str, Any] = {"phase": phase, "status": "disabled"}
    if not enabled:
        return _metrics("pytorch_host_cache_release", "host_cache_release", section)
    d = _cuda_device(device)
    if d is None:
        reason = f"PyTorch's pinned host cache serves CUDA devices, not {device}"
        section.update(status="unsupported", device=str(device), reason=reason)
    elif not torch.cuda.is_initialized():
        section["status"] = "cuda_not_initialized"
    elif getattr(torch._C, "_host_emptyCache", None) is None:
        reason = f"PyTorch {torch.__version__} has no torch._C._host_emptyCache"
        section.update(status="unsupported", device=str(d), reason=reason)
    else:
        gc.collect()
        torch.cuda.synchronize(d)
        before = _host_allocator_bytes()
        torch._C._host_emptyCache()
        after = _host_allocator_bytes()
        section.update(status="released", device=str(d), synchronized=True)
        if before is not None and after is not None:
            section.update(allocator_bytes_before=before, allocator_bytes_after=after, allocator_bytes_delta=after - before)
    return _metrics("pytorch_host_cache_release", "host_cache_release", section)


# ---- ddo's idle execution slots ----------------------------------------------------------------


def _live_runtimes() -> List[Any]:
    from ..runtime.guards import ATTACHED

    return [r for r in list(ATTACHED) if not r.detached and r.session is not None]


def release_native_vmm_idle_cache(
    *,
    enabled: bool = False,
    phase: str = "",
    device: Union[str, int, torch.device, None] = None,
    clear_cublas_workspaces: bool = False,
) -> DynamicOffloadMetrics:
    """Route ``native_vmm_idle_cache_release``: releases the memory of idle execution slots of
    every live ddo component on ``device`` (default the current CUDA device; ``"cpu"`` for
    components on the host backend), what ``result.reclaim()`` does for one component. Addresses
    stay reserved and the next use of a slot uploads again; resident units keep their memory.
    Components that are unloaded have nothing to release. With ``clear_cublas_workspaces``,
    cuBLAS's per-stream workspaces are freed too (CUDA only). Status ``disabled``,
    ``cuda_not_initialized`` or ``completed``; a forward running in another thread is waited
    for, one running in this thread is refused."""
    section: Dict[str, Any] = {"phase": phase, "status": "disabled"}
    route = "native_vmm_idle_cache_release"
    if not enabled:
        return _metrics(route, "idle_cache_release", section)
    cuda = _cuda_device(device)
    if cuda is not None and not torch.cuda.is_initialized():
        section["status"] = "cuda_not_initialized"
        return _metrics(route, "idle_cache_release", section)
    target = cuda if cuda is not None else torch.device("cpu")  # the host backend ("cpu", "cpu:0")
    runtimes = [r for r in _live_runtimes() if r.device == target]
    me = threading.get_ident()
    for r in runtimes:
        if r.in_forward.get(me):
            raise _native.DynamicOffloadLifecycleError(
                f"release_native_vmm_idle_cache was called inside the forward of {type(r.module).__name__}; "
                "call it between passes (at a phase boundary)"
            )
    gc.collect()
    if cuda is not None:
        torch.cuda.synchronize(cuda)
    sessions = unloaded = slots = released = 0
    for r in runtimes:
        if r.is_unloaded():
            unloaded += 1
            continue
        n, b = r.reclaim()
        sessions += 1
        slots += int(n)
        released += int(b)
    section.update(
        status="completed",
        device=str(target),
        synchronized=cuda is not None,
        sessions=sessions,
        unloaded_sessions=unloaded,
        slots_released=slots,
        bytes_released=released,
    )
    if clear_cublas_workspaces:
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if cuda is not None and clear is not None:
            clear()
            section["cublas_workspaces_cleared"] = True
        else:
            section["cublas_workspaces_cleared"] = False
            section["reason"] = (
                f"cuBLAS workspaces belong to CUDA devices, not {target}"
                if cuda is None
                else f"PyTorch {torch.__version__} has no torch._C._cuda_clearCublasWorkspaces"
            )
    return _metrics(route, "idle_cache_release", section)


# ---- CPU tensors that still view the checkpoint --------------------------------------------------


def _file_mappings(files: Iterable[str]) -> Optional[List[Tuple[int, int, bool, str]]]:
    """``(start, end, private, path)`` of this process's mappings of ``files``; ``None`` when
    ``/proc/self/maps`` cannot be read."""
    wanted = {os.path.realpath(f) for f in files}
    out: List[Tuple[int, int, bool, str]] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                path = parts[5].rstrip("\n")
                if path.endswith(" (deleted)") or os.path.realpath(path) not in wanted:
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, parts[1].endswith("p"), path))
    except OSError:
        return None
    return out


def _in(mappings: List[Tuple[int, int, bool, str]], t: torch.Tensor) -> bool:
    from ..runtime import StreamedWeight

    # A streamed weight's placeholder has no memory of its own.
    if t.device.type != "cpu" or t.is_meta or isinstance(t, StreamedWeight) or not torch._C._has_storage(t):
        return False
    address = t.untyped_storage().data_ptr()
    return any(lo <= address < hi for lo, hi, _, _ in mappings)


def _span(t: torch.Tensor) -> Tuple[int, int]:
    """The byte range of its storage ``t`` reads."""
    start = int(t.storage_offset() * t.element_size())
    if t.numel() == 0:
        return start, start
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return start, int(start + extent * t.element_size())


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    # Not ``t.to("meta")``: on a Parameter that keeps the original alive.
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _copy_plan(tensors: List[torch.Tensor]) -> List[Tuple[List[torch.Tensor], int, int]]:
    """Tensors grouped by storage, with the byte range ``[lo, hi)`` of it they read together;
    ``lo`` aligned so every member's start stays a whole number of its elements from it."""
    groups: Dict[int, List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    plan = []
    for members in groups.values():
        spans = [_span(t) for t in members]
        lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
        plan.append((members, lo - lo % 16, hi))
    return plan


def _private_copies(plan: List[Tuple[List[torch.Tensor], int, int]]) -> Dict[int, torch.Tensor]:
    """A copy in private host memory of every planned tensor; tensors of one storage share one
    copy of the range they read, so aliases stay aliases. ``{id(tensor): copy}``."""
    copies: Dict[int, torch.Tensor] = {}
    for members, lo, hi in plan:
        raw = torch.empty(hi - lo, dtype=torch.uint8)
        raw.copy_(torch.empty(0, dtype=torch.uint8).set_(members[0].untyped_storage(), lo, (hi - lo,), (1,)))
        storage = raw.untyped_storage()
        for t in members:
            offset = (t.storage_offset() * t.element_size() - lo) // t.element_size()
            copies[id(t)] = torch.empty(0, dtype=t.dtype).set_(storage, offset, t.shape, t.stride())
    return copies


def detach_auxiliary_cpu_sources(
    result: Any, *, enabled: bool = False, max_copy_bytes: int = DEFAULT_MAX_COPY_BYTES
) -> DynamicOffloadMetrics:
    """Route ``vmm_auxiliary_source_detachment`` for a component on the native route
    (``vmm_fast_runtime``): finds the CPU tensors it still holds inside a mapping of its own
    checkpoint files (read from ``/proc/self/maps``), other than ddo's own mapping it streams
    from. A module tensor whose values the forward reads (a buffer on the host backend) is copied
    into private memory, all of them or none, within ``max_copy_bytes``; the loaded host tensors
    ddo kept from before attach (the session streams from the checkpoint and never reads them)
    are dropped. The report gives the bytes copied, the references dropped, and the loader's
    private mappings of the checkpoint before and after (gone once nothing else holds them).
    A component with nothing there reports ``nothing_to_detach`` and copies nothing. Idempotent:
    a second call returns the first report."""
    route = "vmm_auxiliary_source_detachment"
    section: Dict[str, Any] = {"status": "disabled", "max_copy_bytes": int(max_copy_bytes)}
    if not enabled:
        return _metrics(route, "auxiliary_detachment", section)
    if isinstance(max_copy_bytes, bool) or not isinstance(max_copy_bytes, int) or max_copy_bytes < 0:
        raise _native.DynamicOffloadConfigError(f"max_copy_bytes = {max_copy_bytes!r} must be an int >= 0 (bytes)")
    cached = getattr(result, "_ddo_detachment", None)
    if cached is not None:
        return cached
    runtime = result.runtime
    name = getattr(result, "runtime_route", "") or result.route
    if name != "vmm_fast_runtime" or runtime is None or runtime.checkpoint is None:
        section.update(
            status="not_applicable",
            reason=(
                "the linear route streams from the module's own host tensors: they are its source, not auxiliary"
                if name == "linear_runtime"
                else f"route {name} does not stream from a checkpoint"
            ),
        )
        return _metrics(route, "auxiliary_detachment", section)
    if runtime.detached:
        raise _native.DynamicOffloadLifecycleError(
            "the offload was removed; detach_auxiliary_cpu_sources applies to an attached component"
        )
    if runtime.in_forward.get(threading.get_ident()):
        raise _native.DynamicOffloadLifecycleError(
            "detach_auxiliary_cpu_sources was called inside the module's forward; call it between passes"
        )
    files = (result.source or {}).get("files") or []
    with runtime.forward_lock:
        before = _file_mappings(files)
        if before is None:
            section.update(status="unsupported", reason="/proc/self/maps could not be read: mappings unobservable")
            return _metrics(route, "auxiliary_detachment", section)
        private = [m for m in before if m[2]]
        # Buffers the forward reads: copied. Parameters are arena views or placeholders; one
        # found here is reported and left alone.
        buffers = [
            (owner, attr, b)
            for owner in runtime.module.modules()
            for attr, b in owner._buffers.items()
            if b is not None and _in(before, b)
        ]
        parameters = [n for n, p in runtime.module.named_parameters(remove_duplicate=False) if _in(before, p)]
        # References ddo kept from before attach, never read on this route: dropped.
        originals = [n for n, p in runtime.originals.items() if _in(before, p)]
        kept_buffers = [n for n, b in runtime.original_buffers.items() if _in(before, b)]
        distinct = list({id(b): b for _, _, b in buffers}.values())
        plan = _copy_plan(distinct)
        copied = sum(hi - lo for _, lo, hi in plan)
        if copied > max_copy_bytes:
            raise _native.DynamicOffloadCapacityError(
                f"detaching {len(distinct)} buffer(s) of {type(runtime.module).__name__} from the checkpoint mapping "
                f"copies {copied} bytes, over max_copy_bytes = {max_copy_bytes}: raise max_copy_bytes to at least "
                f"{copied}, or leave detachment off"
            )
        copies = _private_copies(plan)
        groups = len(plan)
        # Transaction: every buffer swapped, or none.
        swapped: List[Tuple[torch.nn.Module, str, torch.Tensor]] = []
        try:
            for owner, attr, b in buffers:
                owner._buffers[attr] = copies[id(b)]
                swapped.append((owner, attr, b))
        except BaseException:
            for owner, attr, b in reversed(swapped):
                owner._buffers[attr] = b
            raise
        # The kept buffer that is the module's own (host backend) takes its copy; others go.
        dropped = len(originals)
        old = None
        for name in kept_buffers:
            old = runtime.original_buffers[name]
            if id(old) not in copies:
                dropped += 1
            runtime.original_buffers[name] = copies.get(id(old), _meta_like(old))
        for name in originals:
            runtime.originals[name] = _meta_like(runtime.originals[name])
        owners = len(swapped)
        # Nothing here may keep the old tensors (and so the loader's mapping) alive.
        del buffers, distinct, copies, plan, swapped
        b = old = None  # the loops' last tensors
        gc.collect()
        after = _file_mappings(files) or []
        remaining = [n for n, p in runtime.module.named_parameters(remove_duplicate=False) if _in(after, p)]
        remaining += [n for n, b in runtime.module.named_buffers(remove_duplicate=False) if _in(after, b)]
    section.update(
        status="detached" if (copied or dropped) else "nothing_to_detach",
        copied_bytes=copied,
        copied_storage_groups=groups,
        copied_tensor_owners=owners,
        dropped_references=dropped,
        mapped_module_tensors_after=len(remaining),
        unmanaged_mapped_parameters=len(parameters),
        loader_mapping_bytes_before=sum(hi - lo for lo, hi, _, _ in private),
        loader_mapping_bytes_after=sum(hi - lo for lo, hi, p, _ in after if p),
        gpu_placement_changed=False,
        commit_recovery_proven=False,
    )
    report = _metrics(route, "auxiliary_detachment", section)
    result._ddo_detachment = report
    return report


# ---- host CLI: lifecycle flags and the Windows standby purge -------------------------------------


def add_dynamic_offload_lifecycle_arguments(
    parser: argparse.ArgumentParser, phases: Sequence[str] = DEFAULT_LIFECYCLE_PHASES
) -> argparse.ArgumentParser:
    """Adds a tri-state ``--purge-<phase>`` / ``--no-purge-<phase>`` pair per phase (dest
    ``purge_<phase>``, default ``None`` = decided by ``DDO_PURGE_WINDOWS_STANDBY_<PHASE>``). They
    drive the Windows standby-list purge, which is a no-op on Linux (see
    :func:`maybe_purge_windows_standby_cache`). An unknown phase raises ``ValueError``."""
    unknown = [p for p in phases if p not in DEFAULT_LIFECYCLE_PHASES]
    if unknown:
        raise ValueError(f"unknown lifecycle phase(s) {unknown}; allowed: {', '.join(DEFAULT_LIFECYCLE_PHASES)}")
    group = parser.add_argument_group("dynamic offload lifecycle (ddo)")
    for phase in phases:
        flag = phase.replace("_", "-")
        pair = group.add_mutually_exclusive_group()
        pair.add_argument(
            f"--purge-{flag}",
            dest=f"purge_{phase}",
            action="store_const",
            const=True,
            default=None,
            help=f"purge the Windows standby list at {phase} (no-op on Linux)",
        )
        pair.add_argument(f"--no-purge-{flag}", dest=f"purge_{phase}", action="store_const", const=False, default=None)
    return parser


def _standby_result(phase: Optional[str], reason: str) -> Dict[str, Any]:
    return {"purged": False, "reason": reason, "phase": phase}


def purge_windows_standby_cache(*, phase: Optional[str] = None) -> Dict[str, Any]:
    """The Windows standby-list purge. ddo runs on Linux, where there is no standby list to
    purge: returns ``{"purged": False, "reason": "non_windows", "phase": phase}``."""
    if sys.platform != "win32":
        return _standby_result(phase, "non_windows")
    raise _native.DynamicOffloadError("ddo runs on Linux; the Windows standby-list purge is not part of it")


def purge_windows_standby_cache_event(
    record_event: Optional[Callable[..., Any]], name: str, print_message: bool = True
) -> Dict[str, Any]:
    """:func:`purge_windows_standby_cache`, then ``record_event(name, result)`` when given, and a
    ``[ddo]`` line on stdout with ``print_message``."""
    result = purge_windows_standby_cache(phase=name)
    if record_event is not None:
        record_event(name, result)
    if print_message:
        print(f"[ddo] {name}: standby cache not purged ({result['reason']})")
    return result


def maybe_purge_windows_standby_cache(
    settings_or_phase: Any = None,
    phase: Optional[str] = None,
    *,
    settings: Any = None,
    preset: str = "auto",
    execution_device: Union[str, torch.device] = "cuda:0",
    offload_device: Union[str, torch.device] = "cpu",
    running_on_wsl: Optional[bool] = None,
    record_event: Optional[Callable[..., Any]] = None,
    event_name: Optional[str] = None,
    default: str = "0",
    print_message: bool = True,
    ignore_errors: bool = True,
    environ: Optional[Mapping[str, str]] = None,
    enabled: Optional[bool] = None,
) -> Dict[str, Any]:
    """The published phase purge: the first argument is the phase, or settings followed by the
    phase. ``enabled`` (else ``DDO_PURGE_WINDOWS_STANDBY_<PHASE>`` from ``environ`` or the
    settings' preset, else ``default``; settings not given are read from the environment with
    ``preset``) decides whether the phase purges: ``{"purged": False, "reason": "disabled",
    "phase": phase}`` when it does not. On Linux there is no standby list, so an enabled phase
    returns ``reason`` ``non_windows`` (``record_event``, ``event_name``, ``print_message`` and
    ``ignore_errors`` serve the Windows purge and are not used)."""
    del record_event, event_name, print_message, ignore_errors  # what a Windows purge would use
    name = settings_or_phase if isinstance(settings_or_phase, str) else phase
    if settings_or_phase is not None and not isinstance(settings_or_phase, str) and settings is None:
        settings = settings_or_phase
    if not name:
        raise ValueError("maybe_purge_windows_standby_cache needs a phase: pass it first, or after the settings")
    if enabled is None:
        if settings is None:
            settings = load_dynamic_offload_settings_from_env(
                execution_device=execution_device,
                offload_device=offload_device,
                target_module_classes=(torch.nn.Linear, torch.nn.Embedding),
                skip_modules_pattern=(),
                running_on_wsl=running_on_wsl,
                environ=environ,
                default_preset=preset,
            )
        enabled = settings.preset_bool("DDO_PURGE_WINDOWS_STANDBY_" + name.strip().upper(), default, environ)
    if not enabled:
        return _standby_result(name, "disabled")
    return purge_windows_standby_cache(phase=name)
