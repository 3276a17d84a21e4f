"""Metrics snapshots: the only object hosts read to learn what ddo did."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from . import _native

__all__ = ["DynamicOffloadMetrics", "DYNAMIC_OFFLOAD_METRICS_SCHEMA_VERSION"]

DYNAMIC_OFFLOAD_METRICS_SCHEMA_VERSION = _native.metrics_schema_version()



def _published_name(route: str) -> str:
    """The published library's name of a route (``dynamic_offload`` for each of ddo's arena
    routes), as ddo-policy states it; a name that is no route stays as it is."""
    facts = _native.route_facts(route)
    return str(json.loads(facts)["published_name"]) if facts is not None else route


def _present(section: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in section.items() if v is not None}


@dataclass(frozen=True)
class DynamicOffloadMetrics:
    """A versioned snapshot. ``route`` is the published library's route string
    (``dynamic_offload``, ``diffusers_group_offload``, ``none``, or an observation such as
    ``model_load``); ``execution`` is ddo's addition beside it: ddo's own route
    (``linear_runtime``, ``vmm_fast_runtime``), component, backend and presets. A counter the
    route does not have is absent, never zero; the native validator refuses a snapshot that
    reports one."""

    route: str
    configuration: Mapping[str, Any] = field(default_factory=dict)
    setup: Mapping[str, Any] = field(default_factory=dict)
    runtime: Mapping[str, Any] = field(default_factory=dict)
    host_memory: Optional[Mapping[str, Any]] = None
    execution: Optional[Mapping[str, Any]] = None

    def __post_init__(self) -> None:
        if isinstance(self.route, Mapping):
            # Schema version 1 carried ddo's route as a mapping: read it as version 2 does.
            detail = dict(self.route)
            name = str(detail.pop("name", ""))
            published = _published_name(name)
            object.__setattr__(self, "route", published)
            if detail and self.execution is None:
                object.__setattr__(self, "execution", {"route": name, **detail})
        elif not isinstance(self.route, str):
            raise TypeError(f"route is a string such as 'dynamic_offload', not {type(self.route).__name__}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DynamicOffloadMetrics":
        """A snapshot from its ``as_dict()`` form (this schema version or version 1), as stored
        by a host or read back from a journal."""
        fields = dict(data)
        version = fields.pop("schema_version", DYNAMIC_OFFLOAD_METRICS_SCHEMA_VERSION)
        if version not in (1, DYNAMIC_OFFLOAD_METRICS_SCHEMA_VERSION):
            raise ValueError(
                f"metrics schema_version {version!r} is not one ddo reads (1 or {DYNAMIC_OFFLOAD_METRICS_SCHEMA_VERSION})"
            )
        unknown = sorted(set(fields) - {"route", "configuration", "setup", "runtime", "host_memory", "execution"})
        if unknown:
            raise ValueError(f"metrics have no section(s) {', '.join(unknown)}")
        return cls(**fields)

    @property
    def schema_version(self) -> int:
        """The layout version."""
        return DYNAMIC_OFFLOAD_METRICS_SCHEMA_VERSION

    @property
    def runtime_route(self) -> str:
        """ddo's route when known (``linear_runtime``), else the published one."""
        return str((self.execution or {}).get("route") or self.route)

    def as_dict(self) -> dict[str, Any]:
        """A deep copy as plain JSON-able data: the published keys (``schema_version``,
        ``route``, ``configuration``, ``setup``, ``runtime``) and ddo's ``execution`` and
        ``host_memory`` beside them."""
        out: dict[str, Any] = {
            "schema_version": self.schema_version,
            "route": self.route,
            "configuration": dict(self.configuration),
            "setup": _present(self.setup),
            "runtime": _present(self.runtime),
        }
        if self.execution is not None:
            out["execution"] = _present(self.execution)
        if self.host_memory is not None:
            out["host_memory"] = dict(self.host_memory)
        return copy.deepcopy(out)

    def to_json(self) -> str:
        """The snapshot as JSON."""
        return json.dumps(self.as_dict())

    def validate(self) -> None:
        """Raises :class:`DynamicOffloadConfigError` (a ``ValueError``) if a counter is reported
        that the route does not have."""
        _native.validate_metrics(self.to_json())

    def format_profile(self) -> str:
        """The text profile."""
        return _native.format_profile(self.to_json())

    @staticmethod
    def json_schema() -> dict[str, Any]:
        """The JSON Schema every snapshot's ``as_dict()`` follows: ``oneOf`` ddo's layout
        (``schema_version`` 2) and the published library's (version 1, ``route`` a string)."""
        return json.loads(_native.metrics_schema())
