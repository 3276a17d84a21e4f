"""The hook an offload result exposes (``result.hook``): the published hook's attributes, read from
ddo's session runtime. Hosts of the published library read ``result.hook.config``,
``result.hook.state`` and ``result.hook.vmm_runtime_stats()``; here each comes from what ddo
resolved and measured, never from invented figures."""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, TextIO

import torch

from ..errors import DynamicOffloadError

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

    def __init__(self, config: Any = None) -> None:  # noqa: ARG002 - the published signature
        raise DynamicOffloadError(_REFUSED)

    @classmethod
    def _of(cls, result: Any) -> "DynamicOffloadHook":
        hook = object.__new__(cls)
        hook.__dict__["_result"] = result
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
