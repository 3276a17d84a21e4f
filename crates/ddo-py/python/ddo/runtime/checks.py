"""Parameter change detection: every forward compares each managed parameter with the one ddo
published (identity, address, in-place writes, grad), the host tensors streamed from, and
parameters added after attach (adapters), and refuses a change it cannot serve correctly."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from .. import _native
from .guards import guard_new_adapter_classes, refuse_traced
from .placeholder import StreamedWeight
from .torch_internals import TENSOR_IDENTITY, VERSION, has_storage, plain_tensor_methods
from .values import any_requires_grad

__all__ = ["AddedParameter", "Checks", "OwnerParameters", "PlaceColumns", "SourceTensor", "WatchedPlace", "address_of", "watch_structure"]


class WatchedPlace(NamedTuple):
    """A managed place as last published: its owner, attribute, the parameter there, the address
    it views (``None``: a placeholder without storage) and its in-place write counter."""

    owner: torch.nn.Module
    attr: str
    param: torch.nn.Parameter
    address: Optional[int]
    version: int


class PlaceColumns(NamedTuple):
    """The places of one hooked unit as each forward compares them, column by column: owners'
    parameter dicts, attributes and parameters; the parameters with an address, their versions
    and addresses; those without one (placeholders) and their tensors."""

    dicts: List[dict]
    attrs: List[str]
    params: List[torch.nn.Parameter]
    addressed: List[torch.nn.Parameter]
    versions: List[int]
    addresses: List[int]
    unaddressed: List[torch.nn.Parameter]
    tensors: List[int]


class SourceTensor(NamedTuple):
    """A host tensor the linear route streams from, and its write counter at attach."""

    name: str
    tensor: torch.Tensor
    version: int


class AddedParameter(NamedTuple):
    """A parameter the module gained after attach (an adapter), where the last walk found it."""

    owner: torch.nn.Module
    attr: str
    param: torch.nn.Parameter
    address: int


class OwnerParameters(NamedTuple):
    """A module owning managed places, and its parameter dict as published."""

    owner: torch.nn.Module
    parameters: Dict[str, Any]


_DATA_PTR = torch.Tensor.data_ptr
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_NO_PLACES = PlaceColumns([], [], [], [], [], [], [], [])


def address_of(p: torch.Tensor) -> Optional[int]:
    """The address a parameter views, or ``None`` for a placeholder (no storage; one given data
    by ``.data =`` has an address, so the change is seen)."""
    return p.data_ptr() if has_storage(p) else None


def _places_unchanged(group: PlaceColumns, grad: bool) -> bool:
    """Whether a group of places (see ``Checks.checked``) holds its parameters as
    published: column by column, in C-level loops (about a tenth of a microsecond per
    parameter). A parameter requiring grad matters only where autograd records."""
    dicts, attrs, params, addressed, versions, addresses, unaddressed, tensors = group
    try:
        return (
            all(map(operator.is_, map(dict.get, dicts, attrs), params))
            and list(map(VERSION, addressed)) == versions
            and list(map(_DATA_PTR, addressed)) == addresses
            and list(map(TENSOR_IDENTITY, unaddressed)) == tensors
            and not (grad and any(map(_REQUIRES_GRAD, params)))
        )
    except RuntimeError:  # data_ptr() of data given no storage
        return False


# Bumped whenever any module registers a parameter or a submodule (an adapter being added), so
# a forward walks its module tree only when the tree may have changed.
_STRUCTURE = [0]
_WATCHING: List[Any] = []


def _structure_changed(*_args: Any) -> None:
    _STRUCTURE[0] += 1


def watch_structure() -> None:
    if not _WATCHING:
        from torch.nn.modules import module as nn_module

        _WATCHING.append(nn_module.register_module_parameter_registration_hook(_structure_changed))
        _WATCHING.append(nn_module.register_module_module_registration_hook(_structure_changed))


class Checks:
    """What each forward compares (part of :class:`SessionRuntime`): the record of the last
    publish, and the comparisons that refuse a changed parameter."""

    module: torch.nn.Module
    device: torch.device
    places: list
    swaps: dict

    if TYPE_CHECKING:

        def _settle_leases(self, what: str, streamed_only: bool) -> None: ...

    def _init_checks(self) -> None:
        # Every parameter as published (by identity), with the address it views.
        self.published: Dict[int, Tuple[torch.nn.Parameter, Optional[int]]] = {}
        self.swap_views: Dict[int, torch.Tensor] = {}
        self.watched: List[WatchedPlace] = []
        # The same as columns, as each forward compares them, grouped by the hooked unit the
        # place belongs to (``None``: outside every hooked unit).
        self.checked: Dict[Optional[int], PlaceColumns] = {}
        self.placeholder_tensors: List[int] = []
        # Hooked units whose places the running pass has not compared yet: each is compared in
        # its block's pre-hook (while the GPU runs the blocks before it), the rest at the pass's
        # end, before its output is returned.
        self.pass_unchecked: set = set()
        # The module path of every hooked (not pinned) unit.
        self.unit_paths: Dict[str, int] = {}
        self.watched_names: List[str] = []
        # The record above matches the last complete publish (views or placeholders).
        self.watched_whole: bool = False
        self.owners: List[OwnerParameters] = []
        self.sources: List[SourceTensor] = []
        # The structure count at the last full walk of the module tree (-1: none yet), and the
        # adapter layers it found.
        self.walked = -1
        self.adapter_layers: List[Tuple[str, torch.nn.Module]] = []
        self.added: List[AddedParameter] = []

    def _record_published(self) -> None:
        """What the next check compares with: every place's parameter as published now."""
        current = [(owner, attr, owner._parameters.get(attr), name) for owner, attr, name in self.places]
        current = [c for c in current if c[2] is not None]
        self.published = {id(p): (p, address_of(p)) for _, _, p, _ in current}
        # Streamed units' views, in place only inside their forwards (a publish puts them back).
        self.swap_views = {id(view): view for places in self.swaps.values() for _, _, view, _ in places}
        self.watched = [WatchedPlace(owner, attr, p, address_of(p), VERSION(p)) for owner, attr, p, _ in current]
        self.watched_names = [name for *_, name in current]
        # The same, as each forward compares it: the owner's parameter dict (each owner's dict is
        # checked to be still its own).
        w = self.watched
        # A streamed unit's placeholder refuses every write itself (its dispatch, its `.data`), so
        # only its identity and tensor are compared; other parameters by version and address.
        # Placeholders (no address, or address 0) also have their tensor checked: two swapped
        # with torch.utils.swap_tensors keep their objects, addresses and versions.
        self.placeholder_tensors = [TENSOR_IDENTITY(p) for _, _, p, ptr, _ in w if not ptr]
        groups: Dict[Optional[int], PlaceColumns] = {}
        for (owner, attr, p, ptr, version), name in zip(w, self.watched_names):
            dicts, attrs, params, addressed, versions, addresses, unaddressed, tensors = groups.setdefault(
                self._unit_of(name), PlaceColumns([], [], [], [], [], [], [], [])
            )
            dicts.append(owner._parameters)
            attrs.append(attr)
            params.append(p)
            if ptr is not None and not isinstance(p, StreamedWeight):
                addressed.append(p)
                versions.append(version)
                addresses.append(ptr)
            if not ptr:
                unaddressed.append(p)
                tensors.append(TENSOR_IDENTITY(p))
        self.checked = groups
        self.owners = list({id(owner): OwnerParameters(owner, owner._parameters) for owner, _, _ in self.places}.values())

    def _refuse_changes(self) -> None:
        """Refuses a parameter changed since the last publish before anything publishes again
        (unload, reload, reclaim, a re-plan): publishing again would undo the change silently.
        Refused too while a block runs in another thread: its weights must stay where it reads
        them."""
        self._settle_leases("this change between passes", streamed_only=False)
        if self.watched_whole:
            with plain_tensor_methods():
                self._check_places(grad=False)

    def _check_module(self, args: tuple, kwargs: dict) -> None:
        """Refuses a forward the arena cannot serve correctly: training or gradients (autograd
        would keep views of slot memory that later blocks reuse), and parameters changed after
        attach (a dtype or device move, an assignment: they no longer view the arena)."""
        if self.module.training:
            raise _native.DynamicOffloadLifecycleError(
                f"{type(self.module).__name__} is in training mode; ddo offloads inference only: call module.eval()"
            )
        if torch.is_grad_enabled() and any_requires_grad((args, kwargs)):
            raise _native.DynamicOffloadLifecycleError(
                "an input requires grad; ddo offloads inference only (gradients would read block memory that later "
                "blocks reuse): run the forward under torch.no_grad() or torch.inference_mode()"
            )
        refuse_traced(f"{type(self.module).__name__}'s forward")
        # Runs every forward: plain tensor methods, not a parameter subclass's __torch_function__
        # (Diffusers' GGUFParameter wraps each call).
        with plain_tensor_methods():
            self._check_parameters()

    def _check_parameters(self) -> None:
        # Every forward: each parameter still the one published, at its address, not written
        # in place, without grad (those of hooked units in their blocks' pre-hooks); the host
        # tensors streamed from unwritten; added ones usable.
        self._check_places(units=False)
        for name, p, version in self.sources:
            if VERSION(p) != version:
                raise _native.DynamicOffloadSourceChangedError(
                    f"the host tensor of parameter {name}, which ddo streams from, was written since ddo attached "
                    "(through a reference to it: one kept from before, or a state_dict() value): blocks already on the "
                    "device would not see the write. "
                    "Call remove_dynamic_offload(module) first, change the weights, then offload the module again"
                )
        self._check_added_parameters()

    def _check_places(self, grad: Optional[bool] = None, units: bool = True) -> None:
        """Each managed place still holds the parameter published there, at its address, not
        written in place, and (where autograd records: ``grad``, by default the grad mode) without
        grad. With ``units`` false only the places outside the hooked units are compared (a pass
        compares each unit's in its block's pre-hook: :meth:`_check_unit`)."""
        grad = torch.is_grad_enabled() if grad is None else grad
        if len(self.watched) != len(self.places):
            self._refuse_changed_parameter(grad)
        changed = next((o for o, params in self.owners if o.__dict__.get("_parameters") is not params), None)
        if changed is not None:
            raise _native.DynamicOffloadLifecycleError(
                f"the parameters of {type(changed).__name__} were replaced as a whole since ddo attached: call "
                "remove_dynamic_offload(module) first, change the module, then offload it again"
            )
        groups = self.checked.values() if units else [self.checked.get(None, _NO_PLACES)]
        if not all(_places_unchanged(group, grad) for group in groups):
            self._refuse_changed_place(grad)

    def _check_unit(self, unit: int) -> None:
        """The places of a hooked unit, compared once per pass before its block first runs (in
        whichever thread enters it first: a streamed unit's placeholders are then in place)."""
        if unit in self.pass_unchecked:
            grad = torch.is_grad_enabled()
            if not _places_unchanged(self.checked[unit], grad):
                self._refuse_changed_place(grad)
            # Compared: a refusal leaves it to be compared again where the block runs next.
            self.pass_unchecked.discard(unit)

    def _check_unreached_units(self) -> None:
        """The end of a pass: the places of the hooked units whose blocks did not run in it (a
        parent may read their weights itself), before the pass's output is returned."""
        grad = torch.is_grad_enabled()
        unchecked, self.pass_unchecked = self.pass_unchecked, set()
        if not all(_places_unchanged(self.checked[u], grad) for u in tuple(unchecked)):
            self._refuse_changed_place(grad)

    def _refuse_changed_place(self, grad: bool) -> None:
        """Raises for the first changed place (a fast comparison found one)."""
        at = self._first_changed_place(grad)
        if at is None:
            # Changed back between the two comparisons (another thread): refused all the same.
            raise _native.DynamicOffloadLifecycleError(
                f"the parameters of {type(self.module).__name__} changed during this forward (another thread wrote "
                "them): call remove_dynamic_offload(module) first, change the module, then offload it again"
            )
        self._refuse_changed_parameter(grad)
        # Each parameter in place is one ddo published, at its own address: two traded places.
        raise _native.DynamicOffloadLifecycleError(
            f"parameter {self.watched_names[at]} now holds another of the module's parameters (exchanged or tied "
            "since ddo attached): call remove_dynamic_offload(module) first, change the module, then offload it again"
        )

    def _unit_of(self, name: str) -> Optional[int]:
        """The hooked unit below the module's root whose module holds the parameter ``name``
        (the innermost), or ``None`` (compared at the pass's start: a unit at the root runs its
        pre-hook before the pass begins)."""
        path = name
        while "." in path:
            path = path.rsplit(".", 1)[0]
            unit = self.unit_paths.get(path)
            if unit is not None:
                return unit
        return None

    def _first_changed_place(self, grad: bool) -> Optional[int]:
        """The index of the first place whose parameter changed, or ``None``."""
        tensors = iter(self.placeholder_tensors)
        for i, (owner, attr, p, ptr, version) in enumerate(self.watched):
            try:
                if (
                    owner._parameters.get(attr) is not p
                    or (grad and p.requires_grad)
                    or (
                        ptr is not None
                        and not isinstance(p, StreamedWeight)
                        and (VERSION(p) != version or p.data_ptr() != ptr)
                    )
                    or (not ptr and TENSOR_IDENTITY(p) != next(tensors))
                ):
                    return i
            except RuntimeError:  # data_ptr() of data given no storage
                return i
        return None

    def _refuse_changed_parameter(self, grad: bool = True) -> None:
        """Raises for the first managed parameter changed since it was published (requiring grad
        counts with ``grad``)."""
        published = self.published
        for (owner, attr, p, _ptr, version), name in zip(self.watched, self.watched_names):
            if owner._parameters.get(attr) is p and VERSION(p) != version:
                raise _native.DynamicOffloadLifecycleError(
                    f"parameter {name} was written in place since ddo attached: its values come from the checkpoint "
                    "(or the module's host tensors), so the write would be lost at the next reload and state_dict() "
                    "would not show it. Call remove_dynamic_offload(module) first, change the weights, then offload "
                    "the module again"
                )
        for owner, attr, name in self.places:
            p = owner._parameters.get(attr)
            seen = published.get(id(p))
            if seen is None or p is not seen[0] or address_of(p) != seen[1]:
                raise _native.DynamicOffloadLifecycleError(
                    f"parameter {name} was changed after ddo attached (a dtype or device move, or an assignment): "
                    "call remove_dynamic_offload(module) first, change the module, then offload it again"
                )
            if grad and p.requires_grad:
                raise _native.DynamicOffloadLifecycleError(
                    f"parameter {name} requires grad; ddo offloads inference only (its memory is reused between blocks): "
                    "run the forward under torch.no_grad() or torch.inference_mode(), or call requires_grad_(False)"
                )

    def _check_added_parameters(self) -> None:
        published = self.published
        guard_new_adapter_classes()
        # One walk over the modules, when a parameter or module was registered anywhere since the
        # last one, or gradients are on: parameters added after attach (adapters such as LoRA) are
        # the module's own (on the execution device; trainable ones only without gradients), and
        # no adapter may be merged into a streamed weight.
        structure = _STRUCTURE[0]
        if structure == self.walked and not torch.is_grad_enabled():
            for path, m in self.adapter_layers:
                self._check_unmerged(path, m)
            # The module's own parameters found by the last walk: replaced or moved since (.to())?
            if all(m._parameters.get(attr) is p and p.data_ptr() == ptr for m, attr, p, ptr in self.added):
                return
        layers, added = [], []
        for path, m in self.module.named_modules():
            if hasattr(m, "merged_adapters"):
                layers.append((path, m))
                self._check_unmerged(path, m)
            for attr, p in m._parameters.items():
                if p is not None and id(p) not in published:
                    self._check_added(f"{path}.{attr}" if path else attr, p)
                    added.append(AddedParameter(m, attr, p, p.data_ptr()))
        self.adapter_layers, self.added, self.walked = layers, added, structure

    @staticmethod
    def _check_unmerged(path: str, m: torch.nn.Module) -> None:
        if m.merged_adapters:
            raise _native.DynamicOffloadLifecycleError(
                f"adapters {m.merged_adapters} were fused into {path or 'the module'}, whose weights stream from "
                "their source: the fused values would be lost at the next upload. Restore the weights with "
                "result.unload() and result.reload() and use the adapters unfused"
            )

    def _check_added(self, name: str, p: torch.nn.Parameter) -> None:
        if p.is_meta:
            raise _native.DynamicOffloadLifecycleError(
                f"parameter {name} (added after ddo attached) has no values: it is meta (added while the weights "
                "were placeholders after reclaim() or unload(), or moved there): delete it (delete_adapters) and add "
                "it again after a forward or reload()"
            )
        if p.device != self.device:
            raise _native.DynamicOffloadLifecycleError(
                f"parameter {name} was added after ddo attached and is on {p.device}, not on the execution device "
                f"{self.device}: move it there (adapters are resident beside the streamed weights)"
            )
        if p.requires_grad and torch.is_grad_enabled():
            raise _native.DynamicOffloadLifecycleError(
                f"parameter {name} requires grad; ddo offloads inference only: run the forward under "
                "torch.no_grad() or torch.inference_mode()"
            )
