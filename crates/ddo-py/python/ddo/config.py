"""The configuration users set. Its fields are the native configuration's (``ddo._native``):
resolution, presets, precedence and validation happen there; this module only carries values."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from . import _native
from .errors import DynamicOffloadConfigError

__all__ = ["DynamicOffloadConfig", "ComponentPolicy", "PUBLISHED_DEFAULTS"]


def _replace(self, **changes: Any):
    """A copy with ``changes``; an unknown name is a ``TypeError``."""
    unknown = sorted(set(changes) - set(self.field_names()))
    if unknown:
        raise TypeError(f"unknown {type(self).__name__} field(s): {', '.join(unknown)}")
    return dataclasses.replace(self, **changes)


def _field_names(cls) -> tuple:
    """Names of every field."""
    return tuple(f.name for f in dataclasses.fields(cls))


def _policy_as_dict(self) -> dict:
    """The set fields only."""
    return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


if TYPE_CHECKING:

    class ComponentPolicy:
        """What type checkers see of the class generated below from the native schema."""

        def __init__(self, **fields: Any) -> None: ...
        def __getattr__(self, name: str) -> Any: ...
        def as_dict(self) -> dict: ...
        def replace(self, **changes: Any) -> "ComponentPolicy": ...
        @classmethod
        def field_names(cls) -> tuple: ...

else:
    ComponentPolicy = dataclasses.make_dataclass(
        "ComponentPolicy",
        [(name, Optional[Any], dataclasses.field(default=None)) for name in _native.component_policy_fields()],
        namespace={"as_dict": _policy_as_dict, "field_names": classmethod(_field_names), "replace": _replace},
        frozen=True,
    )
    ComponentPolicy.__module__ = __name__
    ComponentPolicy.__doc__ = """How one component (``transformer``, ``vae``, ``text_encoder``) is handled. Unset fields
    are decided by variables, the preset and defaults."""


def _class_name(value: Any) -> Any:
    """A layer class (``torch.nn.Linear``) by name, as the native resolver takes it."""
    return value if isinstance(value, str) else getattr(value, "__name__", value)


def _config_as_dict(self) -> dict:
    """The explicitly set fields only (:meth:`explicit_fields`), as the native resolver takes
    them: a field left at its default is decided by variables, the preset and defaults."""
    out: dict = {}
    explicit = self._explicit_fields or frozenset()
    for f in dataclasses.fields(self):
        if f.name == _EXPLICIT:
            continue
        v = getattr(self, f.name)
        if f.name == "components":
            comps = {name: (p.as_dict() if isinstance(p, ComponentPolicy) else dict(p)) for name, p in (v or {}).items()}
            if comps:
                out["components"] = comps
        elif f.name in explicit and v is not None:
            if f.name == "target_module_classes" and isinstance(v, (list, tuple)):
                v = [_class_name(c) for c in v]
            out[f.name] = list(v) if isinstance(v, (list, tuple)) else v
    return out


def _finite_or_text(value: Any) -> Any:
    """JSON carries no NaN or infinity: such floats travel as text and are validated natively."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite_or_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_text(v) for v in value]
    return value


def _config_to_json(self, origin: str = "config") -> str:
    """The set fields as JSON, validated natively (unknown fields and bad values refused);
    ``origin`` (``config`` or ``argument``) is what errors say the values came from."""
    text = json.dumps(_finite_or_text(self.as_dict()))
    _native.check_config(text, origin)
    return text


# The published library's dataclass defaults (diffusers-dynamic-offloader 0.1.0rc2): what a field
# reads as when it was not set. Fields only ddo has (``preset``, ``backend``, ``route``,
# ``prefetch_depth``, ...) read as ``None``. Either way an unset field is decided at resolution by
# the component's ``DDO_<COMPONENT>_*`` variable, the ``DDO_*`` variable, the preset, then ddo's
# default: only :meth:`explicit_fields` reach the resolver.
PUBLISHED_DEFAULTS: Mapping[str, Any] = {
    "execution_device": "cuda:0",
    "offload_device": "cpu",
    "target_module_classes": (torch.nn.Linear, torch.nn.Embedding),
    "skip_modules_pattern": (),
    "always_resident_modules_pattern": (),
    "small_tensor_threshold_bytes": 16 * 1024,
    "execution_mode": "plan",
    "linear_runtime_strategy": "functional",
    "linear_convolution_offload": False,
    "vmm_resident_weight_budget_gb": 0.0,
    "vmm_staging_buffer_gb": 0.625,
    "vmm_windows_file_read_chunk_mb": 2,
    "vmm_virtual_host_transport": False,
    "vmm_native_transport": False,
    "vmm_source_cache_gb": 0.0,
    "vmm_source_registered_gb": 0.0,
    "vmm_module_pattern": ".*",
    "vmm_component_tensor_ownership": False,
    "vmm_float8_weight_only": False,
    "vmm_execution_auxiliary_ownership": False,
    "vmm_component_buffer_limit_mb": 1,
    "vmm_page_mb": 0,
    "vmm_dxgi_local_headroom_gb": 0.0,
    "vmm_dxgi_shared_headroom_gb": 0.0,
    "vmm_dxgi_system_headroom_gb": 0.0,
    "vmm_host_cache_gb": 0.0,
    "vmm_native_source_cache_slot_mb": 0,
    "vmm_native_source_cache_slots": 0,
    "vmm_pin_source_weights": False,
    "vmm_fault_fallback": False,
    "vmm_execution_backing_reclaim": False,
    "pin_cpu_memory": False,
    "allow_pin_memory_fallback": True,
    "pin_cpu_workers": 1,
    "cache_plan": True,
    "cache_pinned_weights": False,
    "pinned_weight_cache_namespace": "",
    "auto_budget_policy": "off",
    "max_resident_module_budget_gb": 6.0,
    "auto_vram_headroom_gb": 0.0,
    "profile_vram_headroom_gb": 1.0,
    "profile_name": "",
    "build_profile": False,
    "auto_full_pin_min_model_to_vram_ratio": 4.0,
    "profile_resident_module_budget_gb": 0.0,
    "max_pin_weight_budget_gb": 0.0,
    "available_system_ram_gb": 0.0,
    "system_ram_headroom_gb": 6.0,
    "pin_weight_budget_gb": 0.0,
    "pin_weight_budget_ratio": 0.0,
    "pin_weight_selection": "spread",
    "resident_module_budget_gb": 0.0,
    "resident_module_patterns": (),
    "resident_module_selection": "spread",
    "load_safetensors_backend": "",
    "verbose": False,
    "show_profile": True,
}

# The hidden field that records which fields were set explicitly. It is an init field so that
# ``dataclasses.replace`` (which passes every init field) carries it over.
_EXPLICIT = "_explicit_fields"


def _config_field(name: str):
    if name == "components":
        return (name, Mapping[str, Any], dataclasses.field(default_factory=dict))
    return (name, Optional[Any], dataclasses.field(default=PUBLISHED_DEFAULTS.get(name)))


def _is_default(name: str, value: Any) -> bool:
    default = PUBLISHED_DEFAULTS.get(name)
    if value is default:
        return True
    if isinstance(value, bool) != isinstance(default, bool):
        return False
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # noqa: BLE001 - an odd value is not the default
        return False


def _config_explicit_fields(self) -> frozenset:
    """The names of the fields set explicitly (passed to the constructor or to
    :meth:`replace`), whatever their value: only these reach the resolver, so an explicit value
    beats the variables and the preset, and an unset field is decided by them even though it
    reads as the published default. ``components`` counts when it is not empty."""
    explicit = set(self._explicit_fields or ())
    if self.components:
        explicit.add("components")
    return frozenset(explicit)


def _config_replace(self, **changes: Any):
    """A copy with ``changes``, which become explicitly set; an unknown name is a ``TypeError``."""
    unknown = sorted(set(changes) - set(self.field_names()))
    if unknown:
        raise TypeError(f"unknown {type(self).__name__} field(s): {', '.join(unknown)}")
    values = {n: getattr(self, n) for n in self.field_names()}
    values.update(changes)
    explicit = frozenset(self._explicit_fields or ()) | frozenset(changes)
    return type(self)(**values, _explicit_fields=explicit)


def _config_field_names(cls) -> tuple:
    """Names of every field (the hidden record of explicit fields aside)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != _EXPLICIT)


if TYPE_CHECKING:

    class DynamicOffloadConfig:
        """What type checkers see of the class generated below from the native schema."""

        def __init__(self, *args: Any, **fields: Any) -> None: ...
        def __getattr__(self, name: str) -> Any: ...
        def as_dict(self) -> dict: ...
        def to_json(self, origin: str = "config") -> str: ...
        def replace(self, **changes: Any) -> "DynamicOffloadConfig": ...
        def explicit_fields(self) -> frozenset: ...
        @classmethod
        def field_names(cls) -> tuple: ...

else:
    DynamicOffloadConfig = dataclasses.make_dataclass(
        "DynamicOffloadConfig",
        [_config_field(name) for name in _native.config_fields()]
        + [(_EXPLICIT, Optional[frozenset], dataclasses.field(default=None, repr=False))],
        namespace={
            "as_dict": _config_as_dict,
            "to_json": _config_to_json,
            "field_names": classmethod(_config_field_names),
            "replace": _config_replace,
            "explicit_fields": _config_explicit_fields,
        },
        frozen=True,
    )
    DynamicOffloadConfig.__module__ = __name__
    DynamicOffloadConfig.__doc__ = """Every setting ddo has (``ddo._native.config_fields()``). A field reads as the published
    library's default until it is set (``PUBLISHED_DEFAULTS``; fields only ddo has read as ``None``), but
    only the fields set explicitly (:meth:`explicit_fields`) are settings: an unset field comes from
    the component's ``DDO_<COMPONENT>_*`` variable, the ``DDO_*`` variable, the preset, then the
    default, so a preset still fills what the user did not set and an explicit value beats it. Sizes
    ending in ``_gb`` are GiB. ``python -m ddo presets`` lists the presets; the README's
    configuration section says what each setting does."""

_generated_init = DynamicOffloadConfig.__init__
_INIT_ORDER = _config_field_names(DynamicOffloadConfig)


def _config_init(self, *args: Any, _explicit_fields: Optional[frozenset] = None, **kwargs: Any) -> None:
    if len(args) > len(_INIT_ORDER):
        raise TypeError(f"DynamicOffloadConfig takes at most {len(_INIT_ORDER)} positional arguments ({len(args)} given)")
    given = dict(zip(_INIT_ORDER, args))
    twice = sorted(set(given) & set(kwargs))
    if twice:
        raise TypeError(f"DynamicOffloadConfig got multiple values for argument(s) {', '.join(twice)}")
    given.update(kwargs)
    unknown = sorted(set(given) - set(_INIT_ORDER))
    if unknown:
        raise TypeError(f"unknown DynamicOffloadConfig field(s): {', '.join(unknown)}")
    if _explicit_fields is None:
        explicit = frozenset(n for n in given if n != "components")
    else:
        # A copy (``dataclasses.replace`` passes every field): the fields set before stay set,
        # and a field that was not set counts as set when its value is no longer the default.
        explicit = frozenset(_explicit_fields) | frozenset(
            n for n, v in given.items() if n != "components" and not _is_default(n, v)
        )
    _generated_init(self, **given, _explicit_fields=explicit)


_config_init.__qualname__ = "DynamicOffloadConfig.__init__"
_config_init.__doc__ = "Sets the given fields explicitly; the others read as their defaults."
setattr(DynamicOffloadConfig, "__init__", _config_init)
setattr(
    DynamicOffloadConfig,
    "__signature__",
    inspect.Signature(
        [p for name, p in inspect.signature(_generated_init).parameters.items() if name not in ("self", _EXPLICIT)]
    ),
)


def component_policy_dict(values: Mapping[str, Any]) -> dict:
    """Explicit component keyword arguments (``use_stream=...``) as a policy dict."""
    keys = set(ComponentPolicy.field_names())
    return {k: v for k, v in values.items() if k in keys and v is not None}


# Keeps the name importable for hosts that catch it from this module.
__all__ += ["DynamicOffloadConfigError"]
