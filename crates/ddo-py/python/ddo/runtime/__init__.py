"""Glue between a PyTorch module and a component session (``ddo._native.Session``).

The module tree and, on the linear route, its host tensors go to the session as data; the session
decides everything else (units, shared parameters, budget, registration, dtypes, metrics). Here,
parameters become zero-copy DLPack views of arena memory, and hooks acquire each unit before its
block runs and release it after, on PyTorch's current stream.

Modules: :mod:`.session_runtime` (attach, re-plans, unload, reload, detach), :mod:`.hooks`
(passes, hooks, the lease ledger), :mod:`.publishing` (views and placeholders, with their named
records), :mod:`.checks` (parameter change detection), :mod:`.guards` (refusals),
:mod:`.placeholder` (:class:`StreamedWeight`), :mod:`.auto_budget`, :mod:`.module_tree` (the
module as the session takes it), :mod:`.values` (tensors inside a forward's inputs and outputs)
and :mod:`.torch_internals` (every private PyTorch interface used, and why)."""

from __future__ import annotations

from .auto_budget import AutoBudget, device_free_bytes
from .module_tree import describe_module, find_execution_units, layer_paths
from .placeholder import StreamedWeight
from .session_runtime import SessionRuntime, report_drop_failures
from .values import move_inputs

__all__ = [
    "AutoBudget",
    "SessionRuntime",
    "StreamedWeight",
    "describe_module",
    "device_free_bytes",
    "find_execution_units",
    "layer_paths",
    "move_inputs",
    "report_drop_failures",
]
