"""The private PyTorch interfaces the runtime relies on, in one place, each with why no public one
serves. A PyTorch upgrade that moves one breaks here first.

Used directly elsewhere, as PyTorch's own modules use them: a module's ``_parameters`` dict (read
and written in place so a swap costs one dict update per owner and bypasses ``__setattr__``'s
checks on the hot path), ``Module._apply`` (overridden per module to refuse moves and casts:
``.to()``, ``.half()`` and the like all end there), ``Module._forward_pre_hooks`` (a hook that
takes itself off), and ``OpOverload._schema`` in a placeholder's dispatch (which arguments an
operator writes, and whether it returns a view)."""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = [
    "CONVOLUTION",
    "DISABLED_TORCH_FUNCTION",
    "StorageWeakRef",
    "TENSOR_IDENTITY",
    "VERSION",
    "has_storage",
    "make_wrapper_subclass",
    "plain_tensor_methods",
    "raw_stream_reader",
    "register_load_state_dict_pre_hook",
    "register_state_dict_hook",
    "storage_use_count",
    "tree_leaves",
    "tree_map",
]

# The base of Conv1d/2d/3d and their transposed forms (and of subclasses such as Wan's causal
# convolution): no public class covers all of them.
CONVOLUTION = torch.nn.modules.conv._ConvNd

# A tensor's in-place write counter: the only record of a write through a reference ddo does not
# see (``p.add_(1)``, an optimizer step, ``copy_`` from a state dict value).
VERSION = operator.attrgetter("_version")

# The C++ tensor a Python tensor wraps: two placeholders exchanged with
# ``torch.utils.swap_tensors`` keep their Python objects, addresses and versions, and differ here
# only.
TENSOR_IDENTITY = operator.attrgetter("_cdata")

# Plain tensor methods for a subclass (a placeholder): its ``__torch_function__`` is skipped, only
# its ``__torch_dispatch__`` runs.
DISABLED_TORCH_FUNCTION = torch._C._disabled_torch_function_impl

# Per-forward checks run in plain tensor methods: Diffusers' ``GGUFParameter`` wraps every call in
# its ``__torch_function__``, which would cost more than the check itself.
plain_tensor_methods = torch._C.DisableTorchFunctionSubclass

# Flattening of nested arguments in a placeholder's dispatch, as PyTorch's own subclasses do it.
tree_leaves = pytree.tree_leaves
tree_map = pytree.tree_map


def make_wrapper_subclass(cls: type, like: torch.Tensor, device: torch.device) -> Any:
    """A tensor of ``cls`` with ``like``'s shape, strides and dtype on ``device`` and no storage:
    the one way to build a tensor subclass that is not backed by memory."""
    return torch.Tensor._make_wrapper_subclass(
        cls, like.shape, strides=like.stride(), dtype=like.dtype, device=device, requires_grad=False
    )


def storage_use_count(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage: a view kept by the host after a block ran holds
    its slot's memory, and no public call counts them."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def has_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` has a storage (a placeholder has none; ``data_ptr()`` of it raises)."""
    return bool(torch._C._has_storage(t))


def raw_stream_reader(index: int) -> Optional[Callable[[], int]]:
    """A function giving PyTorch's current stream on CUDA device ``index`` as a raw handle, or
    ``None`` where PyTorch has none: the hooks read it twice per block, and
    ``torch.cuda.current_stream()`` builds a Python stream object each time."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return None if raw is None else functools.partial(raw, index)


def register_state_dict_hook(module: torch.nn.Module, hook: Callable[..., Any]) -> Any:
    """Adds ``hook(module, state, prefix, local_metadata)`` after ``module.state_dict()`` builds
    its entries: the public ``register_state_dict_post_hook`` of older PyTorch releases does not
    let the hook replace values."""
    return module._register_state_dict_hook(hook)


def register_load_state_dict_pre_hook(module: torch.nn.Module, hook: Callable[..., Any]) -> Any:
    """Adds ``hook(module, state_dict, prefix, ...)`` before ``load_state_dict`` writes anything,
    with the module passed (the public form exists only in recent PyTorch releases)."""
    return module._register_load_state_dict_pre_hook(hook, with_module=True)
