"""Values passing through a forward: the tensors inside inputs and outputs, inputs moved to the
execution device."""

from __future__ import annotations

from typing import Any, List

import torch

__all__ = ["any_requires_grad", "move_inputs", "tensors_in"]


def tensors_in(value: Any) -> List[torch.Tensor]:
    """The tensors inside ``value`` (tuples, lists, dicts, Diffusers' output classes)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def move_inputs(value: Any, device: torch.device) -> Any:
    """Tensors inside ``value`` (tuples, lists, dicts) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device or value.is_meta else value.to(device, non_blocking=True)
    if isinstance(value, tuple):
        return tuple(move_inputs(v, device) for v in value)
    if isinstance(value, list):
        return [move_inputs(v, device) for v in value]
    if isinstance(value, dict):
        return {k: move_inputs(v, device) for k, v in value.items()}
    return value


def any_requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(any_requires_grad(v) for v in value)
    if isinstance(value, dict):
        return any(any_requires_grad(v) for v in value.values())
    return False
