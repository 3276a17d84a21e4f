"""The module as the session takes it: its tree and parameters as data, the units ddo streams by the
session's unit rule, and (linear route) its host tensors served in place."""

from __future__ import annotations

import json
from typing import Dict, List, Tuple

import torch

from .. import _native
from .torch_internals import CONVOLUTION

__all__ = ["describe_module", "find_execution_units", "host_tensors", "layer_paths", "owner_of"]

# Leaf layers route ``linear_convolution`` streams one by one.
LAYER_CLASSES = (CONVOLUTION, torch.nn.Linear)
# The small-tensor threshold that route brings (KiB: parameters up to it stay resident) and the
# parameter dtypes it streams (plain float weights), as ddo-policy states them.
_LAYER_RESIDENT_KIB, _LAYER_DTYPE_NAMES = _native.layer_route_limits()
LAYER_RESIDENT_KB: int = _LAYER_RESIDENT_KIB
LAYER_DTYPES = tuple(getattr(torch, name) for name in _LAYER_DTYPE_NAMES)


def describe_module(module: torch.nn.Module) -> Tuple[list, list]:
    """The module tree as the session takes it: ``(path, is_list)`` per module and ``(name, key,
    dtype, shape)`` per parameter name (aliases of a shared parameter share the key)."""
    modules = [(name, isinstance(m, torch.nn.ModuleList)) for name, m in module.named_modules()]
    params = [
        (name, id(p), str(p.dtype), list(p.shape)) for name, p in module.named_parameters(remove_duplicate=False)
    ]
    return modules, params


def layer_paths(module: torch.nn.Module) -> List[str]:
    """Paths of the leaf convolution and linear layers (``Conv1d/2d/3d``, their transposed forms
    and subclasses such as Wan's causal convolution, ``Linear``): the units of route
    ``linear_convolution``."""
    return [
        name
        for name, m in module.named_modules()
        if isinstance(m, LAYER_CLASSES) and next(m.children(), None) is None
    ]


def find_execution_units(
    module: torch.nn.Module, *, route: str = "dynamic_offload", small_tensor_threshold_kb: int = LAYER_RESIDENT_KB
) -> List[Tuple[str, torch.nn.Module]]:
    """The units ddo streams, by the session's unit rule, as ``(path, module)``, in module order:
    the children of outermost repeated ``ModuleList`` s, or with ``route="linear_convolution"``
    each convolution and linear layer holding a parameter over ``small_tensor_threshold_kb``
    (that route's own threshold by default)."""
    modules, params = describe_module(module)
    facts = _native.route_facts(route)
    if facts is not None and json.loads(facts)["layer_units"]:
        paths = _native.unit_paths(
            modules, params, layers=layer_paths(module), resident_bytes=small_tensor_threshold_kb * 1024
        )
    else:
        paths = _native.unit_paths(modules, [(name, key) for name, key, _, _ in params])
    return [(p, module.get_submodule(p)) for p in paths]


def host_tensors(module: torch.nn.Module) -> Tuple[list, list]:
    """The module's parameters as host storages ``(address, bytes, owner)`` and tensor rows, one
    per distinct parameter. Tensors stay where they are when they already are contiguous host
    tensors (the session serves them in place)."""
    storages: List[tuple] = []
    index: Dict[int, int] = {}
    rows: List[tuple] = []
    seen = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        t = p.detach()
        if t.is_meta:
            raise _native.DynamicOffloadError(f"parameter {name} has no data (meta); load the module's weights first")
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            raise _native.DynamicOffloadError(
                f"parameter {name} is not contiguous (strides {t.stride()}); ddo streams contiguous tensors and a "
                "copy would change the kernels' results: make it contiguous before offloading"
            )
        storage = t.untyped_storage()
        address = storage.data_ptr()
        if address not in index:
            index[address] = len(storages)
            storages.append((address, storage.nbytes(), t))
        rows.append((name, str(t.dtype), list(t.shape), index[address], t.storage_offset() * t.element_size()))
    return storages, rows


def owner_of(module: torch.nn.Module, dotted: str) -> Tuple[torch.nn.Module, str]:
    parent, _, attr = dotted.rpartition(".")
    return (module.get_submodule(parent) if parent else module), attr
