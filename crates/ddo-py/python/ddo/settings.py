"""Resolved settings: what the native resolver decided for one component."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from . import _native
from .config import DynamicOffloadConfig, component_policy_dict

__all__ = [
    "DynamicOffloadSettings",
    "load_dynamic_offload_settings_from_env",
    "get_dynamic_offload_presets",
    "format_dynamic_offload_presets",
    "is_wsl_environment",
]


def is_wsl_environment() -> bool:
    """Whether this Linux kernel is WSL's (decided by the native extension)."""
    return _native.running_on_wsl()


def ddo_environment(environ: Optional[Mapping[str, str]], use_environment: bool) -> dict[str, str]:
    """The ``DDO_*`` variables to resolve with: ``environ`` when given, else the process's; none
    with ``use_environment=False``."""
    if not use_environment:
        return {}
    source = os.environ if environ is None else environ
    return {k: str(v) for k, v in source.items() if k.startswith("DDO_")}


@dataclass(frozen=True)
class DynamicOffloadSettings:
    """One component's resolved plan."""

    component: str
    backend: str
    requested_preset: str
    effective_preset: str
    execution_mode: str
    route: Mapping[str, Any]
    values: Mapping[str, Any]
    origins: Mapping[str, str]
    configuration: Mapping[str, Any]
    running_on_wsl: bool
    effective_pin_cpu_memory: bool
    device: str
    warnings: tuple
    session_route: bool
    native: Any = field(repr=False, compare=False, default=None)
    explicit: Mapping[str, Any] = field(default_factory=dict)

    @property
    def runs_in_session(self) -> bool:
        """Whether the route streams through ddo's arena (``linear_runtime``,
        ``vmm_fast_runtime``)."""
        return self.session_route

    @property
    def route_name(self) -> str:
        """``linear_runtime``, ``vmm_fast_runtime``, ``vmm_runtime``,
        ``diffusers_group_offload`` or ``none``."""
        return str(self.route["name"])

    def as_metrics(self) -> dict[str, Any]:
        """The configuration section of metrics."""
        return dict(self.configuration)


def resolve_settings(
    component: str,
    *,
    arguments: Optional[Mapping[str, Any]] = None,
    group: Optional[Mapping[str, Any]] = None,
    config: Optional[DynamicOffloadConfig] = None,
    environ: Optional[Mapping[str, str]] = None,
    use_environment: bool = True,
    running_on_wsl: Optional[bool] = None,
) -> DynamicOffloadSettings:
    """Resolves ``component`` through the native resolver; a bad value raises
    :class:`DynamicOffloadConfigError`."""
    args = DynamicOffloadConfig().replace(**dict(arguments or {})) if arguments else DynamicOffloadConfig()
    native = _native.resolve(
        component,
        args.to_json("argument"),
        json.dumps(component_policy_dict(group or {})),
        config.to_json() if config is not None else None,
        ddo_environment(environ, use_environment),
        running_on_wsl,
    )
    plan = json.loads(native.json())
    return DynamicOffloadSettings(
        component=plan["component"],
        backend=plan["backend"],
        requested_preset=plan["requested_preset"],
        effective_preset=plan["effective_preset"],
        execution_mode=plan["execution_mode"],
        route=plan["route"],
        values=plan["settings"],
        origins=plan["origins"],
        configuration=plan["configuration"],
        running_on_wsl=plan["running_on_wsl"],
        effective_pin_cpu_memory=plan["effective_pin_cpu_memory"],
        device=plan["device"],
        session_route=plan["session_route"],
        warnings=tuple(plan.get("warnings", ())),
        native=native,
        explicit=dict(arguments or {}),
    )


def load_dynamic_offload_settings_from_env(
    *,
    component: str = "model",
    environ: Optional[Mapping[str, str]] = None,
    default_preset: str = "",
    running_on_wsl: Optional[bool] = None,
) -> DynamicOffloadSettings:
    """Settings from ``DDO_*`` variables (``environ`` or the process's), the preset and defaults.
    ``default_preset`` applies when ``DDO_PRESET`` is unset."""
    env = ddo_environment(environ, True)
    if default_preset and "DDO_PRESET" not in env:
        env["DDO_PRESET"] = default_preset
    return resolve_settings(component, environ=env, running_on_wsl=running_on_wsl)


def get_dynamic_offload_presets() -> dict[str, dict[str, str]]:
    """Every preset's values, keys without the ``DDO_`` prefix."""
    return json.loads(_native.preset_values())


def format_dynamic_offload_presets() -> str:
    """The text listing of presets and their values."""
    return _native.format_presets()
