"""The published library's event and cache helpers: the setup event payload, SDNQ detection, and
the caches ddo does not keep."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ..config import DynamicOffloadConfig
from ..settings import DynamicOffloadSettings

__all__ = [
    "build_dynamic_offload_event_payload",
    "clear_dynamic_offload_pinned_tensor_cache",
    "clear_dynamic_offload_plan_cache",
    "detect_quantized_backend_modules",
]


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
