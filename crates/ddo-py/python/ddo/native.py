"""The native route (``vmm_fast_runtime``): the component's weights live in a GPU weight arena
fed from the registered mapping of its checkpoint, or with ``vmm_source_cache_gb`` > 0 from
retained host windows under that ceiling (on a CPU execution device, the same arena runs on the
host backend). Every parameter becomes a zero-copy DLPack view
of arena memory at a fixed address, built once. Before a block runs its unit is acquired (PyTorch's
current stream waits for the upload); after it, the unit is released with a fence recorded on that
stream, which gates reuse of its slot."""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional

import torch
import torch.utils.dlpack

from . import _native
from .errors import DynamicOffloadConfigError, DynamicOffloadError
from .units import find_execution_units

__all__ = ["NativeRuntime"]

_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _link_speed(device: torch.device) -> float:
    """Host-to-device bytes per second of a 64 MiB pinned copy (best of three), for the plan's
    expected copy floor."""
    host = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    target = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        target.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        best = max(best, (64 << 20) / (time.perf_counter() - t))
    return best


def _stream(device: torch.device) -> int:
    """PyTorch's current stream on a CUDA device; 0 on the host backend (synchronous)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


class NativeRuntime:
    """Attaches the native route to ``module`` loaded from the checkpoint described by ``source``."""

    def __init__(self, module: torch.nn.Module, device: torch.device, values: Dict[str, Any], source: Dict[str, Any]) -> None:
        self.module = module
        self.device = device
        self.values = values
        self.source = source
        self.arena: Optional[Any] = None
        self.handles: List[Any] = []
        self.offset = 0
        self.resident_lease: Optional[int] = None
        self.setup_seconds = 0.0
        self.unit_names: List[str] = []

    def attach(self) -> None:
        """Builds the arena and publishes the views. Validates before changing the module: on any
        error the module is left as it was."""
        t = time.perf_counter()
        if self.device.type not in ("cuda", "cpu"):
            raise DynamicOffloadError(f"route vmm_fast_runtime runs on a CUDA device or the CPU, not {self.device}")
        checkpoint = {t["name"]: t for t in self.source["tensors"]}
        named = list(self.module.named_parameters())
        for n, p in named:
            entry = checkpoint.get(n)
            if entry is None:
                raise DynamicOffloadError(f"parameter {n} has no tensor in the checkpoint; the native route streams every weight from it")
            if _DTYPES.get(entry["dtype"]) != p.dtype or list(entry["shape"]) != list(p.shape):
                raise DynamicOffloadError(
                    f"parameter {n} is {p.dtype} {list(p.shape)} but the checkpoint stores {entry['dtype']} {entry['shape']}; "
                    "load the model with torch_dtype matching the checkpoint"
                )
        units = find_execution_units(self.module)
        owner: Dict[int, int] = {}
        for i, (_, m) in enumerate(units):
            for p in m.parameters():
                owner[id(p)] = -1 if id(p) in owner and owner[id(p)] != i else i
        by_id = {id(p): n for n, p in named}
        unit_tensors: List[List[str]] = [[] for _ in units]
        rest: List[str] = []
        for n, p in named:
            o = owner.get(id(p))
            (unit_tensors[o] if o is not None and o >= 0 else rest).append(n)
        specs = [("resident", rest, True)] if rest else []
        self.offset = len(specs)
        specs += [(name, tensors, False) for (name, _), tensors in zip(units, unit_tensors) if tensors]
        self.unit_names = [s[0] for s in specs]
        # Measured before the arena uploads anything, so no copy of ours shares the link.
        self.link_bytes_per_second = _link_speed(self.device) if self.device.type == "cuda" else None
        budget = int(self.values["vmm_resident_weight_budget_gb"] * (1 << 30))
        # Host bytes: retained windows under vmm_source_cache_gb (read once; the rest is read on
        # demand), or with 0 the checkpoint's mapping. Registration: vmm_source_registered_gb,
        # 0 = the storage ceiling, 0 too = every file of the mapping.
        storage_gb = self.values["vmm_source_cache_gb"]
        retained = int(storage_gb * (1 << 30)) if storage_gb > 0 else None
        registered_gb = self.values["vmm_source_registered_gb"] or storage_gb
        registration = int(registered_gb * (1 << 30)) if registered_gb > 0 else None
        headroom = int(self.values["auto_vram_headroom_gb"] * (1 << 30))
        try:
            self.arena = _native.NativeArena(
                self.source["path"],
                specs,
                budget,
                headroom,
                int(self.values["prefetch_depth"]),
                self.device.type,
                self.device.index or 0,
                registration,
                retained,
            )
        except ValueError as e:
            raise DynamicOffloadConfigError(str(e)) from None
        except RuntimeError as e:
            raise DynamicOffloadError(str(e)) from None
        # The first forward starts warm: resident units and the first slots upload now, behind
        # the host's remaining set-up.
        try:
            self.primed_bytes = self.arena.prime()
        except RuntimeError as e:
            arena, self.arena = self.arena, None
            arena.close()
            raise DynamicOffloadError(f"uploading the first units failed: {e}") from None
        views = {id(p): torch.utils.dlpack.from_dlpack(self.arena.dlpack(n)) for n, p in named}
        self._publish(lambda p: torch.nn.Parameter(views[id(p)], requires_grad=False))
        del by_id
        for name, b in list(self.module.named_buffers()):
            parent, _, attr = name.rpartition(".")
            owner_m = self.module.get_submodule(parent) if parent else self.module
            setattr(owner_m, attr, b.to(self.device))
        index = {name: i for i, name in enumerate(self.unit_names)}
        for name, m in units:
            if name in index:
                self.handles.append(m.register_forward_pre_hook(self._pre(index[name])))
                self.handles.append(m.register_forward_hook(self._post(index[name]), always_call=True))
        self.handles.append(self.module.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        self.handles.append(self.module.register_forward_hook(self._root_post, always_call=True))
        self.leases: Dict[int, int] = {}
        self.setup_seconds = time.perf_counter() - t

    def _publish(self, make) -> None:
        """Replaces every parameter (each alias of a shared one too) with ``make(old)``."""
        new: Dict[int, torch.nn.Parameter] = {}
        for name, p in list(self.module.named_parameters(remove_duplicate=False)):
            if id(p) not in new:
                new[id(p)] = make(p)
            parent, _, attr = name.rpartition(".")
            owner_m = self.module.get_submodule(parent) if parent else self.module
            setattr(owner_m, attr, new[id(p)])

    def _root_pre(self, _m: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        from .linear import _move_inputs

        self.arena.begin_pass()
        if self.offset and self.resident_lease is None:
            self.resident_lease = self.arena.acquire(0, _stream(self.device))
        return _move_inputs(args, self.device), _move_inputs(kwargs, self.device)

    def _root_post(self, _m: torch.nn.Module, _args: tuple, _out: Any) -> None:
        if self.resident_lease is not None:
            self.arena.release(self.resident_lease, _stream(self.device))
            self.resident_lease = None

    def _pre(self, unit: int):
        def hook(_m: torch.nn.Module, _args: tuple) -> None:
            self.leases[unit] = self.arena.acquire(unit, _stream(self.device))

        return hook

    def _post(self, unit: int):
        def hook(_m: torch.nn.Module, _args: tuple, _out: Any) -> None:
            lease = self.leases.pop(unit, None)
            if lease is not None:
                self.arena.release(lease, _stream(self.device))

        return hook

    def stats(self) -> Dict[str, Any]:
        """The arena's plan and counters."""
        return json.loads(self.arena.stats()) if self.arena is not None else {}

    def synchronize(self) -> None:
        """Waits for the device's work (the host backend's work is already complete)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reclaim(self) -> tuple:
        """Releases idle slot backing; ``(slots, bytes)``."""
        return self.arena.reclaim()

    def detach(self) -> None:
        """Removes the hooks and closes the arena after the device's work completed; parameters
        become meta placeholders (their memory was the arena's)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self.arena is not None:
            self.synchronize()
            self._publish(lambda p: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False))
            self.arena.close()
            self.arena = None

    def is_unloaded(self) -> bool:
        """Whether the arena was closed."""
        return self.arena is None
