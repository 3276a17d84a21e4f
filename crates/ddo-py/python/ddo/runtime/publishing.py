"""Publishing: the module's parameters become zero-copy DLPack views of the session's arena
(resident units), placeholders that swap a view in around each block (streamed units), or meta
placeholders (unloaded); ``state_dict()`` and a placeholder's reads give the source's values."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Tuple, cast

import torch
import torch.utils.dlpack

from .. import _native
from .placeholder import StreamedWeight
from .torch_internals import StorageWeakRef, storage_use_count

__all__ = ["Holds", "Place", "Publishing", "Swap", "SwapUpdates", "ViewRange"]


class Place(NamedTuple):
    """Where a managed parameter (or buffer) lives: its owning module, the attribute, and its name
    at attach. Held by module object, not by path, so wrappers that move a layer (adapters) keep
    it found."""

    owner: torch.nn.Module
    attr: str
    name: str


class Swap(NamedTuple):
    """A streamed unit's place: the view of arena memory in place while the unit's forward runs,
    the placeholder between passes."""

    owner: torch.nn.Module
    attr: str
    view: torch.nn.Parameter
    placeholder: torch.nn.Parameter


class ViewRange(NamedTuple):
    """The device addresses ``[start, end)`` a streamed view covers, and its parameter's name."""

    start: int
    end: int
    name: str


class SwapUpdates(NamedTuple):
    """A unit's swap as one update per owner's parameter dict: ``dicts[i].update(updates[i])``."""

    dicts: List[dict]
    updates: List[dict]


class Holds(NamedTuple):
    """References to a view and tensors sharing its memory, as counted the same way each time."""

    references: int
    storage_uses: int


def held_beyond(now: Holds, published: Optional[Holds]) -> bool:
    """Whether either count exceeds what ddo itself held at publish (unknown: assume so)."""
    return published is None or now[0] > published[0] or now[1] > published[1]


def holds(view: torch.Tensor) -> Holds:
    """References to a view and tensors sharing its memory: the object's reference count and its
    storage's use count."""
    return Holds(sys.getrefcount(view), storage_use_count(view))


def _parameter_like(old: torch.nn.Parameter, data: torch.Tensor, grad: bool = False) -> torch.nn.Parameter:
    """A parameter over ``data`` in ``old``'s place: ``data`` viewed as ``old``'s dtype and shape
    when the session serves its bytes (fp8, or a quantized framework parameter over a tensor its
    file types otherwise), and of ``old``'s class when that class carries a quantization type
    (Diffusers' ``GGUFParameter``); requiring grad with ``grad``."""
    if data.dtype != old.dtype:
        data = data.view(torch.uint8).view(old.dtype)
    if data.shape != old.shape:
        data = data.reshape(old.shape)
    quant_type = getattr(old, "quant_type", None)
    if quant_type is not None and type(old) is not torch.nn.Parameter:
        kind: Any = type(old)  # a framework's parameter class, taking quant_type
        return kind(data, requires_grad=grad, quant_type=quant_type)
    return torch.nn.Parameter(data, requires_grad=grad)


class Publishing:
    """What the module's parameters are at each moment (part of :class:`SessionRuntime`): views,
    placeholders and the records of both."""

    module: torch.nn.Module
    device: torch.device
    session: Any
    checkpoint: Optional[str]
    published: dict
    swap_views: dict
    watched_whole: bool

    if TYPE_CHECKING:

        def _record_published(self) -> None: ...

        def _unit_path(self, unit: int) -> str: ...

    def _init_publishing(self) -> None:
        # The module's own tensors before attach, by name (the linear route gives them back).
        self.originals: Dict[str, Any] = {}
        self.original_buffers: Dict[str, torch.Tensor] = {}
        # Where each managed parameter and buffer lives.
        self.places: List[Place] = []
        self.buffer_places: List[Place] = []
        # Streamed units' places; the view is in place only while the unit's forward runs.
        self.swaps: Dict[int, List[Swap]] = {}
        # Per streamed view (by identity), the references ddo itself holds (see ``holds``).
        self.view_holds: Dict[int, Holds] = {}
        # The memory of streamed views ddo let go of while the arena stayed (a re-plan refused
        # because the host held views), weakly: what the host kept of them keeps it alive.
        self.retired_views: List[Any] = []
        # The session's streamed units and their parameter names.
        self.streamed: Dict[int, List[str]] = {}
        # Each streamed parameter's shape and dtype as published (what its placeholder reads).
        self.shapes: Dict[str, torch.Tensor] = {}
        # Per streamed unit: the address ranges its views cover.
        self.ranges: Dict[int, List[ViewRange]] = {}
        # The same grouped for the hooks: per unit, owners' parameter dicts with their views
        # and with their placeholders, and the span of the unit's views.
        self.swap_in: Dict[int, SwapUpdates] = {}
        self.swap_out: Dict[int, SwapUpdates] = {}
        self.bounds: Dict[int, Tuple[int, int]] = {}
        # Whether every parameter views the session's arena (a publish ran to its end); a pass
        # publishes again first when an interrupt left it half done.
        self.views_whole: bool = False

    def _publish(self, make: Callable[[str, torch.nn.Parameter], torch.nn.Parameter], failed: Optional[List[str]] = None) -> None:
        """Sets every managed parameter (aliases too) to ``make(name, old)``, one object per key.
        With ``failed``, a place the module no longer has as a parameter (deleted, or re-registered
        by parametrize) is skipped and named there instead of raising."""
        new: Dict[int, torch.nn.Parameter] = {}
        for owner, attr, name in self.places:
            try:
                # A place holding None (a deleted parameter) fails in ``make``, handled below.
                p = cast(torch.nn.Parameter, owner._parameters[attr])
                if id(p) not in new:
                    new[id(p)] = make(name, p)
                setattr(owner, attr, new[id(p)])
            except (KeyError, AttributeError, TypeError, RuntimeError):
                if failed is None:
                    raise
                failed.append(name)

    def _kept_grad(self, p: torch.nn.Parameter) -> bool:
        """Whether a publish keeps ``p`` requiring grad: a flag set on a parameter ddo published
        stays (it matters only where autograd records); at attach, parameters start without."""
        if not p.requires_grad:
            return False
        seen = self.published.get(id(p))
        return (seen is not None and seen[0] is p) or self.swap_views.get(id(p)) is p

    def _publish_views(self) -> None:
        # Views made under inference mode would be inference tensors, which have no version
        # counter for the write guard: a re-plan or reload inside ``torch.inference_mode()``
        # publishes ordinary tensors.
        self.view_holds = {}  # a publish interrupted half way counts nothing as ddo's
        with torch.inference_mode(False):
            self._publish_views_now()
        # What ddo itself holds of each streamed view, counted once the publish's temporaries
        # are gone: a reference beyond these (a tensor a host kept from inside a block's forward,
        # or one derived from it) keeps the slots' memory from being reclaimed.
        self.view_holds = {id(view): holds(view) for places in self.swaps.values() for _, _, view, _ in places}

    def _republish(self) -> None:
        """Publishes the session's views again from whatever state an interrupted publish left
        (an exception or ``KeyboardInterrupt`` half way): the streamed units' views back in their
        places first, so every parameter has its published class again, then fresh views."""
        for places in self.swaps.values():
            for owner, attr, view, placeholder in places:
                view.requires_grad_(placeholder.requires_grad)
                owner._parameters[attr] = view
        self._publish_views()

    def _publish_views_now(self) -> None:
        self.watched_whole = False
        views: Dict[str, torch.Tensor] = {}
        for names in self.session.parameter_names():
            view = torch.utils.dlpack.from_dlpack(self.session.dlpack(names[0]))
            for n in names:
                views[n] = view
        self._publish(lambda name, p: _parameter_like(p, views[name], self._kept_grad(p)))
        for owner, attr, name in self.places:
            view = cast(torch.nn.Parameter, owner._parameters[attr])  # published just above
            self.shapes[name] = torch.empty(view.shape, dtype=view.dtype, device="meta")
        # Streamed units rest on placeholders; their views come back for their forwards.
        unit_of = {name: unit for unit, names in self.streamed.items() for name in names}
        placeholders: Dict[int, torch.nn.Parameter] = {}
        self.swaps = {unit: [] for unit in self.streamed}
        self.ranges = {unit: [] for unit in self.streamed}
        for owner, attr, name in self.places:
            unit = unit_of.get(name)
            if unit is None:
                continue
            view = cast(torch.nn.Parameter, owner._parameters[attr])
            start = view.data_ptr()
            self.ranges[unit].append(ViewRange(start, start + view.numel() * view.element_size(), name))
            if id(view) not in placeholders:
                weight = StreamedWeight(self, name, view, self.device)
                placeholders[id(view)] = torch.nn.Parameter(weight, requires_grad=view.requires_grad)
            self.swaps[unit].append(Swap(owner, attr, view, placeholders[id(view)]))
            owner._parameters[attr] = placeholders[id(view)]
        self._group_swaps()
        self._record_published()
        self.views_whole = self.watched_whole = True

    def _group_swaps(self) -> None:
        """Per streamed unit, its swaps as one update per owner's parameter dict (views in,
        placeholders out), and the span of addresses its views cover."""
        self.swap_in, self.swap_out, self.bounds = {}, {}, {}
        for unit, places in self.swaps.items():
            ins: Dict[int, Tuple[dict, dict, dict]] = {}
            for owner, attr, view, placeholder in places:
                params = owner._parameters
                entry = ins.setdefault(id(params), (params, {}, {}))
                entry[1][attr], entry[2][attr] = view, placeholder
            groups = list(ins.values())
            self.swap_in[unit] = SwapUpdates([g[0] for g in groups], [g[1] for g in groups])
            self.swap_out[unit] = SwapUpdates([g[0] for g in groups], [g[2] for g in groups])
            ranges = self.ranges[unit]
            if ranges:
                self.bounds[unit] = (min(r.start for r in ranges), max(r.end for r in ranges))

    def _publish_meta(self, failed: Optional[List[str]] = None) -> None:
        # Holding the views would keep the arena's memory alive. The views go back first, so
        # the placeholders take their class (a quantized parameter's).
        self.views_whole = False
        self.retired_views = [
            StorageWeakRef(view.untyped_storage()) for places in self.swaps.values() for _, _, view, _ in places
        ]
        for places in self.swaps.values():
            for owner, attr, view, placeholder in places:
                if failed is None or attr in owner._parameters:
                    view.requires_grad_(placeholder.requires_grad)
                    owner._parameters[attr] = view
        self.swaps = {}
        self.ranges = {}
        self.view_holds = {}
        self._group_swaps()
        # Ordinary tensors (with version counters) also under inference mode, as for the views.
        with torch.inference_mode(False):
            self._publish(
                lambda _n, p: _parameter_like(p, torch.empty(p.shape, dtype=p.dtype, device="meta"), self._kept_grad(p)),
                failed,
            )
            # Recorded last: a publish interrupted before here is checked for writes at the next
            # pass; a reload checks the placeholders against this record.
            self.watched_whole = False
            self._record_published()
        self.watched_whole = True

    def _state_dict_hook(self, owned: Dict[str, str]) -> Callable[..., None]:
        """A hook for one module: outside a forward a streamed parameter's view shows whatever
        unit its slot holds, so ``state_dict()`` (of this module or any module above it) gives
        each parameter's own values instead. ``owned`` maps the module's attribute names to the
        parameters' full names."""

        def hook(_m: torch.nn.Module, state: dict, prefix: str, _meta: Any) -> None:
            for attr, full in owned.items():
                key = prefix + attr
                if key in state:
                    state[key] = self._source_value(full, state[key])

        return hook

    def _source_value(self, name: str, like: torch.Tensor) -> torch.Tensor:
        original = self.originals.get(name)
        if original is not None and not original.is_meta and self.checkpoint is None:
            return original.detach()
        if self.session.is_unloaded():
            return like  # meta placeholders while unloaded
        raw = bytearray(self.session.source_tensor(name))
        if len(raw) != like.numel() * like.element_size():
            raise _native.DynamicOffloadLifecycleError(
                f"parameter {name} was changed after ddo attached (it is {like.dtype} {list(like.shape)}, its source "
                f"holds {len(raw)} bytes): call remove_dynamic_offload(module) first, change the module, then offload "
                "it again"
            )
        return torch.frombuffer(raw, dtype=like.dtype).reshape(like.shape) if raw else torch.empty(like.shape, dtype=like.dtype)

    def _kept_streamed_views(self) -> List[str]:
        """The blocks whose streamed views something beyond ddo still references (between
        passes, when ddo's own references are the ones counted at publish)."""
        counted = self.view_holds
        kept = [
            self._unit_path(unit)
            for unit, places in self.swaps.items()
            if any(held_beyond(holds(view), counted.get(id(view))) for _, _, view, _ in places)
        ]
        self.retired_views = [r for r in self.retired_views if not r.expired()]
        if self.retired_views:
            kept.append(f"{len(self.retired_views)} weights from before a re-plan refused while they were held")
        return kept
