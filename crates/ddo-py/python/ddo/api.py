"""Entry points for Diffusers hosts."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Sequence, Union

import torch

from . import _native
from .config import DynamicOffloadConfig
from .errors import DynamicOffloadError
from .hook import DynamicOffloadHook
from .log import get_logger, info
from .metrics import DynamicOffloadMetrics
from .progress import bar
from . import journal as _journal, phases as _phases, profiles as _profiles, state as _state, timing as _timing
from .runtime import SessionRuntime, StreamedWeight
from .settings import DynamicOffloadSettings, resolve_settings

__all__ = [
    "DynamicOffloadApplyResult",
    "DynamicOffloadLoadResult",
    "enable_offload",
    "enable_pipeline_offload",
    "enable_diffusers_group_offload",
    "remove_dynamic_offload",
    "from_pretrained_with_dynamic_offload",
    "inspect_host_memory",
]

_STATE_ATTR = "_ddo_offload"
# Modules ddo offloads or is attaching, and the lock that makes claiming one atomic.
_OFFLOADED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_CLAIM = threading.Lock()


def _offloaded_relative(module: torch.nn.Module) -> Optional[str]:
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


def _claim(module: torch.nn.Module) -> None:
    """Marks ``module`` as being offloaded, or refuses: one offload per module tree at a time,
    also between threads."""
    with _CLAIM:
        why = _offloaded_relative(module)
        if why is not None:
            raise DynamicOffloadError(f"{why}; call remove_dynamic_offload on it first")
        _OFFLOADED.add(module)


def _release(module: torch.nn.Module) -> None:
    with _CLAIM:
        _OFFLOADED.discard(module)
_log = get_logger(__name__)


def _default_device() -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _refuse_training(module: torch.nn.Module) -> None:
    if module.training:
        raise DynamicOffloadError(
            f"{type(module).__name__} is in training mode; ddo offloads inference only: call module.eval() first"
        )


def _host_memory(phase: str) -> Dict[str, Any]:
    out = json.loads(_native.observe_host_memory())
    out["phase"] = phase
    return out


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
        _release(self.module)

    def _session(self, what: str) -> SessionRuntime:
        if not self.applied:
            raise DynamicOffloadError(
                f"{what} needs an applied offload; this result was made with apply_hook=False: call enable_offload "
                "without it"
            )
        if self.runtime is None:
            raise DynamicOffloadError(
                f"{what} needs a route that streams through ddo's arena (linear_runtime, linear_convolution, vmm_fast_runtime, vmm_runtime); "
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
        """Route ``vmm_auxiliary_source_detachment``: see :func:`ddo.phases.detach_auxiliary_cpu_sources`."""
        return _phases.detach_auxiliary_cpu_sources(self, enabled=enabled, max_copy_bytes=max_copy_bytes)

    def execution_timer(
        self,
        *,
        enabled: bool = False,
        native_units: bool = False,
        native_capacity: int = 4096,
        diagnostic_step_wait: bool = False,
    ) -> _timing.DynamicOffloadExecutionTimer:
        """A timer for a denoise loop on this component's device (:mod:`ddo.timing`)."""
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
        """A journal writing this component's metrics at denoise boundaries (:mod:`ddo.journal`)."""
        return _journal.DynamicOffloadMetricsJournal(directory, self.metrics_snapshot, enabled=enabled)

    def print_profile_summary(self, top_n: int = 8) -> None:
        """Prints ``[dynamic-offload-profile]`` lines (:func:`ddo.state.print_profile_summary`)."""
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
        from .compat import inspect_vmm_component

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


class _Default(str):
    """A keyword's published default, told apart from the same value passed explicitly: left at
    its default, the layers below (``DDO_*`` variables, the preset) still decide."""

    __slots__ = ()


_AUTO = _Default("auto")
_CUDA0 = _Default("cuda:0")


def _given(value: Any) -> bool:
    return value is not None and not isinstance(value, _Default)


def enable_diffusers_group_offload(
    module: torch.nn.Module,
    *,
    onload_device: Union[str, torch.device] = _CUDA0,
    offload_device: Union[str, torch.device] = "cpu",
    offload_type: str = "leaf_level",
    use_stream: bool = True,
    record_stream: bool = False,
    low_cpu_mem_usage: bool = True,
    num_blocks_per_group: int = 1,
    apply_hook: bool = True,
    record_event: Optional[Callable[[str, Dict[str, Any]], Any]] = None,
    event_name: str = "setup_diffusers_group_offload",
) -> DiffusersGroupOffloadResult:
    """Applies Diffusers' own group offload hooks (``apply_group_offloading``). Left at its
    default, ``onload_device`` is ``cuda:0``, or the CPU on a machine without CUDA; streams are
    turned off on a CPU execution device. ``apply_hook=False`` only builds the payload;
    ``record_event(event_name, payload)`` is called with it."""
    device = torch.device(onload_device if _given(onload_device) else _default_device())
    if device.type != "cuda":
        use_stream, record_stream = False, False
    kwargs: Dict[str, Any] = dict(
        onload_device=device,
        offload_device=torch.device(offload_device),
        offload_type=offload_type,
        use_stream=use_stream,
        record_stream=record_stream,
        low_cpu_mem_usage=low_cpu_mem_usage,
    )
    if offload_type == "block_level":
        kwargs["num_blocks_per_group"] = num_blocks_per_group
    if apply_hook:
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(module, **kwargs)
    applied = {k: kwargs[k] for k in ("offload_type", "use_stream", "record_stream", "low_cpu_mem_usage")}
    if offload_type == "block_level":
        applied["num_blocks_per_group"] = num_blocks_per_group
    if record_event is not None:
        record_event(event_name, dict(applied))
    return DiffusersGroupOffloadResult(module=module, event_payload=applied)


def enable_offload(
    module: torch.nn.Module,
    *,
    settings: Optional[DynamicOffloadSettings] = None,
    config: Optional[DynamicOffloadConfig] = None,
    component: str = "model",
    preset: str = _AUTO,
    route: Optional[str] = None,
    group_offload: Optional[bool] = None,
    dynamic_offload: Optional[bool] = None,
    offload_type: Optional[str] = None,
    use_stream: Optional[bool] = None,
    record_stream: Optional[bool] = None,
    group_low_cpu_mem_usage: Optional[bool] = None,
    num_blocks_per_group: Optional[int] = None,
    execution_device: Union[str, torch.device] = _CUDA0,
    offload_device: Union[str, torch.device] = "cpu",
    low_cpu_mem_usage: bool = True,
    running_on_wsl: Optional[bool] = None,
    environ: Optional[Mapping[str, str]] = None,
    use_environment: bool = True,
    apply_hook: bool = True,
    record_event: Optional[Callable[[str, Dict[str, Any]], Any]] = None,
    dynamic_event_name: Optional[str] = None,
    group_event_name: Optional[str] = None,
    **config_overrides: Any,
) -> DynamicOffloadApplyResult:
    """Offloads one component by its resolved route (see the README's route table):
    ``linear_runtime`` (default), ``linear_convolution`` (``route="linear_convolution"``),
    ``vmm_fast_runtime`` (``backend="vmm"``) and ``vmm_runtime`` (preset ``nvme_baseline``) (the
    module of these two must come from :func:`from_pretrained_with_dynamic_offload`),
    ``diffusers_group_offload`` or ``none``.

    Explicit keywords beat ``config``, which beats component policies, ``DDO_<COMPONENT>_*``,
    ``DDO_*``, the preset and defaults; ``config_overrides`` are config field names (``backend``
    among them; an unknown one is a ``TypeError``). ``preset`` and ``execution_device`` left at
    their defaults (``auto``, ``cuda:0``) let ``DDO_PRESET`` / ``DDO_EXECUTION_DEVICE`` decide;
    without CUDA the default device is the CPU (the host backend). ``settings`` (from
    :func:`load_dynamic_offload_settings_from_env`) is used as resolved, re-resolved for this
    ``component`` when it was resolved for another. ``group_low_cpu_mem_usage`` is the
    component's Diffusers ``low_cpu_mem_usage``; ``low_cpu_mem_usage=False`` applies when that
    is unset. ``apply_hook=False`` resolves and reports without touching the module;
    ``record_event(name, payload)`` receives the setup event (``dynamic_event_name`` /
    ``group_event_name``). Bad settings raise :class:`DynamicOffloadConfigError`; a module that
    cannot be offloaded raises :class:`DynamicOffloadError`; in both cases the module is left as
    it was.
    """
    _check_types(module=module, config=config, settings=settings, environ=environ)
    why = _offloaded_relative(module)
    if why is not None:
        raise DynamicOffloadError(f"{why}; call remove_dynamic_offload on it first")
    arguments: Dict[str, Any] = {k: v for k, v in config_overrides.items()}
    if "target_module_classes" in arguments:
        arguments["target_module_classes"] = [
            c if isinstance(c, str) else c.__name__ for c in arguments["target_module_classes"]
        ]
    for k, v in (("preset", preset), ("route", route)):
        if _given(v):
            arguments[k] = v
    if _given(execution_device):
        arguments["execution_device"] = str(execution_device)
    if _device_type(offload_device) != "cpu":
        arguments["offload_device"] = str(offload_device)
    if group_low_cpu_mem_usage is None and not low_cpu_mem_usage:
        group_low_cpu_mem_usage = False
    group = {
        "group_offload": group_offload,
        "dynamic_offload": dynamic_offload,
        "offload_type": offload_type,
        "use_stream": use_stream,
        "record_stream": record_stream,
        "low_cpu_mem_usage": group_low_cpu_mem_usage,
        "num_blocks_per_group": num_blocks_per_group,
    }
    if settings is not None:
        # As published: keywords and overrides apply on top of the settings.
        settings = settings.resolved_again(
            component, arguments=arguments, group=group, config=config, environ=environ, use_environment=use_environment
        )
    else:
        settings = resolve_settings(
            component,
            arguments=arguments,
            group=group,
            config=config,
            environ=environ,
            use_environment=use_environment,
            running_on_wsl=running_on_wsl,
        )
    settings, capacity_profile = _profiles.apply_capacity_profile(module, settings)
    device = torch.device(settings.device)
    name = settings.route_name
    if device.type == "cuda":
        if settings.runs_in_session and not _native.cuda_driver_present():
            raise DynamicOffloadError(
                f"route {name} on {device} needs a CUDA driver and none was found; use "
                "execution_device='cpu' (the host backend) on machines without an NVIDIA GPU"
            )
        if not torch.cuda.is_available():
            raise DynamicOffloadError(f"execution device {device} is not available: PyTorch sees no CUDA device")
    for w in settings.warnings:
        warnings.warn(f"ddo: {w}", stacklevel=2)
    result = DynamicOffloadApplyResult(
        module=module, route=_published_route(name), settings=settings, execution_device=device, runtime_route=name
    )
    result.capacity_profile = capacity_profile
    if not apply_hook:
        result.applied = False
        _record(record_event, result, dynamic_event_name, group_event_name)
        return result
    _claim(module)
    try:
        t = time.perf_counter()
        setup = _attach(result, module, settings, device, name)
        setup["setup_seconds"] = time.perf_counter() - t
        result.setup = setup
        setattr(module, _STATE_ATTR, result)
        verbose = bool(settings.values.get("verbose"))
        info(_log, f"[ddo] {component}: route {name} on {device}", shown=verbose)
        if verbose and result.runtime is not None:
            info(_log, result.metrics_snapshot().format_profile().rstrip("\n"), shown=True)
        _record(record_event, result, dynamic_event_name, group_event_name)
    except BaseException:
        # All or nothing: whatever was applied is removed again, and the module is free.
        with contextlib.suppress(BaseException):
            result.remove()
        _release(module)
        raise
    return result


def _attach(
    result: DynamicOffloadApplyResult,
    module: torch.nn.Module,
    settings: DynamicOffloadSettings,
    device: torch.device,
    name: str,
) -> Dict[str, Any]:
    """Applies the resolved route to ``module``; returns the setup section."""
    setup: Dict[str, Any] = {}
    if settings.runs_in_session:
        _refuse_training(module)
        source = getattr(module, "_ddo_source", None)
        checkpoint = None
        if name in ("vmm_fast_runtime", "vmm_runtime"):
            if source is None:
                raise DynamicOffloadError(
                    f"route {name} streams weights from the checkpoint: load the component with "
                    "ddo.from_pretrained_with_dynamic_offload"
                )
            checkpoint = source["path"]
        runtime = SessionRuntime(module, settings.native, checkpoint=checkpoint)
        runtime.attach()
        result.runtime = runtime
        result.source = source
    elif name == "diffusers_group_offload":
        _refuse_training(module)
        g = settings.route
        applied = enable_diffusers_group_offload(
            module,
            onload_device=device,
            offload_type=g["offload_type"],
            use_stream=g["use_stream"],
            record_stream=g["record_stream"],
            low_cpu_mem_usage=g["low_cpu_mem_usage"],
            num_blocks_per_group=g["num_blocks_per_group"],
        ).event_payload
        setup["group_offload"] = applied

        def count(_m: torch.nn.Module, _args: tuple) -> None:
            result.passes += 1

        result.handles.append(module.register_forward_pre_hook(count))
    elif name == "none":
        placement = settings.route.get("placement", "resident")
        if placement == "resident":
            module.to(device)
        setup["placement"] = placement
    else:
        raise DynamicOffloadError(f"route {name} (preset {settings.effective_preset}) is not built yet; use preset auto")
    return setup


def _device_type(device: Any) -> str:
    """``cpu`` for any form of the host (``"cpu"``, ``"cpu:0"``, ``torch.device("cpu", 0)``)."""
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        return str(device)


def _check_types(**values: Any) -> None:
    """Arguments of the wrong kind, refused with what is expected (before anything happens)."""
    expected = {
        "module": (torch.nn.Module, "a torch.nn.Module"),
        "config": (DynamicOffloadConfig, "a ddo.DynamicOffloadConfig (build one with ddo.DynamicOffloadConfig(**fields))"),
        "settings": (DynamicOffloadSettings, "ddo.DynamicOffloadSettings (from load_dynamic_offload_settings_from_env)"),
        "environ": (Mapping, "a mapping of variable names to values"),
    }
    for name, value in values.items():
        kind, text = expected[name]
        if value is None and name != "module":
            continue
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be {text}, not {type(value).__name__}")


def _published_route(runtime_route: str) -> str:
    """The published library's name of one of ddo's routes."""
    arena = ("linear_runtime", "linear_convolution", "vmm_fast_runtime", "vmm_runtime")
    return "dynamic_offload" if runtime_route in arena else runtime_route


def _record(
    record_event: Optional[Callable[[str, Dict[str, Any]], Any]],
    result: DynamicOffloadApplyResult,
    dynamic_event_name: Optional[str],
    group_event_name: Optional[str],
) -> None:
    """Hands the setup event to the host's recorder, named by route."""
    if record_event is None:
        return
    if result.route == "diffusers_group_offload":
        name = group_event_name or "setup_diffusers_group_offload"
    elif result.route == "dynamic_offload":
        name = dynamic_event_name or "setup_dynamic_offload"
    else:
        name = "setup_no_offload"
    record_event(name, result.event_payload)


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


def remove_dynamic_offload(module: torch.nn.Module, recurse: bool = True) -> None:
    """Removes ddo from ``module`` (a no-op when it is not offloaded) and, with ``recurse``,
    from every submodule offloaded on its own."""
    _check_types(module=module)
    targets = list(module.modules()) if recurse else [module]
    for m in targets:
        result = getattr(m, _STATE_ATTR, None)
        if result is not None:
            result.remove()


_FALLBACK_COMPONENTS = ("text_encoder", "text_encoder_2", "transformer", "unet", "vae")


def enable_pipeline_offload(
    pipeline: Any,
    *,
    settings: Optional[DynamicOffloadSettings] = None,
    components: Union[Sequence[str], Mapping[str, Any], None] = None,
    preset: str = _AUTO,
    execution_device: Union[str, torch.device] = _CUDA0,
    offload_device: Union[str, torch.device] = "cpu",
    low_cpu_mem_usage: bool = True,
    running_on_wsl: Optional[bool] = None,
    environ: Optional[Mapping[str, str]] = None,
    use_environment: bool = True,
    apply_hook: bool = True,
    record_event: Optional[Callable[[str, Dict[str, Any]], Any]] = None,
    config: Optional[DynamicOffloadConfig] = None,
    **config_overrides: Any,
) -> Dict[str, DynamicOffloadApplyResult]:
    """Offloads every ``torch.nn.Module`` component of a Diffusers pipeline by its own resolved
    route (VAE and text-encoder defaults included). ``components`` is a list of names, or a
    mapping of names to modules; by default the pipeline's ``components``, else its
    ``text_encoder``, ``text_encoder_2``, ``transformer``, ``unet`` and ``vae`` attributes.
    Components that are not modules are skipped. A component left unmanaged by its route is
    moved to the execution device (``setup`` records ``unmanaged_module_moved_to_execution_device``).
    If one component fails, the ones already done are removed again and the error re-raised."""
    if isinstance(components, (str, bytes)):
        raise TypeError(f"components is a list of names or a mapping of names to modules, not the string {components!r}")
    if isinstance(components, Mapping):
        items: Mapping[str, Any] = dict(components)
        names = list(items)
    else:
        items = getattr(pipeline, "components", None) or {
            n: getattr(pipeline, n) for n in _FALLBACK_COMPONENTS if getattr(pipeline, n, None) is not None
        }
        if not items and components is None:
            raise DynamicOffloadError(
                "the pipeline has no .components mapping and none of text_encoder, text_encoder_2, transformer, "
                "unet, vae; pass components={name: module}"
            )
        names = list(components) if components is not None else list(items.keys())
        missing = [n for n in names if n not in items]
        if missing:
            raise DynamicOffloadError(f"the pipeline has no component(s) {', '.join(missing)}; it has {', '.join(items)}")
    modules = [n for n in names if isinstance(items.get(n), torch.nn.Module)]
    keywords: Dict[str, Any] = dict(
        settings=settings,
        running_on_wsl=running_on_wsl,
        environ=environ,
        use_environment=use_environment,
        apply_hook=apply_hook,
        record_event=record_event,
        preset=preset,
        execution_device=execution_device,
        offload_device=offload_device,
        low_cpu_mem_usage=low_cpu_mem_usage,
        config=config,
        **config_overrides,
    )
    done: Dict[str, DynamicOffloadApplyResult] = {}
    try:
        with bar(modules, desc="ddo offload", unit="component") as progress:
            for name in progress:
                progress.set_postfix_str(name, refresh=False)
                done[name] = enable_offload(items[name], component=name, **keywords)
                r = done[name]
                if apply_hook and r.should_move_to_execution_device:
                    items[name].to(r.execution_device)
                    r.setup["unmanaged_module_moved_to_execution_device"] = True
    except BaseException:
        for r in done.values():
            with contextlib.suppress(Exception):
                r.remove()
        raise
    return done


def _association(path: str) -> Dict[str, Any]:
    return json.loads(_native.inspect_checkpoint(path))


def from_pretrained_with_dynamic_offload(
    pretrained_model_name_or_path: Union[str, os.PathLike],
    *,
    model_loader: Any = None,
    subfolder: Optional[str] = None,
    gguf_file: Union[str, os.PathLike, None] = None,
    dynamic_offload_config: Optional[DynamicOffloadConfig] = None,
    apply_dynamic: bool = False,
    component: str = "model",
    profile_name: Optional[str] = None,
    build_profile: Optional[bool] = None,
    **from_pretrained_kwargs: Any,
) -> DynamicOffloadLoadResult:
    """Validates the checkpoint (every header, before any load), builds the model (``model_loader``,
    by default the class its ``config.json`` names: a Diffusers ``_class_name``, else the first
    transformers ``architectures`` entry), binds each parameter to its checkpoint slice by name,
    and with ``apply_dynamic`` offloads it. On the native and disk routes with ``apply_dynamic``
    the model is built without weights and every weight streams from the checkpoint; otherwise it
    is loaded with ``model_loader.from_pretrained``.
    A corrupt checkpoint raises :class:`DynamicOffloadError` naming the file and tensor.

    ``gguf_file`` (a file in the folder, or a path; by default the folder's one ``*.gguf`` when it
    holds no safetensors) loads a GGUF file with Diffusers parameter names, the model's
    ``config.json`` in the folder, as Diffusers' ``from_single_file(gguf_file, config=folder,
    quantization_config=GGUFQuantizationConfig(compute_dtype=torch_dtype))`` loads it: on the
    native route its tensors stream as they are stored (quantized ones as ``GGUFParameter`` s that
    ``GGUFLinear`` dequantizes in its forward); on the linear route through ``from_single_file``.

    ``profile_name`` / ``build_profile`` set those config fields of the offload (a named capacity
    profile, :mod:`ddo.profiles`); they need ``apply_dynamic=True``."""
    if profile_name is not None or build_profile is not None:
        if not apply_dynamic:
            raise _native.DynamicOffloadConfigError(
                "profile_name and build_profile configure the offload: pass apply_dynamic=True with them"
            )
        chosen = {k: v for k, v in (("profile_name", profile_name), ("build_profile", build_profile)) if v is not None}
        dynamic_offload_config = (dynamic_offload_config or DynamicOffloadConfig()).replace(**chosen)
    # One step per stage Python drives: validate (every header), load (build the module), attach.
    stages = bar(total=3 if apply_dynamic else 2, desc=f"ddo {component}", unit="stage", leave=False)
    stages.set_postfix_str("validate")
    clock = time.perf_counter()
    seconds: Dict[str, float] = {}
    path = _local_path(pretrained_model_name_or_path, from_pretrained_kwargs.get("revision"))
    folder = os.path.join(path, subfolder) if subfolder else path
    gguf_path = _gguf_path(folder, gguf_file, from_pretrained_kwargs.get("variant"))
    checkpoint = gguf_path or _variant_checkpoint(folder, from_pretrained_kwargs.get("variant"))
    source = _association(checkpoint)
    gguf_tensors = _gguf_tensors(folder, gguf_path) if gguf_path else None
    if model_loader is None:
        model_loader = _loader_of(folder)
    elif not (hasattr(model_loader, "from_pretrained") or hasattr(model_loader, "from_config")):
        raise TypeError(
            f"model_loader must be a model class with from_pretrained (a Diffusers or transformers class), not "
            f"{type(model_loader).__name__}"
        )
    if gguf_path and _is_transformers(model_loader):
        raise DynamicOffloadError(
            f"{gguf_path}: ddo loads GGUF files of Diffusers models; transformers models load GGUF through their own "
            "from_pretrained(gguf_file=...) (dequantized), then enable_offload"
        )
    if subfolder and not gguf_path:
        from_pretrained_kwargs["subfolder"] = subfolder
    ahead = None
    try:
        settings = resolve_settings(component, config=dynamic_offload_config) if apply_dynamic else None
        # A cold checkpoint the mapping tier will serve is read while the module is built.
        ahead = _read_ahead(settings, source["files"]) if settings is not None else None
        result = _load_and_attach(
            stages, seconds, clock, settings, path, folder, checkpoint, source, gguf_path, gguf_tensors,
            model_loader, apply_dynamic, component, dynamic_offload_config, from_pretrained_kwargs,
        )
    finally:
        read_ahead_bytes = ahead.stop() if ahead is not None else 0
        stages.close()
    result.stage_seconds = seconds
    result.read_ahead_bytes = read_ahead_bytes
    return result


def _read_ahead(settings: Any, files: Sequence[str]) -> Any:
    """Starts reading ``files`` into the page cache when the native route will map them (no
    host-tier setting) and the host can hold them; ``None`` otherwise."""
    v = settings.values
    if (
        settings.route_name != "vmm_fast_runtime"
        or v.get("vmm_source_cache_gb")
        or v.get("vmm_source_registered_gb")
        or v.get("load_safetensors_backend") not in ("auto", "mmap")
        or v.get("vmm_weight_encoding", "off") != "off"
    ):
        return None
    try:
        return _native.read_ahead(list(files), min(16, os.cpu_count() or 1))
    except _native.DynamicOffloadCheckpointError:
        # Only a head start: a file it cannot open is opened (and named) by the load itself.
        return None


def _load_and_attach(
    stages: Any, seconds: Dict[str, float], clock: float, settings: Any, path: str, folder: str, checkpoint: str,
    source: Dict[str, Any], gguf_path: Optional[str], gguf_tensors: Any, model_loader: Any, apply_dynamic: bool,
    component: str, dynamic_offload_config: Optional[DynamicOffloadConfig], from_pretrained_kwargs: Dict[str, Any],
) -> DynamicOffloadLoadResult:
    seconds["validate"] = time.perf_counter() - clock
    stages.update()
    stages.set_postfix_str("load")
    module = None
    if apply_dynamic:
        # The native and disk routes stream every weight from the checkpoint (its mapping, or
        # reads into staging): build the module without weights (meta) so host memory holds the
        # model at most once.
        if settings.route_name in ("vmm_fast_runtime", "vmm_runtime"):
            if gguf_tensors is not None:
                module = _meta_gguf_module(model_loader, folder, gguf_path, gguf_tensors, from_pretrained_kwargs)
            elif _is_transformers(model_loader):
                module = _meta_transformers(model_loader, folder, from_pretrained_kwargs)
            elif hasattr(model_loader, "from_config"):
                module = _meta_module(model_loader, folder, from_pretrained_kwargs.get("torch_dtype"))
    if module is None and gguf_path:
        kwargs = {**from_pretrained_kwargs, "quantization_config": _gguf_config(from_pretrained_kwargs)}
        module = model_loader.from_single_file(gguf_path, config=folder, **kwargs)
    elif module is None:
        module = model_loader.from_pretrained(os.fspath(path), **from_pretrained_kwargs)
    source["path"] = checkpoint
    module._ddo_source = source
    names = {t["name"]: t for t in source["tensors"]}
    bound = 0
    for n, p in list(module.named_parameters()) + list(module.named_buffers()):
        t = names.get(n)
        # A GGUF tensor's shape was checked against its parameter's when the module was built.
        if t is not None and (gguf_path is not None or list(t["shape"]) == list(p.shape)):
            bound += 1
    result = DynamicOffloadLoadResult(module=module, source=source, bound=bound)
    seconds["load"] = time.perf_counter() - clock - seconds["validate"]
    stages.update()
    if apply_dynamic:
        stages.set_postfix_str("attach")
        module.eval()
        attaching = time.perf_counter()
        result.offload = enable_offload(module, component=component, config=dynamic_offload_config)
        result.offload.source = source
        seconds["attach"] = time.perf_counter() - attaching
        stages.update()
    return result


def _variant_checkpoint(folder: str, variant: Optional[str]) -> str:
    """What to open for ``variant`` (``fp16``) of the model in ``folder``, as Diffusers and
    transformers name variant files: its index (``*.safetensors.index.fp16.json``) or its one
    file (``*.fp16.safetensors``). Without a variant, the folder (variant files beside plain ones
    are skipped)."""
    if not variant or not os.path.isdir(folder):
        return folder
    names = sorted(os.listdir(folder))
    indexes = [n for n in names if n.endswith(f".safetensors.index.{variant}.json")]
    files = [n for n in names if n.endswith(f".{variant}.safetensors")]
    if len(indexes) == 1:
        return os.path.join(folder, indexes[0])
    if not indexes and len(files) == 1:
        return os.path.join(folder, files[0])
    raise DynamicOffloadError(
        f"{folder} has no single checkpoint of variant {variant!r} "
        f"(indexes {indexes or 'none'}, files {files or 'none'}); pass another variant= or none"
    )


def _gguf_path(folder: str, gguf_file: Union[str, os.PathLike, None], variant: Optional[str]) -> Optional[str]:
    """The GGUF file to load: ``gguf_file`` (a name in ``folder``, or a path), else the folder's
    one ``*.gguf`` when it holds no safetensors; ``None`` when there is none."""
    if gguf_file is None:
        names = os.listdir(folder) if os.path.isdir(folder) and not variant else []
        ggufs = [n for n in names if n.endswith(".gguf")]
        if len(ggufs) != 1 or any(".safetensors" in n for n in names):
            return None
        gguf_file = ggufs[0]
    elif variant:
        raise DynamicOffloadError(
            f"variant={variant!r} selects safetensors files; it does not apply to gguf_file={gguf_file!r}"
        )
    file = os.path.join(folder, os.fspath(gguf_file))
    if not os.path.isfile(file):
        raise DynamicOffloadError(f"gguf_file {file} is not a file")
    return file


def _gguf_tensors(folder: str, path: str) -> Dict[str, tuple]:
    """Each tensor of the GGUF file at ``path`` as ``(GGML type, shape)``, the shape Diffusers'
    GGUF loader gives it (bytes per row last for every type but F32 and F16). Reads the header
    only; a type Diffusers cannot dequantize is refused, as is a folder without ``config.json``."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise DynamicOffloadError(
            f"{folder} has no config.json: a GGUF file ({path}) is loaded with the model's config, so pass the "
            "model folder that holds it (gguf_file= names the file in it, or any path)"
        )
    try:
        import gguf
        from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES
    except ImportError as e:
        raise DynamicOffloadError(f"loading {path} needs gguf and diffusers (pip install gguf): {e}") from None
    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    out: Dict[str, tuple] = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type not in plain and t.tensor_type not in SUPPORTED_GGUF_QUANT_TYPES:
            supported = ", ".join(q.name for q in (*plain, *SUPPORTED_GGUF_QUANT_TYPES))
            raise _native.DynamicOffloadCheckpointError(
                f"{path}: tensor {t.name} has GGUF type {t.tensor_type.name}, which Diffusers cannot dequantize "
                f"(supported: {supported})"
            )
        out[t.name] = (t.tensor_type, tuple(int(d) for d in t.data.shape))
    return out


def _gguf_dtype(kwargs: Dict[str, Any]) -> Any:
    """``dtype``, else ``torch_dtype``, as ``from_single_file`` reads them."""
    return kwargs["dtype"] if kwargs.get("dtype") is not None else kwargs.get("torch_dtype")


def _gguf_config(kwargs: Dict[str, Any]) -> Any:
    """The caller's ``quantization_config`` (GGUF only), else Diffusers' GGUF configuration
    computing in ``torch_dtype``."""
    from diffusers import GGUFQuantizationConfig

    config = kwargs.get("quantization_config")
    if config is None:
        return GGUFQuantizationConfig(compute_dtype=_gguf_dtype(kwargs))
    if not isinstance(config, GGUFQuantizationConfig):
        raise DynamicOffloadError(f"a GGUF file loads with a GGUFQuantizationConfig, not {type(config).__name__}")
    return config


def _meta_gguf_module(loader: Any, folder: str, path: str, tensors: Dict[str, tuple], kwargs: Dict[str, Any]) -> Any:
    """The model as Diffusers' ``from_single_file(path, config=folder, quantization_config=...)``
    builds it, every parameter on the meta device: built under the default dtype (buffers stay
    as built), Linear layers whose weight the file quantizes (BF16 included) become ``GGUFLinear``
    with a meta ``GGUFParameter`` of the file's type and byte shape, and F32/F16 tensors' parameters
    take ``torch_dtype`` (fp32 in ``_keep_in_fp32_modules``). ``None`` when the model cannot be
    built without weights. Every parameter must be in the file by its Diffusers name."""
    import gguf
    from diffusers.quantizers import DiffusersAutoQuantizer
    from diffusers.quantizers.gguf.utils import GGML_QUANT_SIZES, GGUFLinear, GGUFParameter

    quantizer = DiffusersAutoQuantizer.from_config(_gguf_config(kwargs))
    quantizer.validate_environment()
    dtype = quantizer.update_torch_dtype(_gguf_dtype(kwargs))
    module = _meta_module(loader, folder, None)
    if module is None:
        return None
    params = list(module.named_parameters(remove_duplicate=False))
    missing = next((n for n, _ in params if n not in tensors), None)
    if missing is not None:
        raise _native.DynamicOffloadCheckpointError(
            f"{path} has no tensor {missing}: ddo streams GGUF tensors by their Diffusers parameter names, and this "
            f"file's keys are in another layout (an original checkpoint's); use a GGUF file with {type(module).__name__}'s "
            "Diffusers names, or load this one with Diffusers' from_single_file"
        )
    plain = {gguf.GGMLQuantizationType.F32: torch.float32, gguf.GGMLQuantizationType.F16: torch.float16}
    meta = lambda shape, d: torch.empty(shape, dtype=d, device="meta")  # noqa: E731
    state = {
        n: meta(shape, plain[q]) if q in plain else GGUFParameter(meta(shape, torch.uint8), quant_type=q)
        for n, (q, shape) in tensors.items()
    }
    keep = getattr(loader, "_keep_in_fp32_modules", None) or []
    keep = [keep] if isinstance(keep, str) else list(keep)
    quantizer.preprocess_model(model=module, device_map=None, state_dict=state, keep_in_fp32_modules=keep)
    replaced: Dict[int, torch.nn.Parameter] = {}
    for name, param in params:
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        param = owner._parameters[leaf]
        if id(param) not in replaced:
            q, shape = tensors[name]
            parts = name.split(".")
            fp32 = any(k in parts for k in keep)
            block, size = GGML_QUANT_SIZES[q]
            values = (*shape[:-1], shape[-1] // size * block) if q not in plain else shape
            if tuple(values) != tuple(param.shape):
                raise _native.DynamicOffloadCheckpointError(
                    f"{path}: tensor {name} ({q.name}) holds shape {list(values)}, the model's parameter has "
                    f"{list(param.shape)}"
                )
            if q in plain:
                new = meta(shape, torch.float32 if fp32 else dtype)
            elif isinstance(owner, GGUFLinear) and leaf == "weight":
                new = GGUFParameter(meta(shape, torch.uint8), quant_type=q)
            elif q == gguf.GGMLQuantizationType.BF16 and any(m in parts for m in quantizer.modules_to_not_convert):
                # Diffusers dequantizes it at load; the session converts BF16 the same way.
                new = meta(values, torch.float32 if fp32 else quantizer.compute_dtype)
            else:
                raise _native.DynamicOffloadCheckpointError(
                    f"{path}: tensor {name} has GGUF type {q.name}; ddo streams quantized tensors as stored, into the "
                    f"weights of Linear layers Diffusers quantizes only ({type(owner).__name__} {owner_path or '(root)'} is "
                    "not one): store it as F32 or F16 (or BF16 in modules Diffusers keeps unquantized)"
                )
            replaced[id(param)] = new if isinstance(new, GGUFParameter) else torch.nn.Parameter(new, requires_grad=False)
        owner._parameters[leaf] = replaced[id(param)]
    quantizer.postprocess_model(module)
    module.hf_quantizer = quantizer
    return module.eval()


def _local_path(path: Union[str, os.PathLike], revision: Optional[str]) -> str:
    """``path`` itself when it exists; else a Hugging Face hub id (``org/name``) resolved in the
    local hub cache (``HF_HUB_CACHE`` / ``HF_HOME``), without network access."""
    text = os.fspath(path)
    if os.path.exists(text) or text.count("/") != 1 or text.startswith((".", "/", "~")):
        return text
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise DynamicOffloadError(
            f"{text!r} is not a local path, and resolving it as a hub id needs huggingface_hub (pip install huggingface_hub)"
        ) from None
    try:
        return snapshot_download(text, revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        from huggingface_hub.constants import HF_HUB_CACHE

        raise DynamicOffloadError(
            f"{text!r} is neither a local path nor in the Hugging Face cache at {HF_HUB_CACHE}"
            f"{f' (revision {revision})' if revision else ''}; ddo reads the cache only: fetch it first with "
            f"`hf download {text}` (or huggingface_hub.snapshot_download), or pass a local folder"
        ) from None


def _loader_of(folder: str) -> Any:
    """The class a model folder's ``config.json`` names: a Diffusers ``_class_name``, else the
    first transformers ``architectures`` entry."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise DynamicOffloadError(
            f"{folder} has no config.json: point at a model folder (or its subfolder=), or pass model_loader="
        ) from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise DynamicOffloadError(f"{path} cannot be read as JSON ({e}); fix the file or pass model_loader=") from None
    if not isinstance(config, dict):
        raise DynamicOffloadError(f"{path} holds {type(config).__name__}, not an object; fix the file or pass model_loader=")
    class_name = config.get("_class_name")
    if class_name is not None:
        import diffusers

        loader = getattr(diffusers, str(class_name), None)
        if not isinstance(loader, type):
            raise DynamicOffloadError(f"{folder}/config.json names class {class_name!r}, which diffusers does not have; pass model_loader=")
        return loader
    architectures = config.get("architectures") or []
    if architectures:
        import transformers

        loader = getattr(transformers, str(architectures[0]), None)
        if loader is None:
            raise DynamicOffloadError(
                f"{folder}/config.json names architecture {architectures[0]!r}, which transformers "
                f"{transformers.__version__} does not have; pass model_loader="
            )
        return loader
    raise DynamicOffloadError(
        f"{folder}/config.json names neither a Diffusers class (_class_name) nor a transformers architecture "
        "(architectures); pass model_loader="
    )


def _is_transformers(loader: Any) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(loader, type) and issubclass(loader, PreTrainedModel)


def _meta_transformers(loader: Any, folder: str, kwargs: Dict[str, Any]) -> Optional[torch.nn.Module]:
    """A transformers model as its ``from_pretrained`` builds it (dtypes, ``_keep_in_fp32_modules``,
    tied weights) with every parameter on the meta device, and non-persistent buffers computed
    as construction computes them. ``None`` when a buffer's values come from the checkpoint."""
    try:
        import accelerate
    except ImportError:
        return None
    dtype_kwargs = {k: kwargs[k] for k in ("dtype", "torch_dtype") if k in kwargs}
    extra = {k: kwargs[k] for k in ("revision", "trust_remote_code", "variant") if k in kwargs}
    # Recent transformers swap layers for kernels of the loading device ("kernelize") by default;
    # a model on the meta device has none, and ddo keeps the model's own layers.
    try:
        module = loader.from_pretrained(folder, device_map="meta", use_kernels=False, **dtype_kwargs, **extra)
    except TypeError as e:
        if "use_kernels" not in str(e):
            raise
        module = loader.from_pretrained(folder, device_map="meta", **dtype_kwargs, **extra)
    missing = [n for n, b in module.named_buffers() if b.is_meta]
    if missing:
        if set(missing) & set(module.state_dict().keys()):
            return None
        # Buffers are computed as construction under the loaded dtype computes them.
        dtype = getattr(module.config, "dtype", None) or getattr(module.config, "torch_dtype", None)
        dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        with accelerate.init_empty_weights(include_buffers=False):
            skeleton = loader._from_config(module.config, **({"dtype": dtype} if isinstance(dtype, torch.dtype) else {}))
        real = dict(skeleton.named_buffers())
        for name in missing:
            owner, _, leaf = name.rpartition(".")
            holder = module.get_submodule(owner) if owner else module
            holder._buffers[leaf] = real[name]
    return module.eval()


def _meta_module(loader: Any, folder: str, dtype: Any) -> Optional[torch.nn.Module]:
    """The model built from its config as Diffusers' ``from_pretrained(torch_dtype=dtype)``
    builds it, with every parameter on the meta device (its bytes come from the checkpoint):
    constructed under ``dtype`` as the default dtype, non-persistent buffers computed, and
    parameters of the class's ``_keep_in_fp32_modules`` in fp32. ``None`` when the model has
    persistent buffers (their values come from the checkpoint) or cannot be built that way."""
    try:
        import accelerate
        from diffusers.models.modeling_utils import no_init_weights
    except ImportError:
        return None
    config = loader.load_config(folder)
    previous = torch.get_default_dtype()
    floating = isinstance(dtype, torch.dtype) and dtype.is_floating_point
    try:
        if floating:
            torch.set_default_dtype(dtype)
        with no_init_weights(), accelerate.init_empty_weights():
            module = loader.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    persistent = set(module.state_dict().keys()) - {n for n, _ in module.named_parameters(remove_duplicate=False)}
    if persistent:
        return None
    keep = getattr(loader, "_keep_in_fp32_modules", None) or []
    keep = [keep] if isinstance(keep, str) else list(keep)
    if floating:
        # One replacement per parameter, set under every name it has (tied parameters stay tied).
        replaced: Dict[int, torch.nn.Parameter] = {}
        for name, param in list(module.named_parameters(remove_duplicate=False)):
            want = torch.float32 if any(k in name.split(".") for k in keep) else dtype
            if id(param) not in replaced and param.is_floating_point() and param.dtype != want:
                replaced[id(param)] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=want, device="meta"), requires_grad=param.requires_grad
                )
            if id(param) in replaced:
                owner, _, leaf = name.rpartition(".")
                holder = module.get_submodule(owner) if owner else module
                holder._parameters[leaf] = replaced[id(param)]
    return module.eval()


def inspect_host_memory(
    module: Optional[torch.nn.Module] = None, *, phase: str = "", max_storage_samples: int = 16
) -> DynamicOffloadMetrics:
    """Route ``host_memory_observation``: this process's RSS and the host's limits, and with
    ``module`` a census of its host (CPU) parameter and buffer storages, grouped by storage, with
    up to ``max_storage_samples`` of the largest (bytes, tensor names, and the checkpoint file a
    storage is bound to when the module came from :func:`from_pretrained_with_dynamic_offload`).
    Never touches CUDA."""
    if max_storage_samples < 0:
        raise ValueError(f"max_storage_samples must be >= 0, not {max_storage_samples}")
    setup: Dict[str, Any] = {}
    if module is not None:
        storages: Dict[tuple, Dict[str, Any]] = {}
        tensors = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
        for name, t in tensors:
            if t.device.type != "cpu" or t.is_meta or isinstance(t, StreamedWeight):
                continue
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            entry = storages.setdefault(key, {"bytes": storage.nbytes(), "tensors": []})
            entry["tensors"].append(name)
        source = getattr(module, "_ddo_source", None) or {}
        files = {t["name"]: t.get("file") for t in source.get("tensors", [])}
        samples = sorted(storages.values(), key=lambda e: -e["bytes"])[:max_storage_samples]
        for e in samples:
            shard = next((files[n] for n in e["tensors"] if files.get(n)), None)
            if shard:
                e["shard"] = shard
        setup = {
            "host_storage_groups": len(storages),
            "host_storage_bytes": sum(e["bytes"] for e in storages.values()),
            "host_storage_samples": samples,
        }
    return DynamicOffloadMetrics(route="host_memory_observation", setup=setup, host_memory=_host_memory(phase or "inspect"))
