"""The published library's remaining entry points, on ddo's runtime: the dynamic-only entry
(`enable_dynamic_offload`, `apply_dynamic_offload`), layout inspection, and the names ddo
answers with what it does instead."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

import torch

from .api import _AUTO, _CUDA0, enable_offload
from .config import DynamicOffloadConfig
from .errors import DynamicOffloadError
from .metrics import DynamicOffloadMetrics
from .runtime import find_execution_units
from .settings import DynamicOffloadSettings
from .hook import DynamicOffloadHook

__all__ = [
    "DynamicOffloadHook",
    "DynamicOffloadPlanEntry",
    "VmmWeightLease",
    "VmmWeightStore",
    "VmmWeightStoreStats",
    "apply_dynamic_offload",
    "build_dynamic_offload_event_payload",
    "clear_dynamic_offload_pinned_tensor_cache",
    "clear_dynamic_offload_plan_cache",
    "detect_quantized_backend_modules",
    "enable_dynamic_offload",
    "inspect_vmm_component",
]

_TARGET_CLASSES = (torch.nn.Linear, torch.nn.Embedding)


def enable_dynamic_offload(
    module: torch.nn.Module,
    *,
    component: str = "model",
    settings: Optional[DynamicOffloadSettings] = None,
    config: Optional[DynamicOffloadConfig] = None,
    preset: str = _AUTO,
    execution_device: Union[str, torch.device] = _CUDA0,
    offload_device: Union[str, torch.device] = "cpu",
    target_module_classes: Sequence[type] = _TARGET_CLASSES,
    skip_modules_pattern: Sequence[str] = (),
    always_resident_modules_pattern: Union[str, Sequence[str], None] = None,
    running_on_wsl: Optional[bool] = None,
    environ: Optional[Mapping[str, str]] = None,
    use_environment: bool = True,
    apply_hook: bool = True,
    record_event: Optional[Callable[[str, Dict[str, Any]], Any]] = None,
    event_name: str = "setup_dynamic_offload",
    **config_overrides: Any,
):
    """ddo's runtime route for ``module`` whatever its component's preset default
    (:func:`enable_offload` with ``route="dynamic_offload"``). ``target_module_classes`` other
    than ``(Linear, Embedding)`` and a non-empty ``skip_modules_pattern`` are refused with what
    ddo does instead (it streams every parameter of each block)."""
    overrides = dict(config_overrides)
    if tuple(target_module_classes) != _TARGET_CLASSES:
        overrides["target_module_classes"] = [c if isinstance(c, str) else c.__name__ for c in target_module_classes]
    if tuple(skip_modules_pattern):
        overrides["skip_modules_pattern"] = list(skip_modules_pattern)
    if always_resident_modules_pattern is not None:
        p = always_resident_modules_pattern
        overrides["always_resident_modules_pattern"] = [p] if isinstance(p, str) else list(p)
    # No component route default applies here: the route is ddo's runtime, on top of settings too.
    overrides.update(route="dynamic_offload", preset=preset, execution_device=execution_device, config=config)
    return enable_offload(
        module,
        component=component,
        settings=settings,
        offload_device=offload_device,
        running_on_wsl=running_on_wsl,
        environ=environ,
        use_environment=use_environment,
        apply_hook=apply_hook,
        record_event=record_event,
        dynamic_event_name=event_name,
        **overrides,
    )


def apply_dynamic_offload(module: torch.nn.Module, config: Optional[DynamicOffloadConfig] = None):
    """Attaches ddo's runtime route to ``module`` with ``config`` and returns what runs it
    (``result.hook``); :func:`remove_dynamic_offload` detaches it."""
    return enable_offload(module, config=config, route="dynamic_offload").hook


def detect_quantized_backend_modules(module: torch.nn.Module) -> Dict[str, Any]:
    """``{}``, or ``{"sdnq_module_count": n, "sdnq_status": "detected_forward_preserved"}`` for
    SDNQ-quantized layers (a ``forward_func`` with an ``sdnq_dequantizer`` or an ``SDNQTensor``
    weight), which ddo leaves to Diffusers' group offload."""
    count = 0
    for m in module.modules():
        weight = getattr(m, "weight", None)
        if hasattr(m, "forward_func") and (
            hasattr(m, "sdnq_dequantizer") or type(weight).__name__ == "SDNQTensor"
        ):
            count += 1
    return {"sdnq_module_count": count, "sdnq_status": "detected_forward_preserved"} if count else {}


def build_dynamic_offload_event_payload(
    settings: DynamicOffloadSettings, state: Any, config: Optional[DynamicOffloadConfig] = None
) -> Dict[str, Any]:
    """The setup event of a component: its resolved configuration and, when given, its state
    (anything with ``as_dict()``, such as :func:`get_dynamic_offload_state`'s)."""
    payload: Dict[str, Any] = {
        "component": settings.component,
        "execution_mode": settings.execution_mode,
        "route": settings.route_name,
        "configuration": settings.as_metrics(),
    }
    if config is not None:
        payload["config"] = config.as_dict()
    if state is not None:
        payload["state"] = state.as_dict() if hasattr(state, "as_dict") else dict(state)
    return payload


def clear_dynamic_offload_plan_cache() -> None:
    """Nothing to clear: ddo plans each attach (planning is cheap) and keeps no plan cache."""


def clear_dynamic_offload_pinned_tensor_cache() -> None:
    """Nothing to clear: ddo registers host tensors in place and keeps no pinned copies."""


@dataclass(frozen=True)
class DynamicOffloadPlanEntry:
    """One tensor of a plan: where it goes (``resident_module``, ``resident_small``,
    ``streamed_large``)."""

    module_name: str
    module_type: str
    tensor_name: str
    shape: tuple
    dtype: str
    device: str
    bytes: int
    placement: str


def plan_entries(module: torch.nn.Module, module_pattern: str = ".*") -> list:
    """The plan entries of ``module`` by ddo's unit rule: a unit's parameters are
    ``streamed_large``, the rest ``resident_module``."""
    units = [p for p, _ in find_execution_units(module) if re.search(module_pattern, p)]
    out = []
    for mname, m in module.named_modules():
        for tname, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
            full = f"{mname}.{tname}" if mname else tname
            streamed = isinstance(t, torch.nn.Parameter) and any(full.startswith(u + ".") for u in units)
            out.append(
                DynamicOffloadPlanEntry(
                    module_name=mname,
                    module_type=type(m).__name__,
                    tensor_name=tname,
                    shape=tuple(t.shape),
                    dtype=str(t.dtype).replace("torch.", ""),
                    device=str(t.device),
                    bytes=t.numel() * t.element_size(),
                    placement="streamed_large" if streamed else "resident_module",
                )
            )
    return out


def inspect_vmm_component(
    module: torch.nn.Module, *, component: str = "model", module_pattern: str = ".*"
) -> DynamicOffloadMetrics:
    """Route ``vmm_capacity_inspection``: the blocks ddo's native route would stream for
    ``module`` (those matching ``module_pattern``) and their bytes, from metadata only (no CUDA,
    no weights read)."""
    try:
        re.compile(module_pattern)
    except re.error as e:
        raise DynamicOffloadError(f"module_pattern {module_pattern!r} is not a regex: {e}") from None
    entries = plan_entries(module, module_pattern)
    units = [p for p, _ in find_execution_units(module) if re.search(module_pattern, p)]
    unit_bytes = {u: 0 for u in units}
    for e in entries:
        full = f"{e.module_name}.{e.tensor_name}" if e.module_name else e.tensor_name
        for u in units:
            if full.startswith(u + "."):
                unit_bytes[u] += e.bytes
                break
    streamed = sum(unit_bytes.values())
    total = sum(e.bytes for e in entries)
    setup = {
        "module_count": sum(1 for _ in module.modules()),
        "tensor_count": len(entries),
        "total_bytes": total,
        "unit_count": len(units),
        "streamed_units": len(units),
        "streamed_bytes_per_pass": streamed,
        "resident_bytes": total - streamed,
        "largest_unit_bytes": max(unit_bytes.values(), default=0),
        "module_pattern": module_pattern,
    }
    return DynamicOffloadMetrics(
        route="vmm_capacity_inspection", setup=setup, execution={"route": "vmm_fast_runtime", "component": component}
    )


def _refused(name: str, instead: str, parameters: Sequence[str] = ()) -> type:
    """A published type ddo does not provide: constructing it raises with ``instead``. Its
    signature names the published constructor's ``parameters``."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise DynamicOffloadError(f"{name} is not part of ddo: {instead}")

    signature = inspect.Signature(
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None) for p in parameters]
    )
    return type(
        name,
        (),
        {"__init__": __init__, "__doc__": f"Not part of ddo: {instead}.", "__module__": __name__, "__signature__": signature},
    )


VmmWeightStore = _refused(
    "VmmWeightStore",
    "ddo's arena owns GPU weight memory; offload a component with enable_offload(module, backend='vmm') or "
    "from_pretrained_with_dynamic_offload(..., apply_dynamic=True)",
    ("device_id", "max_resident_bytes"),
)
VmmWeightLease = _refused(
    "VmmWeightLease", "ddo leases a block's weights around its forward by itself; offload with enable_offload"
)
VmmWeightStoreStats = _refused(
    "VmmWeightStoreStats",
    "read the arena's counters from result.metrics_snapshot().as_dict()['runtime'] or result.hook.vmm_runtime_stats()",
    ("reserved_bytes", "resident_bytes", "materializations", "evictions", "copied_bytes"),
)
