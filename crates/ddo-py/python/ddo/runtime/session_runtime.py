"""One module attached to a component session: attach, re-plans, unload and reload, detach. The
parts live in their own modules: :mod:`.hooks` (passes, hooks, the lease ledger),
:mod:`.publishing` (views and placeholders), :mod:`.checks` (parameter change detection),
:mod:`.guards` (refusals) and :mod:`.auto_budget`."""

from __future__ import annotations

import contextlib
import gc
import json
import warnings
from typing import Any, Dict, List, Optional

import torch

from .. import _native
from .auto_budget import AutoBudget, auto_budget_of
from .checks import Checks, SourceTensor, watch_structure
from .guards import ATTACHED, Guards, check_layer_route, guard_adapter_merges
from .hooks import Hooks, current_stream, stream_reader
from .module_tree import describe_module, host_tensors, layer_paths, owner_of
from .publishing import Place, Publishing
from .torch_internals import VERSION, register_load_state_dict_pre_hook, register_state_dict_hook

__all__ = ["SessionRuntime", "report_drop_failures"]


def report_drop_failures() -> None:
    """Warns about releases that failed when ddo's memory was dropped (a component collected, or
    the last tensor viewing an unloaded arena): what could not be released is kept, never freed
    by force, and each warning says how much."""
    failures, more = _native.take_drop_failures()
    if more:
        failures.append(f"{more} more releases failed when dropped")
    if failures:
        # One warning for all of them: under warnings-as-errors the exception carries every note.
        warnings.warn("ddo: " + "; ".join(failures), RuntimeWarning, stacklevel=3)


class SessionRuntime(Hooks, Publishing, Checks, Guards):
    """One module attached to a session (routes ``linear_runtime``, ``linear_convolution``,
    ``vmm_fast_runtime`` and ``vmm_runtime``; the last two read the checkpoint the module was
    loaded from)."""

    def __init__(self, module: torch.nn.Module, plan: Any, *, checkpoint: Optional[str] = None) -> None:
        self.module = module
        self.plan = plan
        self.checkpoint = checkpoint
        self.session: Any = None
        self.device = torch.device("cpu")
        self.detached = False
        self.route = str(json.loads(plan.json())["route"]["name"]) if plan is not None else ""
        # The automatic GPU budget (auto_budget_policy = balanced), set at attach.
        self.auto_budget: Optional[AutoBudget] = None
        self._init_hooks()
        self._init_publishing()
        self._init_checks()

    def attach(self) -> None:
        """Opens the session and publishes the views. On any error the module is left as it was."""
        report_drop_failures()
        modules, params = describe_module(self.module)
        layers = layer_paths(self.module)
        if json.loads(self.plan.json())["route_facts"]["layer_units"]:
            check_layer_route(self.module, layers)
        if self.checkpoint is not None:
            self.session = _native.Session(self.plan, modules, params, path=self.checkpoint, layers=layers)
        else:
            storages, rows = host_tensors(self.module)
            self.session = _native.Session(
                self.plan, modules, params, storages=storages, tensors=rows, layers=layers
            )
        self.auto_budget = auto_budget_of(self, self.plan)
        try:
            self._attach_module()
        except BaseException:
            # An error or an interrupt half way: hooks, guards and parameters go back as they were.
            with contextlib.suppress(BaseException):
                self._detach(restore=True)
            raise

    def _attach_module(self) -> None:
        kind, index = self.session.device()
        self.device = torch.device(kind, index) if kind == "cuda" else torch.device("cpu")
        self.stream = stream_reader(self.device)
        self.originals = dict(self.module.named_parameters(remove_duplicate=False))
        # The module's own host tensors the linear route streams from: an in-place write into
        # one (a reference kept from before attach) bumps its version.
        self.sources = [] if self.checkpoint is not None else [SourceTensor(n, p, VERSION(p)) for n, p in self.originals.items()]
        self.places = [Place(*owner_of(self.module, name), name) for name in self.originals]
        self.streamed = dict(self.session.streamed_units())
        self.unit_paths = {name: unit for unit, name, pinned in self.session.units() if not pinned}
        self._publish_views()
        for name, b in list(self.module.named_buffers()):
            self.original_buffers[name] = b
            owner, attr = owner_of(self.module, name)
            self.buffer_places.append(Place(owner, attr, name))
            setattr(owner, attr, b.to(self.device))
        if "fuse_lora" not in self.module.__dict__ and hasattr(self.module, "fuse_lora"):
            setattr(self.module, "fuse_lora", self._refuse_fuse)
        guard_adapter_merges()
        watch_structure()
        ATTACHED.add(self)
        for unit, name, pinned in self.session.units():
            if not pinned:
                m = self.module.get_submodule(name)
                self.handles.append(m.register_forward_pre_hook(self._pre(unit)))
                self.handles.append(m.register_forward_hook(self._post(unit), always_call=True))
        self._wrap_forward()
        self._guard_moves()
        for path, m in self.module.named_modules(remove_duplicate=False):
            owned = {attr: f"{path}.{attr}" if path else attr for attr, p in m._parameters.items() if p is not None}
            if owned:
                self.handles.append(register_state_dict_hook(m, self._state_dict_hook(owned)))
        self.handles.append(register_load_state_dict_pre_hook(self.module, self._refuse_load))
        if self.checkpoint is not None:
            # The native route never reads the tensors the module held before attach (a loader's
            # private mapping of the checkpoint among them): keep none alive.
            self.originals = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in self.originals.items()}
            self.original_buffers = {}

    def switch_encoding(self) -> bool:
        """``vmm_weight_encoding = auto`` found the passes transfer-bound: the session attaches
        again with the streamed units encoded (new addresses) and the new views are published,
        as a budget change does. ``False`` when tensors kept by the host still view the arena
        (the component stays raw)."""
        self._refuse_changes()
        self.synchronize()
        try:
            self._publish_meta()
            changed = self.session.switch_encoding()
            if changed:
                self.retired_views = []  # a new arena (none of the old one's views was held)
        finally:
            if not self.session.is_unloaded():
                self.streamed = dict(self.session.streamed_units())
                self._republish()
        return changed

    def set_budget(self, total: int) -> bool:
        """Plans the arena again under ``total`` bytes between passes (the caller holds the
        forward lock or is at the end of a pass): the views go, the arena is rebuilt, the new
        views are published. ``False`` when tensors kept by the host still view the arena."""
        self._refuse_changes()
        self.synchronize()
        try:
            self._publish_meta()
            changed = self.session.set_budget(int(total))
            if changed:
                self.retired_views = []  # a new arena (none of the old one's views was held)
        finally:
            # However the re-plan ended (refused, interrupted half way), the module views the
            # arena the session holds now, unless nothing fits any more (unloaded).
            if not self.session.is_unloaded():
                self.streamed = dict(self.session.streamed_units())
                self._republish()
        return changed

    def synchronize(self) -> None:
        """Waits for the execution device's work (the host backend's is already complete)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def metrics(self, phase: Optional[str] = None) -> Dict[str, Any]:
        """The session's metrics snapshot as a dict."""
        return json.loads(self.session.metrics(phase))

    def warnings(self) -> List[str]:
        return list(self.session.warnings())

    def reclaim(self) -> tuple:
        """Releases idle slot memory. Streamed parameters are placeholders between passes (their
        views are in place only while their block runs); resident ones keep their memory."""
        self._not_inside_forward("reclaim()")
        with self.forward_lock:
            self._refuse_changes()
            self.synchronize()
            self._rest_all()
            kept = self._kept_streamed_views()
            if kept:
                gc.collect()  # a view only a garbage cycle holds (a traceback) holds nothing
                kept = self._kept_streamed_views()
            if kept:
                warnings.warn(
                    f"ddo: reclaim() kept the execution slots of {type(self.module).__name__}: tensors taken from "
                    f"the weights of its streamed blocks during a forward ({', '.join(kept[:3])}"
                    f"{f' and {len(kept) - 3} more' if len(kept) > 3 else ''}) still view slot memory, which "
                    "reclaiming would free under them. Drop those references (or clone them inside the forward), "
                    "then call reclaim() again",
                    stacklevel=3,
                )
                return (0, 0)
            return self.session.reclaim()

    def unload(self) -> None:
        """Parameters become meta placeholders and the arena's memory is freed (after a forward
        running in another thread ends)."""
        self._not_inside_forward("unload()")
        with self.forward_lock:
            self._unload()

    def _unload(self) -> None:
        self._refuse_changes()
        self.synchronize()
        self._publish_meta()
        self.leases.clear()
        self.session.release_leases(current_stream(self.device))
        if not self.session.unload():
            warnings.warn(
                f"ddo: tensors kept from {type(self.module).__name__} still view its device memory; it is freed "
                "when the last of them is dropped",
                stacklevel=3,
            )
        report_drop_failures()

    def reload(self) -> None:
        """Attaches again (new addresses) and publishes the new views, after a forward running in
        another thread ends (a forward waits for the reload)."""
        self._not_inside_forward("reload()")
        with self.forward_lock:
            self._refuse_changes()
            self.session.reload()
            self.retired_views = []  # what the host kept holds the old arena's memory, not this one's
            try:
                self._publish_views()
            except BaseException:
                # Interrupted half way: the views the reloaded session holds, whole.
                self._republish()
                raise

    def is_unloaded(self) -> bool:
        return self.session.is_unloaded()

    def detach(self) -> None:
        """Removes the hooks and closes the session after the device's work completed. Host
        tensors the module had (linear route) are put back; weights that lived only in the
        arena (native route) become meta placeholders. Waits for a forward running in another
        thread to end."""
        self._not_inside_forward("remove()")
        with self.forward_lock:
            self._detach()

    def _detach(self, restore: bool = False) -> None:
        """``restore``: put the module's own tensors back on either route (an attach that did
        not complete)."""
        self.detached = True
        ATTACHED.discard(self)
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for name in self.entries or ["forward"]:
            self.module.__dict__.pop(name, None)
        self._remove_guards()
        self.published, self.watched, self.watched_names, self.owners = {}, [], [], []
        self.swap_views = {}
        self.checked = {}
        self.pass_unchecked = set()
        self.placeholder_tensors = []
        self.watched_whole = False
        if self.session is None:
            return
        self.synchronize()
        # Places the module no longer has as they were (a parameter deleted, or re-registered by
        # parametrize) are skipped: the session is closed whatever the module became.
        failed: List[str] = []
        try:
            if self.checkpoint is None or restore:
                for places, originals in ((self.places, self.originals), (self.buffer_places, self.original_buffers)):
                    for owner, attr, name in places:
                        if name in originals:
                            try:
                                setattr(owner, attr, originals[name])
                            except (KeyError, AttributeError, TypeError, RuntimeError):
                                failed.append(name)
            else:
                self._publish_meta(failed)
        finally:
            if not self.session.is_unloaded():
                self.leases.clear()
                self.session.release_leases(current_stream(self.device))
                self.session.unload()
            report_drop_failures()
        if failed:
            warnings.warn(
                f"ddo: {len(failed)} weight(s) of {type(self.module).__name__} could not be given back ({', '.join(failed[:3])}"
                f"{', ...' if len(failed) > 3 else ''}): the module no longer has them as they were (deleted, or "
                "re-registered by parametrize) since ddo attached; its other weights are given back",
                stacklevel=3,
            )
