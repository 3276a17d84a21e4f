"""Execution units found from module structure, never from class names."""

from __future__ import annotations

from typing import List, Tuple

import torch

__all__ = ["find_execution_units"]


def _has_params(m: torch.nn.Module) -> bool:
    return any(True for _ in m.parameters())


def find_execution_units(module: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """The children of every repeated ``ModuleList`` (two or more children with parameters),
    outermost lists only, in module order. Everything else stays resident."""
    units: List[Tuple[str, torch.nn.Module]] = []
    taken: List[str] = []
    for name, m in module.named_modules():
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        if isinstance(m, torch.nn.ModuleList):
            children = [(f"{name}.{i}" if name else str(i), c) for i, c in enumerate(m) if _has_params(c)]
            if len(children) >= 2:
                units.extend(children)
                taken.extend(n for n, _ in children)
    return units
