"""Layout inspection from metadata only (no CUDA, no weights read): the plan entries of a module and
route ``vmm_capacity_inspection``."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import DynamicOffloadError
from ..metrics import DynamicOffloadMetrics
from ..runtime import find_execution_units

__all__ = ["DynamicOffloadPlanEntry", "inspect_vmm_component", "plan_entries"]


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
    for entry in entries:
        full = f"{entry.module_name}.{entry.tensor_name}" if entry.module_name else entry.tensor_name
        for u in units:
            if full.startswith(u + "."):
                unit_bytes[u] += entry.bytes
                break
    streamed = sum(unit_bytes.values())
    total = sum(entry.bytes for entry in entries)
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
