"""What the entry points return (:class:`DynamicOffloadApplyResult`, :class:`DynamicOffloadLoadResult`,
:class:`DiffusersGroupOffloadResult`), and the ledger of modules ddo offloads: one offload per
module tree at a time."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Optional, Sequence, Union

import torch

from . import _native
from . import profiles as _profiles
from .compat import journal as _journal, phases as _phases, state as _state, timing as _timing
from .compat.hook import DynamicOffloadHook
from .compat.layout import inspect_vmm_component
from .errors import DynamicOffloadError
from .log import get_logger, info
from .metrics import DynamicOffloadMetrics
from .runtime import SessionRuntime
from .settings import DynamicOffloadSettings

__all__ = [
    "DiffusersGroupOffloadResult",
    "DynamicOffloadApplyResult",
    "DynamicOffloadLoadResult",
    "claim",
    "offloaded_relative",
    "release",
]

_STATE_ATTR = "_ddo_offload"
# Modules ddo offloads or is attaching, and the lock that makes claiming one atomic.
_OFFLOADED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_CLAIM = threading.Lock()


def offloaded_relative(module: torch.nn.Module) -> Optional[str]:
    """What keeps ``module`` from being offloaded: itself, a submodule or a module containing it
    already offloaded by ddo."""
    if module in _OFFLOADED:
        return f"{type(module).__name__} is already offloaded by ddo"
    for path, m in module.named_modules():
        if path and m in _OFFLOADED:
            return f"its submodule {path} ({type(m).__name__}) is already offloaded by ddo"
    for owner in list(_OFFLOADED):
        if any(m is module for m in owner.modules()):
            return f"it is inside {type(owner).__name__}, which is already offloaded by ddo"
    return None


def claim(module: torch.nn.Module) -> None:
    """Marks ``module`` as being offloaded, or refuses: one offload per module tree at a time,
    also between threads."""
    with _CLAIM:
        why = offloaded_relative(module)
        if why is not None:
            raise DynamicOffloadError(f"{why}; call remove_dynamic_offload on it first")
        _OFFLOADED.add(module)


def release(module: torch.nn.Module) -> None:
    with _CLAIM:
        _OFFLOADED.discard(module)
# The logger of the entry points, whose results print the profile at removal.
_log = get_logger("ddo.api")


@dataclass
class DynamicOffloadApplyResult:
    """What :func:`enable_offload` did to one component. ``route`` is the published library's
    route (``dynamic_offload``, ``diffusers_group_offload``, ``none``); ``runtime_route`` is
    ddo's (``linear_runtime``, ``linear_convolution``, ``vmm_fast_runtime``, ``vmm_runtime``,
    ``diffusers_group_offload``, ``none``)."""

    module: torch.nn.Module
    route: str
    settings: DynamicOffloadSettings
    execution_device: torch.device
    runtime: Optional[SessionRuntime] = None
    setup: Dict[str, Any] = field(default_factory=dict)
    source: Optional[Dict[str, Any]] = None
    passes: int = 0
    handles: list = field(default_factory=list)
    runtime_route: str = ""
    applied: bool = True
    # What a named capacity profile did at attach (ddo.profiles), reported in setup metrics.
    capacity_profile: Optional[Dict[str, Any]] = None
    _removed: bool = False
    _hook: Optional[DynamicOffloadHook] = field(default=None, repr=False, compare=False)

    @property
    def should_move_to_execution_device(self) -> bool:
        """Whether the caller still has to place the module (an unmanaged component, or a
        resolved plan that was not applied)."""
        if not self.applied:
            return self.route == "none"
        return self.route == "none" and self.setup.get("placement") == "unmanaged"

    @property
    def hook(self) -> Optional[DynamicOffloadHook]:
        """The attached offload on ddo's arena routes, with the published hook's attributes
        (``config``, ``state``, ``vmm_runtime_stats()``; :class:`ddo.DynamicOffloadHook`), one
        object per result; ``None`` on the other routes and when the plan was not applied."""
        if self.runtime is None:
            return None
        if self._hook is None:
            self._hook = DynamicOffloadHook._of(self)
        return self._hook

    @property
    def event_payload(self) -> Dict[str, Any]:
        """The setup event: route, execution mode and what attaching did (the ``setup``
        section of metrics)."""
        payload: Dict[str, Any] = {
            "route": self.route,
            "runtime_route": self.runtime_route,
            "component": self.settings.component,
            "execution_mode": self.settings.execution_mode,
            "applied": self.applied,
        }
        payload.update(self.metrics_snapshot().as_dict()["setup"] if self.applied else {})
        return payload

    def metrics_snapshot(
        self, *, collect_completed: bool = False, execution_timing: Optional[_timing.DynamicOffloadExecutionTimer] = None
    ) -> DynamicOffloadMetrics:
        """A snapshot of what was done so far. ``collect_completed`` first waits for the execution
        device's work (one synchronization) so the counters cover completed work only.
        ``execution_timing`` (a timer from :meth:`execution_timer`) adds its snapshot under
        ``runtime.execution_timing``."""
        if self.runtime is not None:
            if collect_completed:
                self.runtime.synchronize()
            data = self.runtime.metrics("snapshot")
        else:
            runtime = {"passes": self.passes} if self.route == "diffusers_group_offload" else {}
            data = json.loads(
                self.settings.native.host_route_metrics(json.dumps(self.setup), json.dumps(runtime), "snapshot")
            )
        if execution_timing is not None and not isinstance(execution_timing, _timing.DynamicOffloadExecutionTimer):
            raise TypeError(
                f"execution_timing must be a timer from result.execution_timer(), not {type(execution_timing).__name__}"
            )
        if self.capacity_profile:
            data["setup"] = {**data.get("setup", {}), "capacity_profile": dict(self.capacity_profile)}
        auto = getattr(self.runtime, "auto_budget", None)
        if auto is not None:
            data["setup"] = {**data.get("setup", {}), "auto_budget": auto.setup()}
        metrics = DynamicOffloadMetrics.from_dict(data)
        return execution_timing.attach(metrics) if execution_timing is not None else metrics

    @contextlib.contextmanager
    def cleanup_on_error(self) -> Iterator["DynamicOffloadApplyResult"]:
        """On an exception inside the block, removes the offload once and re-raises the original
        exception; a cleanup failure is attached to it (a note, and ``ddo_cleanup_error``), never
        raised in its place. The success path does nothing."""
        try:
            yield self
        except BaseException as original:
            try:
                self.remove()
            except BaseException as cleanup:  # noqa: BLE001 - attached, not swallowed silently
                setattr(original, "ddo_cleanup_error", cleanup)
                if hasattr(original, "add_note"):
                    original.add_note(f"ddo cleanup also failed: {cleanup!r}")
            raise

    def remove(self) -> None:
        """Removes ddo from the module (once). Linear route: the module gets its own host tensors
        back. Native route: the weights were the arena's memory, so they become meta
        placeholders. With ``show_profile`` the profile is printed to stderr first."""
        if self._removed:
            return
        if self.settings.values.get("show_profile") and self.applied and self.setup:
            info(_log, self.metrics_snapshot(collect_completed=True).format_profile().rstrip("\n"), shown=True)
        if self.runtime is not None:
            # Refused inside a forward: the offload stays in place, and a later remove() works.
            self.runtime.detach()
            if self.runtime.checkpoint is not None:
                self.module.register_forward_pre_hook(_refuse_weightless_forward)
        self._removed = True
        if self.route == "diffusers_group_offload":
            _remove_group_hooks(self.module)
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if getattr(self.module, _STATE_ATTR, None) is self:
            delattr(self.module, _STATE_ATTR)
        release(self.module)

    def _session(self, what: str) -> SessionRuntime:
        if not self.applied:
            raise DynamicOffloadError(
                f"{what} needs an applied offload; this result was made with apply_hook=False: call enable_offload "
                "without it"
            )
        if self.runtime is None:
            raise DynamicOffloadError(
                f"{what} needs a route that streams through ddo's arena (linear_runtime, linear_convolution, "
                "vmm_fast_runtime, vmm_runtime); "
                f"this component uses {self.runtime_route or self.route}"
            )
        return self.runtime

    def reclaim(self) -> tuple:
        """Releases the physical memory of idle execution slots (addresses kept; the next use
        uploads again). Returns ``(slots, bytes)``."""
        return self._session("reclaim").reclaim()

    def unload(self) -> None:
        """After all work completed, replaces the weights with meta placeholders and frees their
        device memory and registrations. :meth:`reload` brings them back."""
        if self._removed:
            raise _native.DynamicOffloadLifecycleError("the offload was removed; there is nothing to unload")
        self._session("unload").unload()

    def reload(self) -> None:
        """Attaches the weights again after :meth:`unload` (from the checkpoint on the native route,
        from the module's host tensors on the linear route)."""
        runtime = self._session("reload")
        if self._removed:
            raise _native.DynamicOffloadLifecycleError(
                "the offload was removed; offload the module again with enable_offload (reload follows unload)"
            )
        if not runtime.is_unloaded():
            raise _native.DynamicOffloadLifecycleError("reload needs an unloaded component (call unload() first)")
        runtime.reload()

    # ---- phase helpers, timing, journal, state, capacity profiles (their own modules) --------

    def detach_auxiliary_cpu_sources(
        self, *, enabled: bool = False, max_copy_bytes: int = _phases.DEFAULT_MAX_COPY_BYTES
    ) -> DynamicOffloadMetrics:
        """Route ``vmm_auxiliary_source_detachment``: see :func:`ddo.compat.phases.detach_auxiliary_cpu_sources`."""
        return _phases.detach_auxiliary_cpu_sources(self, enabled=enabled, max_copy_bytes=max_copy_bytes)

    def execution_timer(
        self,
        *,
        enabled: bool = False,
        native_units: bool = False,
        native_capacity: int = 4096,
        diagnostic_step_wait: bool = False,
    ) -> _timing.DynamicOffloadExecutionTimer:
        """A timer for a denoise loop on this component's device (:mod:`ddo.compat.timing`)."""
        return _timing.execution_timer(
            self,
            enabled=enabled,
            native_units=native_units,
            native_capacity=native_capacity,
            diagnostic_step_wait=diagnostic_step_wait,
        )

    def metrics_journal(
        self, directory: Union[str, os.PathLike], *, enabled: bool = False
    ) -> _journal.DynamicOffloadMetricsJournal:
        """A journal writing this component's metrics at denoise boundaries (:mod:`ddo.compat.journal`)."""
        return _journal.DynamicOffloadMetricsJournal(directory, self.metrics_snapshot, enabled=enabled)

    def print_profile_summary(self, top_n: int = 8) -> None:
        """Prints ``[dynamic-offload-profile]`` lines (:func:`ddo.compat.state.print_profile_summary`)."""
        _state.print_profile_summary(self, top_n)

    def allocation_diagnostics(self, *, enabled: bool = False) -> Any:
        """The published library's diagnostics of its own PyTorch allocator. ddo installs no
        allocator, so there is nothing to diagnose: disabled it is a null context, enabled it is
        refused with where the figures are instead."""
        if enabled:
            raise DynamicOffloadError(
                "allocation diagnostics read the published library's PyTorch allocator; ddo installs none: PyTorch's "
                "own allocator serves activations (torch.cuda.memory_stats()), and the arena's bytes are in "
                "metrics_snapshot() (setup.gpu_budget_bytes, runtime.peak_bytes)"
            )
        return contextlib.nullcontext()

    def operator_diagnostics(
        self,
        *,
        enabled: bool = False,
        module_path: Optional[str] = None,
        invocations: Sequence[int] = (0, 2),
        output_dir: Union[str, os.PathLike, None] = None,
        use_cuda: bool = True,
    ) -> Any:
        """The published library's per-operator profile of chosen invocations. Disabled it is a
        null context; enabled it is refused with what to use instead."""
        if enabled:
            raise DynamicOffloadError(
                "ddo has no operator diagnostics of its own: wrap the call in torch.profiler.profile(activities=[CPU, "
                "CUDA]) (ddo's uploads appear as copies on their own stream), and read upload and wait seconds in "
                "metrics_snapshot().as_dict()['runtime']"
            )
        return contextlib.nullcontext()

    def profile_run(self) -> Any:
        """With ``build_profile``, a context manager measuring the run on CUDA and recording it
        under ``profile_name`` (:mod:`ddo.profiles`); otherwise a null context."""
        return _profiles.profile_run(self)


@dataclass
class DynamicOffloadLoadResult:
    """What :func:`from_pretrained_with_dynamic_offload` loaded."""

    module: torch.nn.Module
    source: Dict[str, Any]
    bound: int
    offload: Optional[DynamicOffloadApplyResult] = None
    #: Seconds each stage took: ``validate`` (every header), ``load`` (building the module),
    #: ``attach`` (the offload, with ``apply_dynamic``).
    stage_seconds: Dict[str, float] = field(default_factory=dict)
    #: Checkpoint bytes read into the page cache while the module was built (the native
    #: route's mapping tier, when the host can hold them; 0 otherwise).
    read_ahead_bytes: int = 0

    def metrics_snapshot(self) -> DynamicOffloadMetrics:
        """Route ``model_load``: how many tensors were bound to checkpoint slices."""
        return DynamicOffloadMetrics(
            route="model_load",
            setup={"source_bound_tensors": self.bound, "tensor_count": len(self.source["tensors"])},
        )

    @property
    def hook(self) -> Optional[DynamicOffloadHook]:
        """The offload's hook when ``apply_dynamic`` attached one, else ``None``."""
        return self.offload.hook if self.offload is not None else None

    @property
    def should_move_to_execution_device(self) -> bool:
        """Whether the caller still has to place the module: true unless ddo offloaded it."""
        return self.offload is None or self.offload.should_move_to_execution_device

    def profile_run(self) -> Any:
        """The offload's :meth:`DynamicOffloadApplyResult.profile_run`, or a null context
        without one."""
        return self.offload.profile_run() if self.offload is not None else contextlib.nullcontext()

    def inspect_vmm_component(
        self, *, component: str = "model", buffer_limit_bytes: int = 1 << 20
    ) -> DynamicOffloadMetrics:
        """Route ``vmm_component_preflight``: what the native route would stream for this
        module, from metadata only (no CUDA, no weights read): units, bytes, and the parameters
        bound to checkpoint slices. ``buffer_limit_bytes`` is the published library's buffer cap;
        ddo keeps buffers on the device, so it is only reported."""
        m = inspect_vmm_component(self.module, component=component)
        setup = dict(m.setup, source_bound_tensors=self.bound, buffer_limit_bytes=buffer_limit_bytes)
        return DynamicOffloadMetrics(route="vmm_component_preflight", setup=setup, execution=m.execution)


def _remove_group_hooks(module: torch.nn.Module) -> None:
    try:
        from diffusers.hooks import HookRegistry
    except ImportError:  # pragma: no cover - diffusers without hooks
        return
    for m in module.modules():
        registry = getattr(m, "_diffusers_hook", None)
        if isinstance(registry, HookRegistry):
            for name in list(registry.hooks.keys()) if hasattr(registry, "hooks") else []:
                registry.remove_hook(name, recurse=False)


@dataclass
class DiffusersGroupOffloadResult:
    """What :func:`enable_diffusers_group_offload` applied."""

    module: torch.nn.Module
    event_payload: Dict[str, Any]



def _refuse_weightless_forward(m: torch.nn.Module, _args: tuple) -> None:
    """A forward pre-hook put on a module after ``remove()`` on a route whose weights were the
    arena's memory: while parameters are meta placeholders, a forward says why; once weights are
    loaded it takes itself off (a module-level function: the module still pickles and copies)."""
    if not any(p.is_meta for p in m.parameters()):
        for key, hook in list(m._forward_pre_hooks.items()):
            if hook is _refuse_weightless_forward:
                del m._forward_pre_hooks[key]
        return
    raise _native.DynamicOffloadLifecycleError(
        f"{type(m).__name__} has no weights: ddo was removed from it, and its weights were the arena's memory "
        "(streamed from the checkpoint), so its parameters are meta placeholders now. Load it again "
        "(from_pretrained_with_dynamic_offload, or the model class's from_pretrained), or load weights into it "
        "(module.to_empty(device=...) then load_state_dict(...))"
    )
