"""The configuration users set. Its fields are the native configuration's (``ddo._native``):
resolution, presets, precedence and validation happen there; this module only carries values."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping, Optional

from . import _native
from .errors import DynamicOffloadConfigError

__all__ = ["DynamicOffloadConfig", "ComponentPolicy"]


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


ComponentPolicy = dataclasses.make_dataclass(
    "ComponentPolicy",
    [(name, Optional[Any], dataclasses.field(default=None)) for name in _native.component_policy_fields()],
    namespace={"as_dict": _policy_as_dict, "field_names": classmethod(_field_names), "replace": _replace},
    frozen=True,
)
ComponentPolicy.__module__ = __name__
ComponentPolicy.__doc__ = """How one component (``transformer``, ``vae``, ``text_encoder``) is handled. Unset fields
are decided by variables, the preset and defaults."""


def _config_as_dict(self) -> dict:
    """The set fields only, as the native resolver takes them."""
    out: dict = {}
    for f in dataclasses.fields(self):
        v = getattr(self, f.name)
        if f.name == "components":
            comps = {name: (p.as_dict() if isinstance(p, ComponentPolicy) else dict(p)) for name, p in (v or {}).items()}
            if comps:
                out["components"] = comps
        elif v is not None:
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


def _config_field(name: str):
    if name == "components":
        return (name, Mapping[str, Any], dataclasses.field(default_factory=dict))
    return (name, Optional[Any], dataclasses.field(default=None))


DynamicOffloadConfig = dataclasses.make_dataclass(
    "DynamicOffloadConfig",
    [_config_field(name) for name in _native.config_fields()],
    namespace={
        "as_dict": _config_as_dict,
        "to_json": _config_to_json,
        "field_names": classmethod(_field_names),
        "replace": _replace,
    },
    frozen=True,
)
DynamicOffloadConfig.__module__ = __name__
DynamicOffloadConfig.__doc__ = """Every setting ddo has (``ddo._native.config_fields()``). All fields are optional: an
unset field comes from the component's ``DDO_<COMPONENT>_*`` variable, the ``DDO_*`` variable, the
preset, then the default. Sizes ending in ``_gb`` are GiB. ``python -m ddo presets`` lists the
presets; the README's configuration section says what each setting does."""


def component_policy_dict(values: Mapping[str, Any]) -> dict:
    """Explicit component keyword arguments (``use_stream=...``) as a policy dict."""
    keys = set(ComponentPolicy.field_names())
    return {k: v for k, v in values.items() if k in keys and v is not None}


# Keeps the name importable for hosts that catch it from this module.
__all__ += ["DynamicOffloadConfigError"]
