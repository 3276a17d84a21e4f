"""Metrics snapshots: the only object hosts read to learn what ddo did."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from . import _native

__all__ = ["DynamicOffloadMetrics", "DYNAMIC_OFFLOAD_METRICS_SCHEMA_VERSION"]

DYNAMIC_OFFLOAD_METRICS_SCHEMA_VERSION = _native.metrics_schema_version()


def _present(section: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in section.items() if v is not None}


@dataclass(frozen=True)
class DynamicOffloadMetrics:
    """A versioned snapshot. A counter the route does not have is absent, never zero; the native
    validator refuses a snapshot that reports one."""

    route: Mapping[str, Any]
    configuration: Mapping[str, Any] = field(default_factory=dict)
    setup: Mapping[str, Any] = field(default_factory=dict)
    runtime: Mapping[str, Any] = field(default_factory=dict)
    host_memory: Optional[Mapping[str, Any]] = None

    @property
    def schema_version(self) -> int:
        """The layout version."""
        return DYNAMIC_OFFLOAD_METRICS_SCHEMA_VERSION

    def as_dict(self) -> dict[str, Any]:
        """A deep copy as plain JSON-able data."""
        out: dict[str, Any] = {
            "schema_version": self.schema_version,
            "route": _present(self.route),
            "setup": _present(self.setup),
            "runtime": _present(self.runtime),
        }
        if self.configuration:
            out["configuration"] = dict(self.configuration)
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
