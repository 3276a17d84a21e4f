"""Resolved settings: what the native resolver decided for one component."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import torch

from . import _native
from .config import DynamicOffloadConfig, _finite_or_text, component_policy_dict
from .errors import DynamicOffloadConfigError

__all__ = [
    "DDO_PRESETS",
    "DynamicOffloadSettings",
    "dynamic_offload_env_value",
    "dynamic_offload_preset_env_value",
    "format_dynamic_offload_presets",
    "get_available_system_ram_gb",
    "get_dynamic_offload_presets",
    "is_wsl_environment",
    "load_dynamic_offload_settings_from_env",
    "resolve_dynamic_offload_preset",
]

# Presets of the native backend: they inherit no linear preset's values.
_NATIVE_PRESETS = ("vmm_fast", "nvme_baseline")

# Values that read as true in variables and preset tables.
_TRUE = frozenset({"1", "true", "yes", "on"})


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
    """One component's resolved plan. The published library's attributes read as before
    (``config``, ``enabled``, ``plan``, ``requested_pin_cpu_memory``, ``preset_value()``, ...);
    ddo adds where each value came from (``origins``) and the route it chose (``route``)."""

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
    # The route's predicates as ddo-policy states them (``published_name``, ``streams``,
    # ``native``, ``reads_checkpoint``, ``budget_setting``, ``takes_auto_budget``).
    route_facts: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)
    # Whether reading the checkpoint into the page cache while the module is built pays.
    reads_ahead: bool = field(repr=False, compare=False, default=False)
    # What it was resolved from, to resolve another component the same way.
    inputs: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def runs_in_session(self) -> bool:
        """Whether the route streams through ddo's arena (``linear_runtime``,
        ``vmm_fast_runtime``)."""
        return self.session_route

    @property
    def route_name(self) -> str:
        """``linear_runtime``, ``linear_convolution``, ``vmm_fast_runtime``, ``vmm_runtime``,
        ``diffusers_group_offload`` or ``none``."""
        return str(self.route["name"])

    @property
    def config(self) -> DynamicOffloadConfig:
        """Every resolved setting as a config (explicit, so it resolves to the same values)."""
        fields = set(DynamicOffloadConfig.field_names())
        chosen = {k: v for k, v in self.values.items() if k in fields}
        return DynamicOffloadConfig(preset=self.requested_preset, backend=self.backend, **chosen)

    @property
    def enabled(self) -> bool:
        """Whether dynamic offload may run: the execution mode is not ``plan`` (or ``DDO_PLAN``
        asks for it)."""
        return self.execution_mode != "plan" or self.plan

    @property
    def plan(self) -> bool:
        """``DDO_PLAN`` (or the preset's ``PLAN``) as a boolean."""
        return self.preset_bool("DDO_PLAN", False)

    @property
    def requested_pin_cpu_memory(self) -> bool:
        """``pin_cpu_memory`` as resolved, before the WSL rule."""
        return bool(self.values.get("pin_cpu_memory"))

    @property
    def disable_pin_on_wsl(self) -> bool:
        """Whether pinning is turned off on WSL."""
        return bool(self.values.get("disable_pin_on_wsl"))

    @property
    def component_policies(self) -> Mapping[str, Mapping[str, Any]]:
        """The explicit per-component policies this was resolved with."""
        config = self.inputs.get("config")
        policies = dict(getattr(config, "components", None) or {})
        return {k: (v.as_dict() if hasattr(v, "as_dict") else dict(v)) for k, v in policies.items()}

    def preset_value(self, name: str, default: str = "", environ: Optional[Mapping[str, str]] = None) -> str:
        """``name`` (``DDO_X`` or ``X``) from ``environ`` (else the environment this was
        resolved with), else the effective preset's table, else ``default``."""
        key = name if name.startswith("DDO_") else f"DDO_{name}"
        env = environ if environ is not None else self.inputs.get("environ", {})
        if key in env:
            return str(env[key])
        return get_dynamic_offload_presets().get(self.effective_preset, {}).get(key, default)

    def preset_bool(
        self, name: str, default: Union[str, bool] = "0", environ: Optional[Mapping[str, str]] = None
    ) -> bool:
        """:meth:`preset_value` read as a boolean (``1``, ``true``, ``yes``, ``on``). ``default``
        applies when neither the environment nor the preset has ``name``: a text read the same
        way (the published default ``"0"``), or a boolean."""
        value = self.preset_value(name, "", environ)
        if value == "":
            return default if isinstance(default, bool) else str(default).strip().lower() in _TRUE
        return value.strip().lower() in _TRUE

    def as_metrics(self) -> dict[str, Any]:
        """The configuration section of metrics."""
        return dict(self.configuration)

    def for_component(self, component: str) -> "DynamicOffloadSettings":
        """The same inputs resolved for ``component`` (routes and policies are per component)."""
        if component == self.component or not self.inputs:
            return self
        return resolve_settings(component, **self.inputs)

    def resolved_again(
        self,
        component: str,
        *,
        arguments: Optional[Mapping[str, Any]] = None,
        group: Optional[Mapping[str, Any]] = None,
        config: Optional[DynamicOffloadConfig] = None,
        environ: Optional[Mapping[str, str]] = None,
        use_environment: bool = True,
    ) -> "DynamicOffloadSettings":
        """These settings for ``component`` with ``arguments`` and ``group`` values on top (and
        ``config`` / ``environ`` in place of the ones they were resolved with, when given)."""
        more_group = {k: v for k, v in (group or {}).items() if v is not None}
        if not (arguments or more_group or config is not None or environ is not None):
            return self.for_component(component)
        if not self.inputs:
            raise TypeError("these settings were not made by ddo's resolver; pass the keywords without settings=")
        inputs = dict(self.inputs)
        inputs["arguments"] = {**inputs.get("arguments", {}), **dict(arguments or {})}
        inputs["group"] = {**inputs.get("group", {}), **more_group}
        if config is not None:
            inputs["config"] = config
        if environ is not None or not use_environment:
            inputs["environ"] = ddo_environment(environ, use_environment)
        return resolve_settings(component, **inputs)

    @classmethod
    def from_env(cls, **kwargs: Any) -> "DynamicOffloadSettings":
        """:func:`load_dynamic_offload_settings_from_env`."""
        return load_dynamic_offload_settings_from_env(**kwargs)


# The component keywords' kinds (the native resolver checks their values).
_GROUP_KINDS = {
    "group_offload": bool,
    "dynamic_offload": bool,
    "use_stream": bool,
    "record_stream": bool,
    "low_cpu_mem_usage": bool,
    "num_blocks_per_group": int,
    "offload_type": str,
    "route": str,
}


def _checked_group(values: dict) -> dict:
    """Component keywords of the wrong kind, refused naming the keyword."""
    for name, value in values.items():
        kind = _GROUP_KINDS.get(name)
        wrong = kind is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool)))
        if wrong or (kind is int and value < 1):
            raise DynamicOffloadConfigError(
                f"{name} = {value!r} (argument) is not valid: expected "
                + ("a whole number >= 1" if kind is int else "a boolean" if kind is bool else "a name")
            )
    return values


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
        json.dumps(_finite_or_text(_checked_group(component_policy_dict(group or {})))),
        config.to_json() if config is not None else None,
        ddo_environment(environ, use_environment),
        running_on_wsl,
    )
    plan = json.loads(native.json())
    inputs = dict(
        arguments=dict(arguments or {}),
        group=dict(group or {}),
        config=config,
        environ=ddo_environment(environ, use_environment),
        use_environment=True,
        running_on_wsl=running_on_wsl,
    )
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
        route_facts=plan["route_facts"],
        reads_ahead=plan["reads_ahead"],
        inputs=inputs,
    )


def _class_names(classes: Any) -> list:
    return [c if isinstance(c, str) else c.__name__ for c in classes]


# The published default of ``target_module_classes``: ddo streams every parameter, and these are
# the classes the published library streams by default.
_LINEAR_EMBEDDING = (torch.nn.Linear, torch.nn.Embedding)


def load_dynamic_offload_settings_from_env(
    *,
    execution_device: Any = "cuda:0",
    offload_device: Any = "cpu",
    target_module_classes: Any = _LINEAR_EMBEDDING,
    skip_modules_pattern: Any = (),
    always_resident_modules_pattern: Any = None,
    running_on_wsl: Optional[bool] = None,
    environ: Optional[Mapping[str, str]] = None,
    default_preset: str = "",
    component_policies: Optional[Mapping[str, Mapping[str, Any]]] = None,
    component: str = "model",
) -> DynamicOffloadSettings:
    """Settings from ``DDO_*`` variables (``environ`` or the process's), the preset and defaults,
    for ``component``. ``default_preset`` applies when ``DDO_PRESET`` is unset. The keyword
    arguments are the published library's: ``target_module_classes`` other than
    ``(Linear, Embedding)`` and a non-empty ``skip_modules_pattern`` are refused with what ddo
    does instead; ``component_policies`` maps component names to policies."""
    env = ddo_environment(environ, True)
    if default_preset and not env.get("DDO_PRESET", "").strip():
        env["DDO_PRESET"] = default_preset
    arguments: dict[str, Any] = {
        "execution_device": str(execution_device),
        "offload_device": str(offload_device),
        "target_module_classes": _class_names(target_module_classes),
        "skip_modules_pattern": list(skip_modules_pattern or ()),
    }
    if always_resident_modules_pattern is not None:
        patterns = always_resident_modules_pattern
        arguments["always_resident_modules_pattern"] = [patterns] if isinstance(patterns, str) else list(patterns)
    config = DynamicOffloadConfig(components=_policies(component_policies)) if component_policies else None
    return resolve_settings(component, arguments=arguments, config=config, environ=env, running_on_wsl=running_on_wsl)


def _policies(policies: Mapping[str, Mapping[str, Any]]) -> dict:
    """Component policies in the published library's key forms (``VAE``, ``DDO_VAE``;
    ``ROUTE``, ``offload-type``) as ddo's (``vae``; ``route``, ``offload_type``)."""
    out: dict = {}
    for component, values in policies.items():
        name = str(component).strip().lower()
        name = name[len("ddo_"):] if name.startswith("ddo_") else name
        if not isinstance(values, Mapping):
            values = values.as_dict() if hasattr(values, "as_dict") else values
        if not isinstance(values, Mapping):
            raise TypeError(f"component_policies[{component!r}] must be a mapping of policy fields, not {type(values).__name__}")
        fields = {str(k).strip().lower().replace("-", "_"): v for k, v in values.items()}
        if name in out and out[name] != fields:
            raise DynamicOffloadConfigError(
                f"component_policies has two different entries for {name}: {component!r} and another form of it"
            )
        out[name] = fields
    return out


def dynamic_offload_env_value(name: str, default: str = "", environ: Optional[Mapping[str, str]] = None) -> str:
    """The variable ``name`` from ``environ`` (else the process's), or ``default``."""
    source = os.environ if environ is None else environ
    return str(source.get(name, default))


def resolve_dynamic_offload_preset(requested_preset: str, *, running_on_wsl: Optional[bool] = None) -> str:
    """A linear preset's effective name (``auto`` -> ``one_shot_fast``); empty stays empty; an
    unknown name raises :class:`DynamicOffloadConfigError` (a ``ValueError``) listing the valid
    ones. Native presets resolve through :func:`resolve_dynamic_offload_backend` with
    ``backend="vmm"``."""
    name = (requested_preset or "").strip().lower()
    if not name:
        return ""
    effective, _mode = _native.resolve_backend("linear", name)
    return str(effective)


def dynamic_offload_preset_env_value(
    name: str,
    default: str = "",
    *,
    requested_preset: str = "",
    effective_preset: Optional[str] = None,
    running_on_wsl: Optional[bool] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> str:
    """The variable ``name`` when set; else the preset's value of it (``effective_preset``, or
    ``requested_preset`` resolved); else ``default``. Native presets (``vmm_fast``,
    ``nvme_baseline``) inherit no linear preset values, so they give ``default``."""
    source = os.environ if environ is None else environ
    key = name if name.startswith("DDO_") else f"DDO_{name}"
    for form in (name, key):
        if form in source:
            return str(source[form])
    if effective_preset is not None:
        preset = effective_preset.strip().lower()
    elif (requested_preset or "").strip().lower() in _NATIVE_PRESETS:
        preset = requested_preset.strip().lower()
    else:
        preset = resolve_dynamic_offload_preset(requested_preset)
    if preset in _NATIVE_PRESETS or not preset:
        return default
    return get_dynamic_offload_presets().get(preset, {}).get(key, default)


def get_dynamic_offload_presets() -> dict[str, dict[str, str]]:
    """Every preset's values (``auto`` included, as its linear preset), keyed by variable name
    (``DDO_PIN_CPU_MEMORY``)."""
    raw = json.loads(_native.preset_values())
    return {preset: {f"DDO_{k}": v for k, v in values.items()} for preset, values in raw.items()}


# The published library's constant: every preset's variable values.
DDO_PRESETS = get_dynamic_offload_presets()


def format_dynamic_offload_presets(*, default_preset: str = "auto", running_on_wsl: Optional[bool] = None) -> str:
    """The text listing of presets and their values; a ``default_preset`` other than ``auto``
    is named (and checked) on the line after the header."""
    text = _native.format_presets()
    name = (default_preset or "auto").strip().lower()
    if name != "auto":
        effective, _mode = _native.resolve_backend("vmm" if name in ("vmm_fast", "nvme_baseline") else "linear", name)
        head, _, rest = text.partition("\n")
        text = f"{head}\n  default -> {name} ({effective})\n{rest}"
    return text


def get_available_system_ram_gb() -> float:
    """Available host RAM in GiB (``MemAvailable``, as ddo's admission observes it); 0.0 when it
    cannot be read."""
    observed = json.loads(_native.observe_host_memory())
    available = observed.get("mem_available_bytes")
    return round(float(available) / 2**30, 4) if available else 0.0
