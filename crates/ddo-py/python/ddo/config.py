"""The configuration users set. Resolution (presets, environment, precedence, validation) happens
in the native extension; this module only carries the values across."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from . import _native
from .errors import DynamicOffloadConfigError

__all__ = ["DynamicOffloadConfig", "ComponentPolicy"]

_COMPONENT_KEYS = (
    "route",
    "group_offload",
    "dynamic_offload",
    "offload_type",
    "use_stream",
    "record_stream",
    "low_cpu_mem_usage",
    "num_blocks_per_group",
)


@dataclass(frozen=True)
class ComponentPolicy:
    """How one component (``transformer``, ``vae``, ``text_encoder``) is handled. Unset fields are
    decided by variables, the preset and defaults."""

    route: Optional[str] = None
    group_offload: Optional[bool] = None
    dynamic_offload: Optional[bool] = None
    offload_type: Optional[str] = None
    use_stream: Optional[bool] = None
    record_stream: Optional[bool] = None
    low_cpu_mem_usage: Optional[bool] = None
    num_blocks_per_group: Optional[int] = None

    def as_dict(self) -> dict[str, Any]:
        """The set fields only."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class DynamicOffloadConfig:
    """Every setting ddo has. All fields are optional: an unset field comes from the component's
    ``DDO_<COMPONENT>_*`` variable, the ``DDO_*`` variable, the preset, then the default.

    Sizes ending in ``_gb`` are GiB. See ``format_dynamic_offload_presets()`` for preset values.
    """

    preset: Optional[str] = None
    backend: Optional[str] = None
    route: Optional[str] = None
    components: Mapping[str, ComponentPolicy] = field(default_factory=dict)
    execution_device: Optional[str] = None
    offload_device: Optional[str] = None
    vmm_resident_weight_budget_gb: Optional[float] = None
    resident_module_budget_gb: Optional[float] = None
    max_resident_module_budget_gb: Optional[float] = None
    auto_vram_headroom_gb: Optional[float] = None
    auto_budget_policy: Optional[str] = None
    auto_full_pin_min_model_to_vram_ratio: Optional[float] = None
    pin_cpu_memory: Optional[bool] = None
    allow_pin_memory_fallback: Optional[bool] = None
    disable_pin_on_wsl: Optional[bool] = None
    pin_cpu_workers: Optional[int] = None
    cache_pinned_weights: Optional[bool] = None
    pin_weight_budget_gb: Optional[float] = None
    pin_weight_budget_ratio: Optional[float] = None
    max_pin_weight_budget_gb: Optional[float] = None
    pin_weight_selection: Optional[str] = None
    system_ram_headroom_gb: Optional[float] = None
    vmm_source_cache_gb: Optional[float] = None
    vmm_source_registered_gb: Optional[float] = None
    vmm_staging_buffer_gb: Optional[float] = None
    load_safetensors_backend: Optional[str] = None
    vmm_module_pattern: Optional[str] = None
    skip_modules_pattern: Optional[Sequence[str]] = None
    always_resident_modules_pattern: Optional[Sequence[str]] = None
    resident_module_patterns: Optional[Sequence[str]] = None
    resident_module_selection: Optional[str] = None
    small_tensor_threshold_kb: Optional[int] = None
    prefetch_depth: Optional[int] = None
    vmm_execution_backing_reclaim: Optional[bool] = None
    verbose: Optional[bool] = None
    show_profile: Optional[bool] = None

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of every field."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> "DynamicOffloadConfig":
        """A copy with ``changes``; an unknown name is a ``TypeError``."""
        unknown = sorted(set(changes) - set(self.field_names()))
        if unknown:
            raise TypeError(f"unknown DynamicOffloadConfig field(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """The set fields only, as the native resolver takes them."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "components":
                comps = {
                    name: (p.as_dict() if isinstance(p, ComponentPolicy) else dict(p))
                    for name, p in (v or {}).items()
                }
                if comps:
                    out["components"] = comps
            elif v is not None:
                out[f.name] = list(v) if isinstance(v, (list, tuple)) else v
        return out

    def to_json(self) -> str:
        """The set fields as JSON; validated by the native schema (unknown fields refused)."""
        text = json.dumps(self.as_dict())
        try:
            _native.check_config(text)
        except ValueError as e:
            raise DynamicOffloadConfigError(str(e)) from None
        return text


def component_policy_dict(values: Mapping[str, Any]) -> dict[str, Any]:
    """Explicit component keyword arguments (``use_stream=...``) as a policy dict."""
    return {k: v for k, v in values.items() if k in _COMPONENT_KEYS and v is not None}
