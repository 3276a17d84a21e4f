"""The hook an offload result exposes (``result.hook``): the published hook's attributes, read from
ddo's session runtime, and its Diffusers hook lifecycle. Hosts of the published library read
``result.hook.config``, ``result.hook.state`` and ``result.hook.vmm_runtime_stats()``; here each
comes from what ddo resolved and measured, never from invented figures. The lifecycle methods
(``initialize_hook``, ``pre_forward``, ``post_forward``, ``detach_hook`` / ``deinitalize_hook``,
``reset_state``) act on ddo's attached offload: ddo initializes the hook when it attaches, and
detaching removes the offload."""

from __future__ import annotations

import sys
import time
from typing import Any, Dict, List, Optional, TextIO, Tuple

import torch

from .. import _native
from ..errors import DynamicOffloadError, DynamicOffloadUnsupportedError

__all__ = ["DynamicOffloadHook"]

# The published store's aggregate counters, and the runtime counter of ddo's that measures the
# same thing (None: ddo measures nothing that means the same, so the figure is None).
_PUBLISHED_STATS = {
    # Virtual address space the published store reserves; ddo's arena reports device bytes held,
    # not reserved address space.
    "reserved_bytes": None,
    # Pages the published store materialized; ddo counts unit uploads (``uploads``), not pages.
    "materializations": None,
    # Units evicted from the device.
    "evictions": "evictions",
    # Bytes copied to the device.
    "copied_bytes": "upload_bytes",
}

_REFUSED = (
    "DynamicOffloadHook(config) is not built by hosts in ddo: attach with enable_offload(module) or "
    "apply_dynamic_offload(module, config), and read the attached hook as result.hook (config, state, "
    "vmm_runtime_stats(), metrics_snapshot() on the result)"
)


class DynamicOffloadHook:
    """The attached offload of one component on ddo's arena routes (``linear_runtime``,
    ``vmm_fast_runtime``): ``result.hook``. ``config`` is every resolved setting, ``state`` what
    ddo did to the module (:class:`ddo.DynamicOffloadState`, read now), ``vmm_runtime_stats()``
    the runtime counters. Other attributes are the session runtime's (``hook.runtime``).

    Hosts do not construct it: ``DynamicOffloadHook(config)`` is refused with what to call."""

    # Diffusers' hook registry resets only stateful hooks; like the published hook, this one keeps
    # no state a new generation must reset.
    _is_stateful = False

    def __init__(self, config: Any = None) -> None:  # noqa: ARG002 - the published signature
        raise DynamicOffloadUnsupportedError(_REFUSED)

    @classmethod
    def _of(cls, result: Any) -> "DynamicOffloadHook":
        hook = object.__new__(cls)
        hook.__dict__["_result"] = result
        # Inputs moved by pre_forward, by copy name: [host seconds, bytes, calls].
        hook.__dict__["_input_copies"] = {}
        return hook

    # ---- the published hook's attributes ------------------------------------------------

    @property
    def result(self) -> Any:
        """The :class:`ddo.DynamicOffloadApplyResult` this hook belongs to."""
        return self.__dict__["_result"]

    @property
    def runtime(self) -> Any:
        """ddo's session runtime that runs the component's forward."""
        return self.result.runtime

    @property
    def module(self) -> torch.nn.Module:
        """The offloaded module."""
        return self.result.module

    @property
    def config(self) -> Any:
        """Every setting as resolved for this component, as a :class:`ddo.DynamicOffloadConfig`
        (each field set, so it resolves to the same values)."""
        return self.result.settings.config

    @property
    def state(self) -> Any:
        """What ddo did to the module, read now (:func:`ddo.get_dynamic_offload_state`): modules,
        bytes by placement, the units; ``None`` once the offload was removed."""
        from .state import state_of

        if self.result._removed:
            return None
        return state_of(self.result)

    @property
    def execution_device(self) -> torch.device:
        """The device the component runs on."""
        return self.result.execution_device

    @property
    def offload_device(self) -> torch.device:
        """Where streamed weights live between uses: host memory."""
        return torch.device("cpu")

    @property
    def execution_mode(self) -> str:
        """The resolved execution mode (``linear_runtime``, ``vmm_fast_runtime``)."""
        return str(self.result.settings.execution_mode)

    def vmm_runtime_stats(self) -> Dict[str, Any]:
        """The arena's runtime counters now: ddo's own (``passes``, ``uploads``, ``upload_bytes``,
        ``upload_seconds``, ``wait_seconds``, ``resident_bytes``, ``slot_bytes``, ``peak_bytes``,
        ...; a counter the route does not have is absent), plus the published store's aggregate
        names: ``copied_bytes`` (= ``upload_bytes``) and ``evictions`` where ddo measures them,
        ``reserved_bytes`` and ``materializations`` ``None`` (ddo's arena measures neither: it
        counts device bytes held and unit uploads, in the keys above)."""
        if self.result._removed or self.runtime is None or self.runtime.session is None:
            raise DynamicOffloadError("vmm_runtime_stats() needs an attached offload; this one was removed")
        runtime = dict(self.runtime.metrics("snapshot").get("runtime", {}))
        stats: Dict[str, Any] = {
            k: v for k, v in runtime.items() if not isinstance(v, dict)
        }
        for published, ours in _PUBLISHED_STATS.items():
            stats[published] = runtime.get(ours) if ours is not None else None
        return stats

    def collect_completed_runtime_resources(self) -> Dict[str, Any]:
        """The published hook retires finished source tickets here. ddo's session holds no such
        tickets (each release is fenced on the stream that used it and reused only after the
        fence), so there is nothing to collect: ``status`` ``not_applicable``, never blocking."""
        return {"status": "not_applicable", "blocking": False}

    def print_profile_summary(self, top_n: int = 8, *, file: Optional[TextIO] = None) -> None:
        """Prints the ``[dynamic-offload-profile]`` lines (:meth:`ddo.DynamicOffloadApplyResult.print_profile_summary`)."""
        from .state import print_profile_summary

        print_profile_summary(self.result, top_n, file=file if file is not None else sys.stdout)

    # ---- the published hook lifecycle (Diffusers' ModelHook) -------------------------------

    def _own(self, module: Any, what: str) -> None:
        if module is not self.module:
            raise _native.DynamicOffloadLifecycleError(
                f"DynamicOffloadHook.{what}() was given a {type(module).__name__}, but this hook offloads the "
                f"{type(self.module).__name__} it was attached to; call remove_dynamic_offload(module) or "
                "enable_offload(module) on the module itself"
            )

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        """ddo initializes the hook when it attaches (:func:`ddo.enable_offload`,
        :func:`ddo.apply_dynamic_offload`), so on the module it offloads this returns ``module``
        as it is. Another module, or a removed offload, is refused with what to call instead."""
        if self.result._removed:
            raise _native.DynamicOffloadLifecycleError(
                "DynamicOffloadHook.initialize_hook(): this offload was removed, and a removed hook is not "
                "initialized again; offload the module again with enable_offload(module)"
            )
        if module is not self.module:
            raise DynamicOffloadUnsupportedError(
                f"DynamicOffloadHook.initialize_hook() on another module is not part of ddo: a hook is initialized "
                f"once, on the module it offloads (here a {type(self.module).__name__}), when enable_offload(module) "
                f"or apply_dynamic_offload(module, config) attaches it; offload the {type(module).__name__} with its "
                "own enable_offload call"
            )
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Tuple[tuple, dict]:
        """``(args, kwargs)`` with every tensor inside them (tuples, lists, dicts) moved to the
        execution device without blocking; meta tensors and tensors already there are kept.
        Each copy is counted in ``state`` under ``forward_input`` (``forward_input:<key>`` for a
        keyword and for a dict entry): host seconds to enqueue it, bytes, calls. ddo's own
        forward moves its inputs the same way without counting them."""
        del module  # the published hook moves the inputs whatever module it is given
        moved_args = tuple(self._to_execution_device(value, "forward_input") for value in args)
        moved_kwargs = {k: self._to_execution_device(v, f"forward_input:{k}") for k, v in kwargs.items()}
        return moved_args, moved_kwargs

    def _to_execution_device(self, value: Any, name: str) -> Any:
        if isinstance(value, torch.Tensor):
            device = self.execution_device
            if value.device == device or value.is_meta:
                return value
            start = time.perf_counter()
            moved = value.to(device, non_blocking=True)
            copies: Dict[str, List[Any]] = self.__dict__["_input_copies"]
            entry = copies.setdefault(name, [0.0, 0, 0])
            entry[0] += time.perf_counter() - start
            entry[1] += moved.numel() * moved.element_size()
            entry[2] += 1
            return moved
        if isinstance(value, tuple):
            return tuple(self._to_execution_device(v, name) for v in value)
        if isinstance(value, list):
            return [self._to_execution_device(v, name) for v in value]
        if isinstance(value, dict):
            return {k: self._to_execution_device(v, f"{name}:{k}") for k, v in value.items()}
        return value

    def input_copies(self) -> Dict[str, Tuple[float, int, int]]:
        """What :meth:`pre_forward` moved so far, by copy name: ``(host seconds, bytes, calls)``."""
        return {name: (float(s), int(b), int(c)) for name, (s, b, c) in self.__dict__["_input_copies"].items()}

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        """``output`` unchanged, as published: each block's lease is given back by that block's
        own post-forward hook, and the component's output is never touched."""
        del module
        return output

    def detach_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        """Removes the offload from ``module`` (:meth:`ddo.DynamicOffloadApplyResult.remove`: the
        linear route gives the module its host tensors back, the native route leaves meta
        placeholders) and returns it. Refused inside the module's forward; once removed, a
        second call returns ``module``."""
        self._own(module, "detach_hook")
        self.result.remove()
        return module

    def deinitalize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        """:meth:`detach_hook`, under the published (and Diffusers') spelling."""
        self._own(module, "deinitalize_hook")
        self.result.remove()
        return module

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module``, as published: the hook is not stateful. The execution order ddo learned
        stays valid across generations (every pass checks it, and a changed order falls back to
        on-demand uploads), so there is nothing a new generation must reset."""
        self._own(module, "reset_state")
        return module

    # ---- the rest is the session runtime's ----------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.runtime, name)

    def __repr__(self) -> str:
        return (
            f"DynamicOffloadHook(component={self.result.settings.component!r}, "
            f"route={self.result.runtime_route or self.result.route!r}, device={str(self.execution_device)!r})"
        )
