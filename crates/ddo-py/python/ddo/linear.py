"""The linear runtime: streamed weights live in (pinned) host memory; each execution unit's
weights are copied to the execution device on a side stream just before the unit runs, the next
units are prefetched, the compute stream waits on the copy's event, and the device copies are
dropped after the unit (the caching allocator reuses them once the compute stream is done)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .errors import DynamicOffloadError
from .units import find_execution_units

__all__ = ["LinearRuntime"]


@dataclass
class _Unit:
    name: str
    module: torch.nn.Module
    params: List[torch.nn.Parameter]
    host: List[torch.Tensor]
    # All host weights packed in one (pinned) buffer, each at a 256-byte aligned offset, so a unit
    # uploads in one copy; `views` are (offset, nbytes, dtype, shape).
    flat: Optional[torch.Tensor] = None
    views: List[Tuple[int, int, torch.dtype, torch.Size]] = field(default_factory=list)
    device_flat: Optional[torch.Tensor] = None
    device_copies: Optional[List[torch.Tensor]] = None
    ready: Optional[Any] = None  # torch.cuda.Event
    prefetched: bool = False
    nbytes: int = 0


@dataclass
class LinearStats:
    """Counters of the linear runtime."""

    passes: int = 0
    uploads: int = 0
    upload_bytes: int = 0
    upload_seconds: float = 0.0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    prefetch_cancels: int = 0
    peak_bytes: Optional[int] = None


def _move_inputs(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value if value.device == device or value.is_meta else value.to(device, non_blocking=True)
    if isinstance(value, tuple):
        return tuple(_move_inputs(v, device) for v in value)
    if isinstance(value, list):
        return [_move_inputs(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _move_inputs(v, device) for k, v in value.items()}
    return value


class LinearRuntime:
    """Attaches the linear runtime to ``module``; see the module docstring."""

    def __init__(self, module: torch.nn.Module, device: torch.device, *, pin: bool, prefetch_depth: int) -> None:
        self.module = module
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin = pin and self.cuda
        self.depth = max(0, int(prefetch_depth))
        self.units: List[_Unit] = []
        self.stats = LinearStats()
        self.handles: List[Any] = []
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.order: Optional[List[int]] = None
        self.current: List[int] = []
        self.position = 0
        self.lookahead = True
        self.setup_seconds = 0.0
        self.pinned_bytes = 0
        self.resident_bytes = 0
        self.module_count = 0
        self.tensor_count = 0
        self._original: Dict[int, torch.Tensor] = {}

    # ---- attach / detach -------------------------------------------------------------------

    def attach(self) -> None:
        """Moves resident parts to the device, keeps unit weights on the host, installs hooks.
        On failure every tensor is put back and the error re-raised."""
        t = time.perf_counter()
        found = find_execution_units(self.module)
        owners: Dict[int, int] = {}
        for i, (_, m) in enumerate(found):
            for p in m.parameters():
                owners[id(p)] = -1 if id(p) in owners and owners[id(p)] != i else i
        unit_params: List[List[torch.nn.Parameter]] = [[] for _ in found]
        for i, (_, m) in enumerate(found):
            seen = set()
            for p in m.parameters():
                # Tied or shared parameters stay resident.
                if owners.get(id(p)) == i and id(p) not in seen:
                    seen.add(id(p))
                    unit_params[i].append(p)
        streamed = {id(p) for ps in unit_params for p in ps}
        try:
            for p in self.module.parameters():
                if id(p) not in streamed:
                    self._original[id(p)] = p.data
                    p.data = p.data.to(self.device)
                    self.resident_bytes += p.numel() * p.element_size()
            for name, b in list(self.module.named_buffers()):
                owner, attr = self._owner(name)
                setattr(owner, attr, b.to(self.device))
            for (name, m), params in zip(found, unit_params):
                unit = self._pack(name, m, params)
                for p, h in zip(params, unit.host):
                    p.data = h
                self.units.append(unit)
            for i, u in enumerate(self.units):
                self.handles.append(u.module.register_forward_pre_hook(self._pre_hook(i)))
                self.handles.append(u.module.register_forward_hook(self._post_hook(i)))
            self.handles.append(self.module.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        except BaseException:
            self.detach()
            raise
        # The originals were kept only to roll back; the module's weights now live on the device
        # (resident parts) and in the host copies (units).
        self._original.clear()
        self.module_count = sum(1 for _ in self.module.modules())
        self.tensor_count = sum(1 for _ in self.module.parameters())
        self.setup_seconds = time.perf_counter() - t

    def _owner(self, dotted: str) -> Tuple[torch.nn.Module, str]:
        parent, _, attr = dotted.rpartition(".")
        return (self.module.get_submodule(parent) if parent else self.module), attr

    def _pack(self, name: str, module: torch.nn.Module, params: List[torch.nn.Parameter]) -> _Unit:
        """Copies a unit's weights into one host buffer (pinned when possible)."""
        views = []
        offset = 0
        for p in params:
            offset = (offset + 255) // 256 * 256
            nbytes = p.numel() * p.element_size()
            views.append((offset, nbytes, p.dtype, p.shape))
            offset += nbytes
        flat = torch.empty(offset, dtype=torch.uint8)
        if self.pin:
            try:
                flat = flat.pin_memory()
                self.pinned_bytes += offset
            except RuntimeError:
                self.pin = False  # continue unpinned for the rest of this attach
        host = []
        for p, (o, n, dtype, shape) in zip(params, views):
            v = flat[o : o + n].view(dtype).view(shape)
            v.copy_(p.data)
            host.append(v)
        return _Unit(name, module, params, host, flat=flat, views=views, nbytes=offset)

    def _device_views(self, u: _Unit, flat: torch.Tensor) -> List[torch.Tensor]:
        return [flat[o : o + n].view(dtype).view(shape) for o, n, dtype, shape in u.views]

    def detach(self) -> None:
        """Removes the hooks. During a failed attach every parameter gets its original tensor
        back; after a successful one, unit weights stay on their host copies and resident parts
        on the device."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for p in self.module.parameters():
            original = self._original.get(id(p))
            if original is not None:
                p.data = original
        for u in self.units:
            for p, h in zip(u.params, u.host):
                if not self._original:
                    p.data = h
        self.units.clear()

    # ---- hooks ------------------------------------------------------------------------------

    def _root_pre(self, _module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        self.stats.passes += 1
        if self.order is None and self.current:
            self.order = list(self.current)
        self.current = []
        self.position = 0
        self.lookahead = True
        return _move_inputs(args, self.device), _move_inputs(kwargs, self.device)

    def _observe(self, i: int) -> bool:
        if self.order is None:
            self.current.append(i)
            on_track = i == len(self.current) - 1
        else:
            on_track = self.position < len(self.order) and self.order[self.position] == i
            self.position += 1
        if not on_track and self.lookahead:
            self.lookahead = False
            for u in self.units:
                if u.prefetched:
                    u.prefetched = False
                    self.stats.prefetch_cancels += 1
        return on_track

    def _upload(self, u: _Unit) -> None:
        t = time.perf_counter()
        if self.cuda:
            assert self.side is not None
            with torch.cuda.stream(self.side):
                u.device_flat = u.flat.to(self.device, non_blocking=True)
                u.device_copies = self._device_views(u, u.device_flat)
                u.ready = torch.cuda.Event()
                u.ready.record(self.side)
        else:
            u.device_flat = u.flat.clone()
            u.device_copies = self._device_views(u, u.device_flat)
            u.ready = None
        self.stats.uploads += 1
        self.stats.upload_bytes += u.nbytes
        self.stats.upload_seconds += time.perf_counter() - t

    def _pre_hook(self, i: int):
        def hook(_module: torch.nn.Module, _args: tuple) -> None:
            u = self.units[i]
            on_track = self._observe(i)
            if u.device_copies is None:
                self.stats.prefetch_misses += 1
                self._upload(u)
            else:
                self.stats.prefetch_hits += 1
            u.prefetched = False
            if self.cuda:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(u.ready)
                u.device_flat.record_stream(current)
            for p, d in zip(u.params, u.device_copies):
                p.data = d
            if on_track and self.lookahead and self.cuda:
                order = self.order or list(range(len(self.units)))
                pos = order.index(i) if i in order else -1
                for j in order[pos + 1 : pos + 1 + self.depth]:
                    n = self.units[j]
                    if n.device_copies is None:
                        self._upload(n)
                        n.prefetched = True
            if self.cuda:
                used = torch.cuda.memory_allocated(self.device)
                self.stats.peak_bytes = max(self.stats.peak_bytes or 0, used)

        return hook

    def _post_hook(self, i: int):
        def hook(_module: torch.nn.Module, _args: tuple, _output: Any) -> None:
            u = self.units[i]
            for p, h in zip(u.params, u.host):
                p.data = h
            u.device_copies = None
            u.device_flat = None
            u.ready = None

        return hook

    # ---- lifecycle --------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Waits for all work of the execution device (completion proof)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def streamed_bytes(self) -> int:
        """Bytes uploaded per pass."""
        return sum(u.nbytes for u in self.units)

    def unload(self) -> None:
        """After completion, replaces every weight (parameter) with a meta placeholder and drops the
        host copies; buffers stay."""
        self.synchronize()
        for u in self.units:
            u.device_copies = None
            u.device_flat = None
            u.host = []
            u.flat = None
        for name, p in list(self.module.named_parameters()):
            owner, attr = self._owner(name)
            meta = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
            setattr(owner, attr, meta)
        self._original.clear()

    def is_unloaded(self) -> bool:
        """Whether :meth:`unload` ran."""
        return any(p.is_meta for p in self.module.parameters())


def _refuse(module: torch.nn.Module) -> None:
    if module.training:
        raise DynamicOffloadError(
            f"{type(module).__name__} is in training mode; ddo offloads inference only: call module.eval() first"
        )
