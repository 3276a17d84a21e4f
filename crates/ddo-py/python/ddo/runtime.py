"""Glue between a PyTorch module and a component session (``ddo._native.Session``).

The module tree and, on the linear route, its host tensors go to the session as data; the session
decides everything else (units, shared parameters, budget, registration, dtypes, metrics). Here,
parameters become zero-copy DLPack views of arena memory, and hooks acquire each unit before its
block runs and release it after, on PyTorch's current stream."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import json
import operator
import os
import threading
import warnings
import weakref
import gc
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.utils.dlpack

from . import _native

__all__ = ["SessionRuntime", "describe_module", "find_execution_units", "layer_paths", "move_inputs"]

# Leaf layers route ``linear_convolution`` streams one by one.
_LAYER_CLASSES = (torch.nn.modules.conv._ConvNd, torch.nn.Linear)
# Parameter dtypes that route streams (the published route's plain float weights).
_LAYER_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The small-tensor threshold that route brings (KiB): parameters up to it stay resident.
_LAYER_RESIDENT_KB = 16
# Methods of a module that run a pass of their own on every arena route (a VAE's entry points).
_VAE_ENTRIES = ("encode", "decode")


def report_drop_failures() -> None:
    """Warns about releases that failed when ddo's memory was dropped (a component collected, or
    the last tensor viewing an unloaded arena): what could not be released is kept, never freed
    by force, and each warning says how much."""
    failures, more = _native.take_drop_failures()
    if more:
        failures.append(f"{more} more releases failed when dropped")
    if failures:
        # One warning for all of them: under warnings-as-errors the exception carries every note.
        warnings.warn("ddo: " + "; ".join(failures), RuntimeWarning, stacklevel=3)


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
        if isinstance(m, _LAYER_CLASSES) and next(m.children(), None) is None
    ]


def find_execution_units(
    module: torch.nn.Module, *, route: str = "dynamic_offload", small_tensor_threshold_kb: int = _LAYER_RESIDENT_KB
) -> List[Tuple[str, torch.nn.Module]]:
    """The units ddo streams, by the session's unit rule, as ``(path, module)``, in module order:
    the children of outermost repeated ``ModuleList`` s, or with ``route="linear_convolution"``
    each convolution and linear layer holding a parameter over ``small_tensor_threshold_kb``
    (that route's own threshold by default)."""
    modules, params = describe_module(module)
    if route == "linear_convolution":
        paths = _native.unit_paths(
            modules, params, layers=layer_paths(module), resident_bytes=small_tensor_threshold_kb * 1024
        )
    else:
        paths = _native.unit_paths(modules, [(name, key) for name, key, _, _ in params])
    return [(p, module.get_submodule(p)) for p in paths]


def _check_layer_route(module: torch.nn.Module, layers: List[str]) -> None:
    """What route ``linear_convolution`` refuses before anything changes: quantized modules
    (its layers run their own forward on plain float weights), modules in training mode, and
    layers another placement library already hooks."""
    name = type(module).__name__
    if getattr(module, "hf_quantizer", None) is not None:
        raise _native.DynamicOffloadError(
            f"{name} is quantized ({type(module.hf_quantizer).__name__}); route linear_convolution streams plain "
            "float16/bfloat16/float32/float64 weights: load it unquantized, or use route diffusers_group_offload"
        )
    for pname, p in module.named_parameters():
        plain = type(p) in (torch.nn.Parameter, torch.Tensor) and type(p.data) is torch.Tensor
        if not plain or p.dtype not in _LAYER_DTYPES:
            raise _native.DynamicOffloadError(
                f"parameter {pname} of {name} is {type(p).__name__} of {p.dtype} (quantized or not a float); route "
                "linear_convolution streams plain float16/bfloat16/float32/float64 weights: load the module "
                "unquantized, or use route diffusers_group_offload"
            )
    for path, m in module.named_modules():
        if m.training:
            raise _native.DynamicOffloadError(
                f"{path or name} is in training mode; ddo offloads inference only: call {name}.eval() first"
            )
    for path in layers:
        m = module.get_submodule(path)
        hooks = getattr(m, "_diffusers_hook", None)
        if getattr(m, "_hf_hook", None) is not None or (hooks is not None and getattr(hooks, "hooks", None)):
            raise _native.DynamicOffloadError(
                f"layer {path} of {name} carries another library's offload hooks (accelerate or Diffusers): remove "
                "them (remove_all_hooks, or a fresh module) before route linear_convolution"
            )


_NO_SWAPS: Tuple[list, list] = ([], [])
_VERSION = operator.attrgetter("_version")
_TENSOR = operator.attrgetter("_cdata")
_DATA_PTR = torch.Tensor.data_ptr
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_NO_PLACES: Tuple[list, ...] = ([], [], [], [], [], [], [], [])
# Diffusers model methods that hook weight placement or casting, refused while ddo offloads.
_PLACEMENT_METHODS = ("enable_group_offload", "enable_layerwise_casting")


def _held_beyond(now: Tuple[int, int], published: Optional[Tuple[int, int]]) -> bool:
    """Whether either count exceeds what ddo itself held at publish (unknown: assume so)."""
    return published is None or now[0] > published[0] or now[1] > published[1]


def _holds(view: torch.Tensor) -> Tuple[int, int]:
    """References to a view and tensors sharing its memory, as counted the same way each time:
    the object's reference count and its storage's use count."""
    return sys.getrefcount(view), torch._C._storage_Use_Count(view.untyped_storage()._cdata)


def _places_unchanged(group: Tuple[list, ...], grad: bool) -> bool:
    """Whether a group of places (see ``SessionRuntime.checked``) holds its parameters as
    published: column by column, in C-level loops (about a tenth of a microsecond per
    parameter). A parameter requiring grad matters only where autograd records."""
    dicts, attrs, params, addressed, versions, addresses, unaddressed, tensors = group
    try:
        return (
            all(map(operator.is_, map(dict.get, dicts, attrs), params))
            and list(map(_VERSION, addressed)) == versions
            and list(map(_DATA_PTR, addressed)) == addresses
            and list(map(_TENSOR, unaddressed)) == tensors
            and not (grad and any(map(_REQUIRES_GRAD, params)))
        )
    except RuntimeError:  # data_ptr() of data given no storage
        return False


def _refuse_traced(what: Any, capture: bool = True) -> None:
    """Refuses ``what`` (a name, or a function giving it: built only for the error) while a
    tracer records a graph to replay (``torch.export``, a full-graph compile,
    ``torch.jit.trace``) or, with ``capture``, a CUDA graph captures: hooks swap each unit's
    weights in and out around its forward and upload them on demand, which a recorded graph would
    freeze and a captured one would replay against other weights. (``torch.compile`` by default
    runs these hooks eagerly between its compiled regions, where this check passes.)"""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        raise _native.DynamicOffloadLifecycleError(
            f"{what() if callable(what) else what} runs while a tracer records it (torch.export, "
            "torch.compile(fullgraph=True) or torch.jit.trace); ddo swaps each unit's weights in and out around its "
            "forward, which a recorded graph would freeze: trace the module resident, use torch.compile without "
            "fullgraph, or call remove_dynamic_offload(module) first"
        )
    if capture and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        raise _native.DynamicOffloadLifecycleError(
            f"{what() if callable(what) else what} runs during CUDA graph capture; ddo uploads weights and waits on "
            "fences between units, which a captured graph would replay against other weights: run it outside "
            "torch.cuda.graph, or call remove_dynamic_offload(module) first"
        )


def _tensors(value: Any) -> List[torch.Tensor]:
    """The tensors inside ``value`` (tuples, lists, dicts, Diffusers' output classes)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
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


def _host_tensors(module: torch.nn.Module) -> Tuple[list, list]:
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


def _any_requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(_any_requires_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_any_requires_grad(v) for v in value.values())
    return False


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _stream_reader(device: torch.device) -> Any:
    """A function giving PyTorch's current stream on ``device`` as a handle: the hooks ask for it
    twice per block, so it skips building a ``torch.cuda.Stream`` where PyTorch offers the raw
    handle."""
    if device.type != "cuda":
        return lambda: 0
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return lambda: _stream(device)
    return functools.partial(raw, device.index if device.index is not None else torch.cuda.current_device())


def _refusing_true(method: Any, message: str) -> Any:
    """``method(flag=True)`` refused with ``message`` when ``flag`` is true (``train``,
    ``requires_grad_``); ``method(False)`` goes on."""

    @functools.wraps(method)
    def guarded(flag: bool = True) -> Any:
        if flag:
            raise _native.DynamicOffloadLifecycleError(message)
        return method(flag)

    return guarded


def _address(p: torch.Tensor) -> Optional[int]:
    """The address a parameter views, or ``None`` for a placeholder (no storage; one given data
    by ``.data =`` has an address, so the change is seen)."""
    return p.data_ptr() if torch._C._has_storage(p) else None


def _owner(module: torch.nn.Module, dotted: str) -> Tuple[torch.nn.Module, str]:
    parent, _, attr = dotted.rpartition(".")
    return (module.get_submodule(parent) if parent else module), attr


def _parameter_like(old: torch.nn.Parameter, data: torch.Tensor, grad: bool = False) -> torch.nn.Parameter:
    """A parameter over ``data`` in ``old``'s place: ``data`` viewed as ``old``'s dtype and shape
    when the session serves its bytes (fp8, or a quantized framework parameter over a tensor its
    file types otherwise), and of ``old``'s class when that class carries a quantization type
    (Diffusers' ``GGUFParameter``); requiring grad with ``grad``."""
    if data.dtype != old.dtype:
        data = data.view(torch.uint8).view(old.dtype)
    if data.shape != old.shape:
        data = data.reshape(old.shape)
    quant_type = getattr(old, "quant_type", None)
    if quant_type is not None and type(old) is not torch.nn.Parameter:
        return type(old)(data, requires_grad=grad, quant_type=quant_type)
    return torch.nn.Parameter(data, requires_grad=grad)


# Bumped whenever any module registers a parameter or a submodule (an adapter being added), so
# a forward walks its module tree only when the tree may have changed.
_STRUCTURE = [0]
_WATCHING: List[Any] = []


def _structure_changed(*_args: Any) -> None:
    _STRUCTURE[0] += 1


def _watch_structure() -> None:
    if not _WATCHING:
        from torch.nn.modules import module as nn_module

        _WATCHING.append(nn_module.register_module_parameter_registration_hook(_structure_changed))
        _WATCHING.append(nn_module.register_module_module_registration_hook(_structure_changed))


# Attached runtimes, for the adapter-merge guard.
_RUNTIMES: "weakref.WeakSet[SessionRuntime]" = weakref.WeakSet()


def _refuse_merge_into_streamed(layer: Any) -> None:
    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
    own = [id(p) for p in base.parameters(recurse=False)]
    for runtime in list(_RUNTIMES):
        if any(i in runtime.published for i in own):
            raise _native.DynamicOffloadLifecycleError(
                f"merging adapters into a {type(base).__name__} of {type(runtime.module).__name__} would write into "
                "weights ddo streams from their source (the merged values would be lost at the next upload): use the "
                "adapters unmerged, or call remove_dynamic_offload(module) first"
            )


def _guarded(merge: Any) -> Any:
    @functools.wraps(merge)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        _refuse_merge_into_streamed(self)
        return merge(self, *args, **kwargs)

    guarded._ddo_guard = True  # type: ignore[attr-defined]
    return guarded


# How many modules were imported when adapter merges were last guarded.
_GUARDED_AT = [0]


def _guard_adapter_merges() -> None:
    """Wraps the ``merge`` of peft's adapter layers (what ``fuse_lora`` and ``merge_and_unload``
    call) so that merging into a weight ddo streams is refused before anything is written."""
    if "peft" not in sys.modules and importlib.util.find_spec("peft") is None:
        return
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return
    stack = [BaseTunerLayer]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        merge = cls.__dict__.get("merge")
        if merge is not None and not getattr(merge, "_ddo_guard", False):
            setattr(cls, "merge", _guarded(merge))


def _refuse_write(name: str) -> Exception:
    return _native.DynamicOffloadLifecycleError(
        f"writing into {name}: ddo streams its values from the checkpoint (or the module's host tensors) at "
        "every pass, so a write would be lost or mixed with them. Call remove_dynamic_offload(module) first, "
        "change the weights, then offload the module again"
    )


class StreamedWeight(torch.Tensor):
    """A streamed parameter between passes. Its block's device memory holds other blocks' weights
    then, so instead of a view of it the parameter is this placeholder: same shape, dtype and
    device, no storage of its own. Reading it (norms, copies, ``print``, ``numpy()``, pickling)
    gives the source's values, read again on every use; a view of it (an index, ``view``,
    ``.data``) is a placeholder too, and writing into any of them is refused. A forward swaps the
    parameter's view of arena memory in while its block runs."""

    @staticmethod
    def __new__(
        cls,
        runtime: Any,
        name: Optional[str] = None,
        like: Optional[torch.Tensor] = None,
        device: Optional[torch.device] = None,
        chain: tuple = (),
        **_kwargs: Any,
    ) -> "StreamedWeight":
        if name is None or like is None or device is None:
            # A library rebuilding a parameter as ``type(param)(data, ...)`` (accelerate).
            raise _native.DynamicOffloadLifecycleError(
                "a ddo placeholder cannot be rebuilt from data: the module's streamed weights belong to its offload; "
                "call remove_dynamic_offload(module) before handing the module to another placement library"
            )
        t = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=device, requires_grad=False
        )
        t._ddo_runtime = runtime if isinstance(runtime, weakref.ref) else weakref.ref(runtime)
        t._ddo_name = name
        # View operations applied to the parameter's values, in order: (op, args, kwargs, index).
        t._ddo_chain = chain
        quant_type = getattr(like, "quant_type", None)
        if quant_type is not None:
            t.quant_type = quant_type
            kind = getattr(like, "_ddo_class", type(like))
            t._ddo_class = kind if kind not in (torch.Tensor, torch.nn.Parameter, StreamedWeight) else None
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002 - torch's signature
        view = " (a view)" if self._ddo_chain else ""
        return f"StreamedWeight({self._ddo_name}{view}, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, _value: torch.Tensor) -> None:
        raise _refuse_write(self._ddo_name)

    def _values(self) -> torch.Tensor:
        """The values now: the source's bytes, on the device, never an alias of what ddo streams
        from."""
        runtime = self._ddo_runtime()
        if runtime is None or runtime.session is None or runtime.detached:
            raise _native.DynamicOffloadLifecycleError(
                f"{self._ddo_name} was kept from a module whose offload was removed: it has no values; read the "
                "module's parameters again (after offloading it again, or loading it)"
            )
        if runtime.session.is_unloaded():
            raise _native.DynamicOffloadLifecycleError(
                f"{self._ddo_name} belongs to a module that is unloaded: call reload() on its offload result first"
            )
        like = runtime.shapes[self._ddo_name]
        values = runtime._source_value(self._ddo_name, like).to(self.device)
        for op, args, kwargs, index in self._ddo_chain:
            values = op(values, *args, **kwargs)
            if index is not None:
                values = values[index]
        return values

    def _own_values(self) -> torch.Tensor:
        """The values in memory of their own (they leave ddo: never an alias of what it streams
        from), as a quantized parameter of the framework's class when the weight is one."""
        values = self._values().clone()
        kind = getattr(self, "_ddo_class", None)
        if kind is not None and hasattr(self, "quant_type"):
            return kind(values, requires_grad=False, quant_type=self.quant_type)
        return values

    def as_tensor(self) -> torch.Tensor:
        """The values as a plain tensor (what Diffusers' GGUF layers ask a quantized weight for)."""
        return self._values()

    def numpy(self, *, force: bool = False) -> Any:  # noqa: ARG002 - torch's signature
        return self._values().cpu().clone().numpy()

    def tolist(self) -> Any:
        return self._values().tolist()

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._own_values().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return self._own_values()

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for i, a in enumerate(schema.arguments):
                if a.alias_info is None or not a.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
                for target in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(target, StreamedWeight):
                        raise _refuse_write(target._ddo_name)
        leaves = torch.utils._pytree.tree_leaves((args[1:], kwargs))
        if (
            not schema.is_mutable
            and args
            and isinstance(args[0], StreamedWeight)
            and schema.returns
            and schema.returns[0].alias_info is not None
            and not any(isinstance(v, StreamedWeight) for v in leaves)
        ):
            return args[0]._view(func, args[1:], kwargs)

        def real(v: Any) -> Any:
            return v._values() if isinstance(v, StreamedWeight) else v

        args = torch.utils._pytree.tree_map(real, args)
        kwargs = torch.utils._pytree.tree_map(real, kwargs)
        return func(*args, **kwargs)

    def _view(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A view of the placeholder (``detach``, an index, ``view``, ``t``, ``split``...):
        placeholders of the view's shape whose values apply it to the parameter's."""
        runtime = self._ddo_runtime
        meta = torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device="meta")
        result = func(meta, *args, **kwargs)

        def wrap(m: torch.Tensor, index: Any) -> "StreamedWeight":
            step = (func, args, kwargs, index)
            view = StreamedWeight(runtime, self._ddo_name, m, self.device, self._ddo_chain + (step,))
            if hasattr(self, "quant_type"):
                view.quant_type = self.quant_type
                view._ddo_class = getattr(self, "_ddo_class", None)
            return view

        if isinstance(result, torch.Tensor):
            return wrap(result, None)
        return type(result)(wrap(m, i) for i, m in enumerate(result))


_AUTO_HEADROOM_BYTES = 1 << 30
# A larger budget is planned only when it exceeds the current one by more than this share (or
# 256 MiB): rebuilding the arena re-uploads its resident units.
_AUTO_REPLAN_SHARE = 0.05
_AUTO_REPLAN_BYTES = 256 << 20


def device_free_bytes(device: torch.device) -> int:
    """Free memory of ``device``: the GPU's (the driver's count), or the host's available memory
    for the host backend."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_AVPHYS_PAGES"))


class AutoBudget:
    """``auto_budget_policy = balanced``: the arena's budget is the device's free memory plus
    the arena's own, less the headroom, measured after a pass, so the working set PyTorch keeps
    (activations, its cache) is never counted as free. Planned again after the first pass, and
    after any pass that leaves less than half the headroom free (the working set grew)."""

    def __init__(self, runtime: "SessionRuntime", headroom: int, free: Callable[[torch.device], int]) -> None:
        self.runtime = runtime
        self.headroom = headroom
        self.free = free
        self.passes = 0
        self.replans = 0
        self.free_bytes: Optional[int] = None
        self.budget_bytes: Optional[int] = None
        self.decision: Optional[str] = None
        # The largest budget refused as too small.
        self.refused: Optional[int] = None

    def _arena(self) -> Tuple[int, int]:
        """(budget, device bytes the arena holds now)."""
        data = self.runtime.metrics()
        setup, runtime = data.get("setup", {}), data.get("runtime", {})
        held = int(runtime.get("resident_bytes") or 0) + int(runtime.get("slot_bytes") or 0)
        return int(setup.get("gpu_budget_bytes") or 0), held

    def after_pass(self) -> None:
        self.passes += 1
        free = self.free(self.runtime.device)
        self.free_bytes = free
        if self.passes > 1 and free >= self.headroom // 2:
            return
        budget, held = self._arena()
        target = max(0, free + held - self.headroom)
        self.budget_bytes = budget
        # Shrinking is never skipped (the device is short); growing only pays past a margin.
        if target == budget or 0 < target - budget <= max(_AUTO_REPLAN_BYTES, int(budget * _AUTO_REPLAN_SHARE)):
            self.decision = "kept_close_enough"
            return
        if self.refused is not None and target <= self.refused:
            self.decision = "kept_too_small"
            return
        if self.runtime.leases:
            # A block runs in another thread: planned again after a later pass.
            self.passes -= 1
            self.decision = "kept_blocks_running"
            return
        try:
            changed = self.runtime.set_budget(target)
        except BaseException as e:
            if not isinstance(e, _native.DynamicOffloadError):
                # Interrupted (Ctrl-C): the next pass plans again as this one would have.
                self.passes -= 1
                raise
            # Said once: a later pass tries again only when more memory is free.
            self.refused = target
            self.decision = "kept_too_small"
            if self.runtime.session.is_unloaded():
                self.decision = "unloaded"
                warnings.warn(
                    f"ddo: the automatic GPU budget could plan the arena under neither {target} bytes nor its last "
                    f"budget {budget} ({e}); the component is unloaded: free GPU memory and call reload()",
                    stacklevel=4,
                )
                return
            warnings.warn(
                f"ddo: the automatic GPU budget would be {target / (1 << 30):.2f} GiB ({free / (1 << 30):.2f} GiB free, "
                f"{self.headroom / (1 << 30):.2f} GiB headroom), which the component cannot run in ({e}); it keeps "
                f"{budget / (1 << 30):.2f} GiB. Free GPU memory or lower auto_vram_headroom_gb",
                stacklevel=4,
            )
            return
        if not changed:
            self.decision = "kept_views_held"
            return
        self.replans += 1
        self.refused = None
        self.budget_bytes = self._arena()[0]
        self.decision = "first_pass" if self.passes == 1 else "working_set_grew"

    def setup(self) -> Dict[str, Any]:
        """The metrics' ``setup.auto_budget``."""
        out: Dict[str, Any] = {"policy": "balanced", "headroom_bytes": self.headroom, "replans": self.replans}
        for key in ("budget_bytes", "free_bytes", "decision"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


class SessionRuntime:
    """One module attached to a session (routes ``linear_runtime``, ``vmm_fast_runtime`` and
    ``vmm_runtime``; the last two read the checkpoint the module was loaded from)."""

    def __init__(self, module: torch.nn.Module, plan: Any, *, checkpoint: Optional[str] = None) -> None:
        self.module = module
        self.plan = plan
        self.checkpoint = checkpoint
        self.session: Any = None
        self.device = torch.device("cpu")
        self.stream = _stream_reader(self.device)
        self.handles: List[Any] = []
        # Leases the hooks took, by (thread, unit), each with the stream it was taken on: a
        # block's post-hook gives back its own thread's; a pass ends only its own thread's.
        self.leases: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}
        self.originals: Dict[str, Any] = {}
        self.original_buffers: Dict[str, torch.Tensor] = {}
        # Where each managed parameter lives: (owning module, attribute, name at attach). Held by
        # module object, not by path, so wrappers that move a layer (adapters) keep it found.
        self.places: List[Tuple[torch.nn.Module, str, str]] = []
        self.buffer_places: List[Tuple[torch.nn.Module, str, str]] = []
        # Every parameter as published (by identity), with the address it views.
        self.published: Dict[int, Tuple[torch.nn.Parameter, int]] = {}
        self.swap_views: Dict[int, torch.Tensor] = {}
        self.watched: List[Tuple[torch.nn.Module, str, torch.nn.Parameter, Optional[int], int]] = []
        # The same as columns, as each forward compares them, grouped by the hooked unit the
        # place belongs to (``None``: outside every hooked unit): owners' parameter dicts,
        # attributes and parameters; the parameters with an address, their versions and
        # addresses; those without one (placeholders) and their tensors.
        self.checked: Dict[Optional[int], Tuple[list, ...]] = {}
        self.placeholder_tensors: List[int] = []
        # Hooked units whose places the running pass has not compared yet: each is compared in
        # its block's pre-hook (while the GPU runs the blocks before it), the rest at the pass's
        # end, before its output is returned.
        self.pass_unchecked: set = set()
        # The module path of every hooked (not pinned) unit.
        self.unit_paths: Dict[str, int] = {}
        self.watched_names: List[str] = []
        # The record above matches the last complete publish (views or placeholders).
        self.watched_whole = False
        self.owners: List[Tuple[torch.nn.Module, Dict[str, Any]]] = []
        # Streamed units' places: (owner, attribute, view, placeholder) per unit; the view is in
        # place only while the unit's forward runs.
        self.swaps: Dict[int, List[Tuple[torch.nn.Module, str, torch.nn.Parameter, torch.nn.Parameter]]] = {}
        # Per streamed view (by identity), the references ddo itself holds (see ``_holds``).
        self.view_holds: Dict[int, Tuple[int, int]] = {}
        # The memory of streamed views ddo let go of while the arena stayed (a re-plan refused
        # because the host held views), weakly: what the host kept of them keeps it alive.
        self.retired_views: List[Any] = []
        self.streamed: Dict[int, List[str]] = {}
        self.detached = False
        # Each streamed parameter's shape and dtype as published (what its placeholder reads).
        self.shapes: Dict[str, torch.Tensor] = {}
        self.sources: List[Tuple[str, torch.Tensor, int]] = []
        # The structure count at the last full walk of the module tree (-1: none yet), and the
        # adapter layers it found.
        self.walked = -1
        self.adapter_layers: List[Tuple[str, torch.nn.Module]] = []
        self.added: List[Tuple[torch.nn.Module, str, torch.nn.Parameter, int]] = []
        # Forwards of one module run one at a time: a pass owns the module's leases.
        self.forward_lock = threading.Lock()
        self.in_forward: Dict[int, bool] = {}
        # The plan's resident units leased for the running pass, its stream and thread: their
        # blocks on that stream in that thread take no lease of their own.
        self.pass_units: frozenset = frozenset()
        self.pass_stream: Optional[int] = None
        self.pass_thread: Optional[int] = None
        self.route = str(json.loads(plan.json())["route"]["name"]) if plan is not None else ""
        # The automatic GPU budget (auto_budget_policy = balanced), set at attach.
        self.auto_budget: Optional[AutoBudget] = None
        # Methods wrapped in a pass (``forward``; a VAE's ``encode``/``decode`` on the layer route).
        self.entries: List[str] = []
        # Per streamed unit: the address ranges its views cover, ``(start, end, name)``.
        self.ranges: Dict[int, List[Tuple[int, int, str]]] = {}
        # The same grouped for the hooks: per unit, owners' parameter dicts with their views
        # and with their placeholders, and the span of the unit's views.
        self.swap_in: Dict[int, Tuple[list, list]] = {}
        self.swap_out: Dict[int, Tuple[list, list]] = {}
        self.bounds: Dict[int, Tuple[int, int]] = {}
        # Whether every parameter views the session's arena (a publish ran to its end); a pass
        # publishes again first when an interrupt left it half done.
        self.views_whole = False

    def attach(self) -> None:
        """Opens the session and publishes the views. On any error the module is left as it was."""
        settings = json.loads(self.plan.json())["settings"]
        if settings.get("auto_budget_policy") == "balanced" and self.route != "vmm_fast_runtime":
            raise _native.DynamicOffloadConfigError(
                f"auto_budget_policy = balanced sizes the native arena's GPU budget from the card, and this component "
                f"takes route {self.route}: use backend vmm (the native route), or leave auto_budget_policy off"
            )
        report_drop_failures()
        modules, params = describe_module(self.module)
        layers = layer_paths(self.module)
        if self.route == "linear_convolution":
            _check_layer_route(self.module, layers)
        if self.checkpoint is not None:
            self.session = _native.Session(self.plan, modules, params, path=self.checkpoint, layers=layers)
        else:
            storages, rows = _host_tensors(self.module)
            self.session = _native.Session(
                self.plan, modules, params, storages=storages, tensors=rows, layers=layers
            )
        if settings.get("auto_budget_policy") == "balanced":
            headroom = int(float(settings.get("auto_vram_headroom_gb") or 0) * (1 << 30)) or _AUTO_HEADROOM_BYTES
            self.auto_budget = AutoBudget(self, headroom, device_free_bytes)
        try:
            self._attach_module()
        except BaseException:
            # An error or an interrupt half way: hooks, guards and parameters go back as they were.
            with contextlib.suppress(BaseException):
                self._detach(restore=True)
            raise

    def _attach_module(self) -> None:
        kind, index = self.session.device()
        self.device = torch.device(kind, index) if kind == "cuda" else torch.device("cpu")
        self.stream = _stream_reader(self.device)
        self.originals = dict(self.module.named_parameters(remove_duplicate=False))
        # The module's own host tensors the linear route streams from: an in-place write into
        # one (a reference kept from before attach) bumps its version.
        self.sources = [] if self.checkpoint is not None else [(n, p, p._version) for n, p in self.originals.items()]
        self.places = [(*_owner(self.module, name), name) for name in self.originals]
        self.streamed = dict(self.session.streamed_units())
        self.unit_paths = {name: unit for unit, name, pinned in self.session.units() if not pinned}
        self._publish_views()
        for name, b in list(self.module.named_buffers()):
            self.original_buffers[name] = b
            owner, attr = _owner(self.module, name)
            self.buffer_places.append((owner, attr, name))
            setattr(owner, attr, b.to(self.device))
        if "fuse_lora" not in self.module.__dict__ and hasattr(self.module, "fuse_lora"):
            self.module.fuse_lora = self._refuse_fuse
        _guard_adapter_merges()
        _watch_structure()
        _RUNTIMES.add(self)
        for unit, name, pinned in self.session.units():
            if not pinned:
                m = self.module.get_submodule(name)
                self.handles.append(m.register_forward_pre_hook(self._pre(unit)))
                self.handles.append(m.register_forward_hook(self._post(unit), always_call=True))
        self._wrap_forward()
        self._guard_moves()
        for path, m in self.module.named_modules(remove_duplicate=False):
            owned = {attr: f"{path}.{attr}" if path else attr for attr, p in m._parameters.items() if p is not None}
            if owned:
                self.handles.append(m._register_state_dict_hook(self._state_dict_hook(owned)))
        self.handles.append(self.module._register_load_state_dict_pre_hook(self._refuse_load, with_module=True))
        if self.checkpoint is not None:
            # The native route never reads the tensors the module held before attach (a loader's
            # private mapping of the checkpoint among them): keep none alive.
            self.originals = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in self.originals.items()}
            self.original_buffers = {}

    def _publish(self, make, failed: Optional[List[str]] = None) -> None:
        """Sets every managed parameter (aliases too) to ``make(name, old)``, one object per key.
        With ``failed``, a place the module no longer has as a parameter (deleted, or re-registered
        by parametrize) is skipped and named there instead of raising."""
        new: Dict[int, torch.nn.Parameter] = {}
        for owner, attr, name in self.places:
            try:
                p = owner._parameters[attr]
                if id(p) not in new:
                    new[id(p)] = make(name, p)
                setattr(owner, attr, new[id(p)])
            except (KeyError, AttributeError, TypeError, RuntimeError):
                if failed is None:
                    raise
                failed.append(name)

    def _kept_grad(self, p: torch.nn.Parameter) -> bool:
        """Whether a publish keeps ``p`` requiring grad: a flag set on a parameter ddo published
        stays (it matters only where autograd records); at attach, parameters start without."""
        if not p.requires_grad:
            return False
        seen = self.published.get(id(p))
        return (seen is not None and seen[0] is p) or self.swap_views.get(id(p)) is p

    def _record_published(self) -> None:
        """What the next check compares with: every place's parameter as published now."""
        current = [(owner, attr, owner._parameters.get(attr), name) for owner, attr, name in self.places]
        current = [c for c in current if c[2] is not None]
        self.published = {id(p): (p, _address(p)) for _, _, p, _ in current}
        # Streamed units' views, in place only inside their forwards (a publish puts them back).
        self.swap_views = {id(view): view for places in self.swaps.values() for _, _, view, _ in places}
        self.watched = [(owner, attr, p, _address(p), p._version) for owner, attr, p, _ in current]
        self.watched_names = [name for *_, name in current]
        # The same, as each forward compares it: the owner's parameter dict (each owner's dict is
        # checked to be still its own).
        w = self.watched
        # A streamed unit's placeholder refuses every write itself (its dispatch, its `.data`), so
        # only its identity and tensor are compared; other parameters by version and address.
        # Placeholders (no address, or address 0) also have their tensor checked: two swapped
        # with torch.utils.swap_tensors keep their objects, addresses and versions.
        self.placeholder_tensors = [p._cdata for _, _, p, ptr, _ in w if not ptr]
        groups: Dict[Optional[int], Tuple[list, ...]] = {}
        for (owner, attr, p, ptr, version), name in zip(w, self.watched_names):
            dicts, attrs, params, addressed, versions, addresses, unaddressed, tensors = groups.setdefault(
                self._unit_of(name), ([], [], [], [], [], [], [], [])
            )
            dicts.append(owner._parameters)
            attrs.append(attr)
            params.append(p)
            if ptr is not None and not isinstance(p, StreamedWeight):
                addressed.append(p)
                versions.append(version)
                addresses.append(ptr)
            if not ptr:
                unaddressed.append(p)
                tensors.append(p._cdata)
        self.checked = groups
        self.owners = list({id(owner): (owner, owner._parameters) for owner, _, _ in self.places}.values())

    def _refuse_changes(self) -> None:
        """Refuses a parameter changed since the last publish before anything publishes again
        (unload, reload, reclaim, a re-plan): publishing again would undo the change silently.
        Refused too while a block runs in another thread: its weights must stay where it reads
        them."""
        self._settle_leases("this change between passes", streamed_only=False)
        if self.watched_whole:
            with torch._C.DisableTorchFunctionSubclass():
                self._check_places(grad=False)

    def _publish_views(self) -> None:
        # Views made under inference mode would be inference tensors, which have no version
        # counter for the write guard: a re-plan or reload inside ``torch.inference_mode()``
        # publishes ordinary tensors.
        self.view_holds = {}  # a publish interrupted half way counts nothing as ddo's
        with torch.inference_mode(False):
            self._publish_views_now()
        # What ddo itself holds of each streamed view, counted once the publish's temporaries
        # are gone: a reference beyond these (a tensor a host kept from inside a block's forward,
        # or one derived from it) keeps the slots' memory from being reclaimed.
        self.view_holds = {id(view): _holds(view) for places in self.swaps.values() for _, _, view, _ in places}

    def _republish(self) -> None:
        """Publishes the session's views again from whatever state an interrupted publish left
        (an exception or ``KeyboardInterrupt`` half way): the streamed units' views back in their
        places first, so every parameter has its published class again, then fresh views."""
        for places in self.swaps.values():
            for owner, attr, view, placeholder in places:
                view.requires_grad_(placeholder.requires_grad)
                owner._parameters[attr] = view
        self._publish_views()

    def _publish_views_now(self) -> None:
        self.watched_whole = False
        views: Dict[str, torch.Tensor] = {}
        for names in self.session.parameter_names():
            view = torch.utils.dlpack.from_dlpack(self.session.dlpack(names[0]))
            for n in names:
                views[n] = view
        self._publish(lambda name, p: _parameter_like(p, views[name], self._kept_grad(p)))
        for owner, attr, name in self.places:
            view = owner._parameters[attr]
            self.shapes[name] = torch.empty(view.shape, dtype=view.dtype, device="meta")
        # Streamed units rest on placeholders; their views come back for their forwards.
        unit_of = {name: unit for unit, names in self.streamed.items() for name in names}
        placeholders: Dict[int, torch.nn.Parameter] = {}
        self.swaps = {unit: [] for unit in self.streamed}
        self.ranges = {unit: [] for unit in self.streamed}
        for owner, attr, name in self.places:
            unit = unit_of.get(name)
            if unit is None:
                continue
            view = owner._parameters[attr]
            start = view.data_ptr()
            self.ranges[unit].append((start, start + view.numel() * view.element_size(), name))
            if id(view) not in placeholders:
                weight = StreamedWeight(self, name, view, self.device)
                placeholders[id(view)] = torch.nn.Parameter(weight, requires_grad=view.requires_grad)
            self.swaps[unit].append((owner, attr, view, placeholders[id(view)]))
            owner._parameters[attr] = placeholders[id(view)]
        self._group_swaps()
        self._record_published()
        self.views_whole = self.watched_whole = True

    def _group_swaps(self) -> None:
        """Per streamed unit, its swaps as one update per owner's parameter dict (views in,
        placeholders out), and the span of addresses its views cover."""
        self.swap_in, self.swap_out, self.bounds = {}, {}, {}
        for unit, places in self.swaps.items():
            ins: Dict[int, Tuple[dict, dict, dict]] = {}
            for owner, attr, view, placeholder in places:
                params = owner._parameters
                entry = ins.setdefault(id(params), (params, {}, {}))
                entry[1][attr], entry[2][attr] = view, placeholder
            groups = list(ins.values())
            self.swap_in[unit] = ([g[0] for g in groups], [g[1] for g in groups])
            self.swap_out[unit] = ([g[0] for g in groups], [g[2] for g in groups])
            ranges = self.ranges[unit]
            if ranges:
                self.bounds[unit] = (min(r[0] for r in ranges), max(r[1] for r in ranges))

    def _publish_meta(self, failed: Optional[List[str]] = None) -> None:
        # Holding the views would keep the arena's memory alive. The views go back first, so
        # the placeholders take their class (a quantized parameter's).
        self.views_whole = False
        from torch.multiprocessing.reductions import StorageWeakRef

        self.retired_views = [
            StorageWeakRef(view.untyped_storage()) for places in self.swaps.values() for _, _, view, _ in places
        ]
        for places in self.swaps.values():
            for owner, attr, view, placeholder in places:
                if failed is None or attr in owner._parameters:
                    view.requires_grad_(placeholder.requires_grad)
                    owner._parameters[attr] = view
        self.swaps = {}
        self.ranges = {}
        self.view_holds = {}
        self._group_swaps()
        # Ordinary tensors (with version counters) also under inference mode, as for the views.
        with torch.inference_mode(False):
            self._publish(
                lambda _n, p: _parameter_like(p, torch.empty(p.shape, dtype=p.dtype, device="meta"), self._kept_grad(p)),
                failed,
            )
            # Recorded last: a publish interrupted before here is checked for writes at the next
            # pass; a reload checks the placeholders against this record.
            self.watched_whole = False
            self._record_published()
        self.watched_whole = True

    # ---- hooks ----------------------------------------------------------------------------

    def _wrap_forward(self) -> None:
        """Wraps the module's forward in one pass: forwards of the module run one at a time
        (other threads wait), inputs move to the device, and the pass ends however the forward
        ends (an exception, ``KeyboardInterrupt`` included, aborts it: leases are given back and
        the order seen is not learned). A VAE's ``encode`` and ``decode`` (what pipelines call)
        are passes too; called from inside a pass (``forward`` calling ``encode``) they belong to
        it."""
        names = ["forward"] + [n for n in _VAE_ENTRIES if callable(getattr(type(self.module), n, None))]
        for name in names:
            setattr(self.module, name, self._entry(name, getattr(self.module, name)))
        self.entries = names

    def _entry(self, name: str, original: Any) -> Any:
        runtime = self

        @functools.wraps(original)
        def entry(*args: Any, **kwargs: Any) -> Any:
            if runtime.in_forward.get(threading.get_ident()):
                if name != "forward":
                    return original(*args, **kwargs)
                raise _native.DynamicOffloadLifecycleError(
                    f"{type(runtime.module).__name__}.forward was called inside its own forward; ddo runs one pass at a time"
                )
            with runtime.forward_lock:
                runtime.in_forward[threading.get_ident()] = True
                try:
                    return runtime._pass(original, args, kwargs)
                finally:
                    runtime.in_forward.pop(threading.get_ident(), None)

        return entry

    def _guard_moves(self) -> None:
        """``.to()``, ``.cuda()``, ``.half()`` and the like on the module: a move to where its
        weights already are (the execution device, their dtypes) changes nothing, as for a
        resident module (``pipe.to("cuda")``); any other is refused before anything changes."""
        runtime = self

        def guard(module: torch.nn.Module) -> Any:
            # The dtypes of the weights below this module, as published.
            dtypes = sorted({p.dtype for p in module.parameters()}, key=str)

            @functools.wraps(module._apply)
            def _apply(fn: Any, *args: Any, **kwargs: Any) -> Any:
                for dtype in dtypes:
                    probe = torch.empty(1, dtype=dtype, device=runtime.device)
                    moved = fn(probe)
                    if moved.device != probe.device or moved.dtype != probe.dtype:
                        raise _native.DynamicOffloadLifecycleError(
                            f"{type(runtime.module).__name__} is offloaded by ddo to {runtime.device}: moving or "
                            f"casting {type(module).__name__} ({probe.dtype} on {probe.device} -> {moved.dtype} on "
                            f"{moved.device}) would detach its weights from the arena. Call "
                            "remove_dynamic_offload(module) first, or load it with the dtype and execution device "
                            "you want"
                        )
                return module

            return _apply

        # Every module of the tree: a block cast or copied on its own is refused when asked for too.
        for m in self.module.modules():
            m._apply = guard(m)
            m.__deepcopy__ = self._refuse_deepcopy
            m.__reduce_ex__ = self._refuse_pickle
        # Diffusers' own placement and casting hooks would move or cast weights the arena holds.
        for method in _PLACEMENT_METHODS:
            if method not in self.module.__dict__ and callable(getattr(self.module, method, None)):
                setattr(self.module, method, functools.partial(self._refuse_placement, method))
        name = type(self.module).__name__
        self.module.train = _refusing_true(
            self.module.train,
            f"{name} is offloaded by ddo, which serves inference only (block memory is reused between blocks): keep "
            "it in eval mode, or call remove_dynamic_offload(module) first",
        )
        self.module.requires_grad_ = _refusing_true(
            self.module.requires_grad_,
            f"{name} is offloaded by ddo, which serves inference only: its weights cannot require grad (their memory "
            "is reused between blocks); call remove_dynamic_offload(module) first",
        )

    def _refuse_deepcopy(self, _memo: Any) -> Any:
        raise _native.DynamicOffloadLifecycleError(
            f"{type(self.module).__name__} is offloaded by ddo (its weights live in the arena and stream from their "
            "source): to copy it, build a new module and load its state_dict() (the checkpoint's values), or call "
            "remove_dynamic_offload(module) first"
        )

    def _refuse_pickle(self, _protocol: Any) -> Any:
        raise _native.DynamicOffloadLifecycleError(
            f"{type(self.module).__name__} is offloaded by ddo (its weights live in the arena and stream from their "
            "source), so it cannot be pickled, copied or saved whole: save its weights (save_pretrained, or torch.save of "
            "its state_dict(), which gives the checkpoint's values), or call remove_dynamic_offload(module) first"
        )

    def _refuse_placement(self, method: str, *_args: Any, **_kwargs: Any) -> None:
        raise _native.DynamicOffloadLifecycleError(
            f"{type(self.module).__name__} is offloaded by ddo, which places its weights itself: {method}() would "
            "move or cast weights the arena holds. Use ddo or Diffusers' hooks on a module, not both: call "
            "remove_dynamic_offload(module) first"
        )

    def _check_module(self, args: tuple, kwargs: dict) -> None:
        """Refuses a forward the arena cannot serve correctly: training or gradients (autograd
        would keep views of slot memory that later blocks reuse), and parameters changed after
        attach (a dtype or device move, an assignment: they no longer view the arena)."""
        if self.module.training:
            raise _native.DynamicOffloadLifecycleError(
                f"{type(self.module).__name__} is in training mode; ddo offloads inference only: call module.eval()"
            )
        if torch.is_grad_enabled() and _any_requires_grad((args, kwargs)):
            raise _native.DynamicOffloadLifecycleError(
                "an input requires grad; ddo offloads inference only (gradients would read block memory that later "
                "blocks reuse): run the forward under torch.no_grad() or torch.inference_mode()"
            )
        _refuse_traced(f"{type(self.module).__name__}'s forward")
        # Runs every forward: plain tensor methods, not a parameter subclass's __torch_function__
        # (Diffusers' GGUFParameter wraps each call).
        with torch._C.DisableTorchFunctionSubclass():
            self._check_parameters()

    def _check_parameters(self) -> None:
        # Every forward: each parameter still the one published, at its address, not written
        # in place, without grad (those of hooked units in their blocks' pre-hooks); the host
        # tensors streamed from unwritten; added ones usable.
        self._check_places(units=False)
        for name, p, version in self.sources:
            if p._version != version:
                raise _native.DynamicOffloadSourceChangedError(
                    f"the host tensor of parameter {name}, which ddo streams from, was written since ddo attached "
                    "(through a reference to it: one kept from before, or a state_dict() value): blocks already on the "
                    "device would not see the write. "
                    "Call remove_dynamic_offload(module) first, change the weights, then offload the module again"
                )
        self._check_added_parameters()

    def _check_places(self, grad: Optional[bool] = None, units: bool = True) -> None:
        """Each managed place still holds the parameter published there, at its address, not
        written in place, and (where autograd records: ``grad``, by default the grad mode) without
        grad. With ``units`` false only the places outside the hooked units are compared (a pass
        compares each unit's in its block's pre-hook: :meth:`_check_unit`)."""
        grad = torch.is_grad_enabled() if grad is None else grad
        if len(self.watched) != len(self.places):
            self._refuse_changed_parameter(grad)
        changed = next((o for o, params in self.owners if o.__dict__.get("_parameters") is not params), None)
        if changed is not None:
            raise _native.DynamicOffloadLifecycleError(
                f"the parameters of {type(changed).__name__} were replaced as a whole since ddo attached: call "
                "remove_dynamic_offload(module) first, change the module, then offload it again"
            )
        groups = self.checked.values() if units else [self.checked.get(None, _NO_PLACES)]
        if not all(_places_unchanged(group, grad) for group in groups):
            self._refuse_changed_place(grad)

    def _check_unit(self, unit: int) -> None:
        """The places of a hooked unit, compared once per pass before its block first runs (in
        whichever thread enters it first: a streamed unit's placeholders are then in place)."""
        if unit in self.pass_unchecked:
            grad = torch.is_grad_enabled()
            if not _places_unchanged(self.checked[unit], grad):
                self._refuse_changed_place(grad)
            # Compared: a refusal leaves it to be compared again where the block runs next.
            self.pass_unchecked.discard(unit)

    def _check_unreached_units(self) -> None:
        """The end of a pass: the places of the hooked units whose blocks did not run in it (a
        parent may read their weights itself), before the pass's output is returned."""
        grad = torch.is_grad_enabled()
        unchecked, self.pass_unchecked = self.pass_unchecked, set()
        if not all(_places_unchanged(self.checked[u], grad) for u in tuple(unchecked)):
            self._refuse_changed_place(grad)

    def _refuse_changed_place(self, grad: bool) -> None:
        """Raises for the first changed place (a fast comparison found one)."""
        at = self._first_changed_place(grad)
        if at is None:
            # Changed back between the two comparisons (another thread): refused all the same.
            raise _native.DynamicOffloadLifecycleError(
                f"the parameters of {type(self.module).__name__} changed during this forward (another thread wrote "
                "them): call remove_dynamic_offload(module) first, change the module, then offload it again"
            )
        self._refuse_changed_parameter(grad)
        # Each parameter in place is one ddo published, at its own address: two traded places.
        raise _native.DynamicOffloadLifecycleError(
            f"parameter {self.watched_names[at]} now holds another of the module's parameters (exchanged or tied "
            "since ddo attached): call remove_dynamic_offload(module) first, change the module, then offload it again"
        )

    def _unit_of(self, name: str) -> Optional[int]:
        """The hooked unit below the module's root whose module holds the parameter ``name``
        (the innermost), or ``None`` (compared at the pass's start: a unit at the root runs its
        pre-hook before the pass begins)."""
        path = name
        while "." in path:
            path = path.rsplit(".", 1)[0]
            unit = self.unit_paths.get(path)
            if unit is not None:
                return unit
        return None

    def _first_changed_place(self, grad: bool) -> Optional[int]:
        """The index of the first place whose parameter changed, or ``None``."""
        tensors = iter(self.placeholder_tensors)
        for i, (owner, attr, p, ptr, version) in enumerate(self.watched):
            try:
                if (
                    owner._parameters.get(attr) is not p
                    or (grad and p.requires_grad)
                    or (
                        ptr is not None
                        and not isinstance(p, StreamedWeight)
                        and (p._version != version or p.data_ptr() != ptr)
                    )
                    or (not ptr and p._cdata != next(tensors))
                ):
                    return i
            except RuntimeError:  # data_ptr() of data given no storage
                return i
        return None

    def _refuse_changed_parameter(self, grad: bool = True) -> None:
        """Raises for the first managed parameter changed since it was published (requiring grad
        counts with ``grad``)."""
        published = self.published
        for (owner, attr, p, _ptr, version), name in zip(self.watched, self.watched_names):
            if owner._parameters.get(attr) is p and p._version != version:
                raise _native.DynamicOffloadLifecycleError(
                    f"parameter {name} was written in place since ddo attached: its values come from the checkpoint "
                    "(or the module's host tensors), so the write would be lost at the next reload and state_dict() "
                    "would not show it. Call remove_dynamic_offload(module) first, change the weights, then offload "
                    "the module again"
                )
        for owner, attr, name in self.places:
            p = owner._parameters.get(attr)
            seen = published.get(id(p))
            if seen is None or p is not seen[0] or _address(p) != seen[1]:
                raise _native.DynamicOffloadLifecycleError(
                    f"parameter {name} was changed after ddo attached (a dtype or device move, or an assignment): "
                    "call remove_dynamic_offload(module) first, change the module, then offload it again"
                )
            if grad and p.requires_grad:
                raise _native.DynamicOffloadLifecycleError(
                    f"parameter {name} requires grad; ddo offloads inference only (its memory is reused between blocks): "
                    "run the forward under torch.no_grad() or torch.inference_mode(), or call requires_grad_(False)"
                )

    def _check_added_parameters(self) -> None:
        published = self.published
        # Adapter classes imported since the last guard (no file lookups here).
        if "peft" in sys.modules and len(sys.modules) != _GUARDED_AT[0]:
            _GUARDED_AT[0] = len(sys.modules)
            _guard_adapter_merges()
        # One walk over the modules, when a parameter or module was registered anywhere since the
        # last one, or gradients are on: parameters added after attach (adapters such as LoRA) are
        # the module's own (on the execution device; trainable ones only without gradients), and
        # no adapter may be merged into a streamed weight.
        structure = _STRUCTURE[0]
        if structure == self.walked and not torch.is_grad_enabled():
            for path, m in self.adapter_layers:
                self._check_unmerged(path, m)
            # The module's own parameters found by the last walk: replaced or moved since (.to())?
            if all(m._parameters.get(attr) is p and p.data_ptr() == ptr for m, attr, p, ptr in self.added):
                return
        layers, added = [], []
        for path, m in self.module.named_modules():
            if hasattr(m, "merged_adapters"):
                layers.append((path, m))
                self._check_unmerged(path, m)
            for attr, p in m._parameters.items():
                if p is not None and id(p) not in published:
                    self._check_added(f"{path}.{attr}" if path else attr, p)
                    added.append((m, attr, p, p.data_ptr()))
        self.adapter_layers, self.added, self.walked = layers, added, structure

    @staticmethod
    def _check_unmerged(path: str, m: torch.nn.Module) -> None:
        if m.merged_adapters:
            raise _native.DynamicOffloadLifecycleError(
                f"adapters {m.merged_adapters} were fused into {path or 'the module'}, whose weights stream from "
                "their source: the fused values would be lost at the next upload. Restore the weights with "
                "result.unload() and result.reload() and use the adapters unfused"
            )

    def _check_added(self, name: str, p: torch.nn.Parameter) -> None:
        if p.is_meta:
            raise _native.DynamicOffloadLifecycleError(
                f"parameter {name} (added after ddo attached) has no values: it is meta (added while the weights "
                "were placeholders after reclaim() or unload(), or moved there): delete it (delete_adapters) and add "
                "it again after a forward or reload()"
            )
        if p.device != self.device:
            raise _native.DynamicOffloadLifecycleError(
                f"parameter {name} was added after ddo attached and is on {p.device}, not on the execution device "
                f"{self.device}: move it there (adapters are resident beside the streamed weights)"
            )
        if p.requires_grad and torch.is_grad_enabled():
            raise _native.DynamicOffloadLifecycleError(
                f"parameter {name} requires grad; ddo offloads inference only: run the forward under "
                "torch.no_grad() or torch.inference_mode()"
            )

    def _pass(self, original: Any, args: tuple, kwargs: dict) -> Any:
        if self.session.is_unloaded():
            raise _native.DynamicOffloadLifecycleError(
                f"{type(self.module).__name__} is unloaded (its weights are placeholders): call reload() on its "
                "offload result before the next forward"
            )
        if not self.views_whole:
            # A publish was interrupted: the views still in place must not have been written.
            for owner, attr, p, _address_was, version in self.watched:
                if owner._parameters.get(attr) is p and p._version != version:
                    raise _native.DynamicOffloadLifecycleError(
                        f"parameter {attr} of {type(owner).__name__} was written in place since ddo attached: its "
                        "values come from the checkpoint; call remove_dynamic_offload(module) first, change the module, "
                        "then offload it again"
                    )
            self._republish()
        # Blocks this thread (or a thread that ended) entered directly and never left: their
        # leases back, their weights on placeholders again; a streamed block another thread
        # runs now is waited for by no one, so the forward says so.
        self._settle_leases(f"{type(self.module).__name__}.forward", streamed_only=True)
        self._check_module(args, kwargs)
        stream = self.stream()
        self.pass_units = frozenset(self.session.begin_pass(stream))
        self.pass_unchecked = set(self.checked)
        self.pass_unchecked.discard(None)
        self.pass_stream, self.pass_thread = stream, threading.get_ident()
        try:
            out = original(*move_inputs(args, self.device), **move_inputs(kwargs, self.device))
            with torch._C.DisableTorchFunctionSubclass():
                self._check_unreached_units()
        except BaseException as error:
            self.pass_units = frozenset()
            self.pass_unchecked = set()
            try:
                # The blocks this thread entered and never left, each on the stream it took its
                # lease on; then the pass's own leases, on the pass's stream.
                try:
                    self._release_thread_leases()
                finally:
                    self.session.abort_pass(stream)
            except BaseException as cleanup:  # noqa: BLE001 - attached to the original error
                error.ddo_cleanup_error = cleanup  # type: ignore[attr-defined]
                if hasattr(error, "add_note"):
                    error.add_note(f"ddo could not end the interrupted pass: {cleanup!r}")
            finally:
                self._rest_all()
            raise
        self.pass_units = frozenset()
        self._release_thread_leases()
        self.session.end_pass(stream)
        if self.auto_budget is not None:
            self.auto_budget.after_pass()
        if self.session.encoding_switch_due() and not self.leases:
            try:
                self.switch_encoding()
            except _native.DynamicOffloadError as e:
                # This pass's output stands; the session attached raw again, or is unloaded.
                then = (
                    "it is unloaded: call reload() on its offload result before the next forward"
                    if self.session.is_unloaded()
                    else "it streams raw"
                )
                warnings.warn(
                    f"ddo: {type(self.module).__name__} could not switch to encoded streaming ({e}); {then}",
                    stacklevel=3,
                )
        return out

    def switch_encoding(self) -> bool:
        """``vmm_weight_encoding = auto`` found the passes transfer-bound: the session attaches
        again with the streamed units encoded (new addresses) and the new views are published,
        as a budget change does. ``False`` when tensors kept by the host still view the arena
        (the component stays raw)."""
        self._refuse_changes()
        self.synchronize()
        try:
            self._publish_meta()
            changed = self.session.switch_encoding()
            if changed:
                self.retired_views = []  # a new arena (none of the old one's views was held)
        finally:
            if not self.session.is_unloaded():
                self.streamed = dict(self.session.streamed_units())
                self._republish()
        return changed

    def set_budget(self, total: int) -> bool:
        """Plans the arena again under ``total`` bytes between passes (the caller holds the
        forward lock or is at the end of a pass): the views go, the arena is rebuilt, the new
        views are published. ``False`` when tensors kept by the host still view the arena."""
        self._refuse_changes()
        self.synchronize()
        try:
            self._publish_meta()
            changed = self.session.set_budget(int(total))
            if changed:
                self.retired_views = []  # a new arena (none of the old one's views was held)
        finally:
            # However the re-plan ended (refused, interrupted half way), the module views the
            # arena the session holds now, unless nothing fits any more (unloaded).
            if not self.session.is_unloaded():
                self.streamed = dict(self.session.streamed_units())
                self._republish()
        return changed

    def _state_dict_hook(self, owned: Dict[str, str]):
        """A hook for one module: outside a forward a streamed parameter's view shows whatever
        unit its slot holds, so ``state_dict()`` (of this module or any module above it) gives
        each parameter's own values instead. ``owned`` maps the module's attribute names to the
        parameters' full names."""

        def hook(_m: torch.nn.Module, state: dict, prefix: str, _meta: Any) -> None:
            for attr, full in owned.items():
                key = prefix + attr
                if key in state:
                    state[key] = self._source_value(full, state[key])

        return hook

    def _source_value(self, name: str, like: torch.Tensor) -> torch.Tensor:
        original = self.originals.get(name)
        if original is not None and not original.is_meta and self.checkpoint is None:
            return original.detach()
        if self.session.is_unloaded():
            return like  # meta placeholders while unloaded
        raw = bytearray(self.session.source_tensor(name))
        if len(raw) != like.numel() * like.element_size():
            raise _native.DynamicOffloadLifecycleError(
                f"parameter {name} was changed after ddo attached (it is {like.dtype} {list(like.shape)}, its source "
                f"holds {len(raw)} bytes): call remove_dynamic_offload(module) first, change the module, then offload "
                "it again"
            )
        return torch.frombuffer(raw, dtype=like.dtype).reshape(like.shape) if raw else torch.empty(like.shape, dtype=like.dtype)

    def _refuse_fuse(self, *_args: Any, **_kwargs: Any) -> None:
        raise _native.DynamicOffloadLifecycleError(
            f"{type(self.module).__name__} is offloaded by ddo: its weights stream from their source, so fused "
            "adapter values would be lost at the next upload. Use the adapters unfused (set_adapters weighs them), "
            "or call remove_dynamic_offload(module) before fuse_lora"
        )

    def _refuse_load(self, _module: Any, state_dict: dict, prefix: str, *_args: Any, **_kwargs: Any) -> None:
        """Refuses a ``load_state_dict`` that would write a streamed weight (it views arena memory);
        one that loads only the module's own parameters (adapters added after attach) goes on."""
        managed = {prefix + n for n, p in self.module.named_parameters(remove_duplicate=False) if id(p) in self.published}
        managed |= {prefix + name for _, _, name in self.places}
        touched = sorted(k for k in state_dict if k in managed)
        if touched:
            raise _native.DynamicOffloadLifecycleError(
                f"{type(self.module).__name__} is offloaded by ddo: its weights ({touched[0]}"
                f"{f' and {len(touched) - 1} more' if len(touched) > 1 else ''}) view arena memory; call "
                "remove_dynamic_offload(module) before load_state_dict"
            )

    def _pre(self, unit: int):
        def hook(m: torch.nn.Module, _args: tuple) -> None:
            if m.training:
                raise _native.DynamicOffloadLifecycleError(
                    f"block {type(m).__name__} of {type(self.module).__name__} is in training mode; ddo offloads "
                    "inference only: call module.eval()"
                )
            # A block compiled on its own (regional compilation) traces this hook; a capture may
            # also begin inside the forward.
            _refuse_traced(lambda: f"block {type(m).__name__} of {type(self.module).__name__}")
            if unit in self.pass_unchecked:
                with torch._C.DisableTorchFunctionSubclass():
                    self._check_unit(unit)
            stream = self.stream()
            if (
                unit in self.pass_units
                and stream == self.pass_stream
                and self.pass_thread == threading.get_ident()
                and self.in_forward.get(self.pass_thread)
            ):
                # Leased for the whole pass on this stream: no lease, no fence per block.
                self.session.reached(unit)
                return
            self.leases.setdefault((threading.get_ident(), unit), []).append((self.session.acquire(unit, stream), stream))
            dicts, views = self.swap_in.get(unit, _NO_SWAPS)
            any(map(dict.update, dicts, views))  # each owner's views in place (C-level loop)

        return hook

    def _post(self, unit: int):
        def hook(m: torch.nn.Module, _args: tuple, out: Any) -> None:
            key = (threading.get_ident(), unit)
            held = self.leases.get(key)
            released = bool(held)
            if released:
                self.session.release(held.pop()[0], self.stream())
            if not held:
                self.leases.pop(key, None)
                # Placeholders back once no thread runs the block (another may still read its
                # views). Without a lease released here (leased for the pass, or its pre-hook
                # refused the block before taking one) this thread put no view in place.
                if released and (not self.leases or not any(u == unit for _, u in tuple(self.leases))):
                    self._rest(unit)
            self._refuse_streamed_output(unit, m, out)
            if torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(out)):
                # Grad enabled inside the forward (a hook, a block's own code) after the entry
                # let it in: backward would read memory that later blocks reuse.
                raise _native.DynamicOffloadLifecycleError(
                    f"autograd recorded {type(m).__name__} ({self._unit_path(unit)}) of {type(self.module).__name__}: "
                    "ddo offloads inference only (backward would read block memory that later blocks reuse); keep "
                    "gradients off inside the forward (torch.no_grad() or torch.inference_mode())"
                )

        return hook

    def _refuse_streamed_output(self, unit: int, m: torch.nn.Module, out: Any) -> None:
        """A block's output may not view its streamed weights: their memory holds other blocks'
        weights once the block ends."""
        bounds = self.bounds.get(unit)
        if bounds is None:
            return
        low_unit, high_unit = bounds
        for t in _tensors(out):
            # A view of a weight starts inside that weight's memory, so inside the unit's span.
            try:
                at = t.data_ptr()
            except RuntimeError:  # no storage
                continue
            if not low_unit <= at <= high_unit:
                continue
            storage = t.untyped_storage()
            low = storage.data_ptr()
            high = low + storage.nbytes()
            for start, end, name in self.ranges[unit]:
                if low < end and start < high:
                    raise _native.DynamicOffloadLifecycleError(
                        f"the output of {type(m).__name__} ({self._unit_path(unit)}) views its streamed weight "
                        f"{name}, whose memory holds other blocks' weights once the block ends: return a copy "
                        "(.clone()) from that block, or keep the module resident (route none)"
                    )

    def _unit_path(self, unit: int) -> str:
        """The module path of a streamed unit."""
        return next((name for u, name, _ in self.session.units() if u == unit), str(unit))

    def _settle_leases(self, what: str, streamed_only: bool) -> None:
        """Gives back the leases of this thread's blocks and of threads that ended (a block
        interrupted by a ``BaseException`` skips its post-hook), then refuses ``what`` while
        another thread runs a block (a streamed one only, with ``streamed_only``)."""
        if not self.leases:
            return
        alive = {t.ident for t in threading.enumerate()}
        me = threading.get_ident()
        self._release_leases_of(lambda thread: thread == me or thread not in alive)
        running = sorted({u for _, u in tuple(self.leases) if not streamed_only or u in self.swaps})
        if running:
            raise _native.DynamicOffloadLifecycleError(
                f"{what} needs every block of {type(self.module).__name__} at rest, but "
                f"{', '.join(self._unit_path(u) for u in running[:3])} runs in another thread now; call it again "
                "once that block returns"
            )

    def _release_thread_leases(self) -> None:
        """Gives back the leases this thread's blocks took and did not give back (a block
        interrupted, or an exception a forward caught), each on the stream it was taken on;
        other threads' leases stay with them."""
        me = threading.get_ident()
        self._release_leases_of(lambda thread: thread == me)

    def _release_leases_of(self, whose: Callable[[int], bool]) -> None:
        """Gives back the leases of the threads ``whose`` picks, each on the stream it was taken
        on; their blocks go back on placeholders unless another thread still runs them."""
        if not self.leases:
            return
        ended = [key for key in tuple(self.leases) if whose(key[0])]
        for key in ended:
            for lease, stream in self.leases.pop(key, ()):
                self.session.release(lease, stream)
        held = {u for _, u in tuple(self.leases)}
        for _, unit in ended:
            if unit not in held:
                self._rest(unit)

    def _rest(self, unit: int) -> None:
        dicts, placeholders = self.swap_out.get(unit, _NO_SWAPS)
        any(map(dict.update, dicts, placeholders))

    def _rest_all(self) -> None:
        """Every streamed unit no thread runs back on its placeholders (a pass ended, however
        it ended): each place that holds the unit's view. A place holding anything else keeps
        it (a parameter the host replaced, which the next check refuses, is not undone)."""
        held = {u for _, u in tuple(self.leases)}
        for unit, places in self.swaps.items():
            if unit not in held:
                for owner, attr, view, placeholder in places:
                    if owner._parameters.get(attr) is view:
                        owner._parameters[attr] = placeholder

    # ---- lifecycle ------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Waits for the execution device's work (the host backend's is already complete)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def metrics(self, phase: Optional[str] = None) -> Dict[str, Any]:
        """The session's metrics snapshot as a dict."""
        return json.loads(self.session.metrics(phase))

    def warnings(self) -> List[str]:
        return list(self.session.warnings())

    def reclaim(self) -> tuple:
        """Releases idle slot memory. Streamed parameters are placeholders between passes (their
        views are in place only while their block runs); resident ones keep their memory."""
        self._not_inside_forward("reclaim()")
        with self.forward_lock:
            self._refuse_changes()
            self.synchronize()
            self._rest_all()
            kept = self._kept_streamed_views()
            if kept:
                gc.collect()  # a view only a garbage cycle holds (a traceback) holds nothing
                kept = self._kept_streamed_views()
            if kept:
                warnings.warn(
                    f"ddo: reclaim() kept the execution slots of {type(self.module).__name__}: tensors taken from "
                    f"the weights of its streamed blocks during a forward ({', '.join(kept[:3])}"
                    f"{f' and {len(kept) - 3} more' if len(kept) > 3 else ''}) still view slot memory, which "
                    "reclaiming would free under them. Drop those references (or clone them inside the forward), "
                    "then call reclaim() again",
                    stacklevel=3,
                )
                return (0, 0)
            return self.session.reclaim()

    def _kept_streamed_views(self) -> List[str]:
        """The blocks whose streamed views something beyond ddo still references (between
        passes, when ddo's own references are the ones counted at publish)."""
        holds = self.view_holds
        kept = [
            self._unit_path(unit)
            for unit, places in self.swaps.items()
            if any(_held_beyond(_holds(view), holds.get(id(view))) for _, _, view, _ in places)
        ]
        self.retired_views = [r for r in self.retired_views if not r.expired()]
        if self.retired_views:
            kept.append(f"{len(self.retired_views)} weights from before a re-plan refused while they were held")
        return kept

    def _not_inside_forward(self, what: str) -> None:
        if self.in_forward.get(threading.get_ident()):
            raise _native.DynamicOffloadLifecycleError(f"{what} was called inside the module's forward; call it between passes")

    def unload(self) -> None:
        """Parameters become meta placeholders and the arena's memory is freed (after a forward
        running in another thread ends)."""
        self._not_inside_forward("unload()")
        with self.forward_lock:
            self._unload()

    def _unload(self) -> None:
        self._refuse_changes()
        self.synchronize()
        self._publish_meta()
        self.leases.clear()
        self.session.release_leases(_stream(self.device))
        if not self.session.unload():
            warnings.warn(
                f"ddo: tensors kept from {type(self.module).__name__} still view its device memory; it is freed "
                "when the last of them is dropped",
                stacklevel=3,
            )
        report_drop_failures()

    def reload(self) -> None:
        """Attaches again (new addresses) and publishes the new views, after a forward running in
        another thread ends (a forward waits for the reload)."""
        self._not_inside_forward("reload()")
        with self.forward_lock:
            self._refuse_changes()
            self.session.reload()
            self.retired_views = []  # what the host kept holds the old arena's memory, not this one's
            try:
                self._publish_views()
            except BaseException:
                # Interrupted half way: the views the reloaded session holds, whole.
                self._republish()
                raise

    def is_unloaded(self) -> bool:
        return self.session.is_unloaded()

    def detach(self) -> None:
        """Removes the hooks and closes the session after the device's work completed. Host
        tensors the module had (linear route) are put back; weights that lived only in the
        arena (native route) become meta placeholders. Waits for a forward running in another
        thread to end."""
        self._not_inside_forward("remove()")
        with self.forward_lock:
            self._detach()

    def _detach(self, restore: bool = False) -> None:
        """``restore``: put the module's own tensors back on either route (an attach that did
        not complete)."""
        self.detached = True
        _RUNTIMES.discard(self)
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for name in self.entries or ["forward"]:
            self.module.__dict__.pop(name, None)
        for m in self.module.modules():
            m.__dict__.pop("_apply", None)
            m.__dict__.pop("__deepcopy__", None)
            m.__dict__.pop("__reduce_ex__", None)
        for guarded in ("__deepcopy__", "train", "requires_grad_"):
            self.module.__dict__.pop(guarded, None)
        for method in _PLACEMENT_METHODS:
            guard = self.module.__dict__.get(method)
            if isinstance(guard, functools.partial) and guard.func == self._refuse_placement:
                del self.module.__dict__[method]
        if self.module.__dict__.get("fuse_lora") == self._refuse_fuse:
            del self.module.__dict__["fuse_lora"]
        self.published, self.watched, self.watched_names, self.owners = {}, [], [], []
        self.swap_views = {}
        self.checked = {}
        self.pass_unchecked = set()
        self.placeholder_tensors = []
        self.watched_whole = False
        if self.session is None:
            return
        self.synchronize()
        # Places the module no longer has as they were (a parameter deleted, or re-registered by
        # parametrize) are skipped: the session is closed whatever the module became.
        failed: List[str] = []
        try:
            if self.checkpoint is None or restore:
                for places, originals in ((self.places, self.originals), (self.buffer_places, self.original_buffers)):
                    for owner, attr, name in places:
                        if name in originals:
                            try:
                                setattr(owner, attr, originals[name])
                            except (KeyError, AttributeError, TypeError, RuntimeError):
                                failed.append(name)
            else:
                self._publish_meta(failed)
        finally:
            if not self.session.is_unloaded():
                self.leases.clear()
                self.session.release_leases(_stream(self.device))
                self.session.unload()
            report_drop_failures()
        if failed:
            warnings.warn(
                f"ddo: {len(failed)} weight(s) of {type(self.module).__name__} could not be given back ({', '.join(failed[:3])}"
                f"{', ...' if len(failed) > 3 else ''}): the module no longer has them as they were (deleted, or "
                "re-registered by parametrize) since ddo attached; its other weights are given back",
                stacklevel=3,
            )
