"""Refusals: what a module offloaded by ddo must not do, refused before anything changes (moves
and casts, copies and pickling, training, tracing and graph capture, other placement libraries'
hooks, fused adapters, writes into streamed weights), each with what to do instead."""

from __future__ import annotations

import functools
import importlib.util
import sys
import weakref
from typing import Any, List

import torch

from .. import _native
from .module_tree import LAYER_DTYPES

__all__ = [
    "ATTACHED",
    "Guards",
    "check_layer_route",
    "guard_adapter_merges",
    "guard_new_adapter_classes",
    "refuse_traced",
    "refuse_write",
    "refusing_true",
]

# Diffusers model methods that hook weight placement or casting, refused while ddo offloads.
PLACEMENT_METHODS = ("enable_group_offload", "enable_layerwise_casting")

# Attached runtimes (``SessionRuntime``), for the adapter-merge guard and the idle-cache release.
ATTACHED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def refuse_write(name: str) -> Exception:
    return _native.DynamicOffloadLifecycleError(
        f"writing into {name}: ddo streams its values from the checkpoint (or the module's host tensors) at "
        "every pass, so a write would be lost or mixed with them. Call remove_dynamic_offload(module) first, "
        "change the weights, then offload the module again"
    )


def refuse_traced(what: Any, capture: bool = True) -> None:
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


def refusing_true(method: Any, message: str) -> Any:
    """``method(flag=True)`` refused with ``message`` when ``flag`` is true (``train``,
    ``requires_grad_``); ``method(False)`` goes on."""

    @functools.wraps(method)
    def guarded(flag: bool = True) -> Any:
        if flag:
            raise _native.DynamicOffloadLifecycleError(message)
        return method(flag)

    return guarded


def check_layer_route(module: torch.nn.Module, layers: List[str]) -> None:
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
        if not plain or p.dtype not in LAYER_DTYPES:
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


def _refuse_merge_into_streamed(layer: Any) -> None:
    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
    own = [id(p) for p in base.parameters(recurse=False)]
    for runtime in list(ATTACHED):
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


def guard_adapter_merges() -> None:
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


def guard_new_adapter_classes() -> None:
    """Guards the adapter classes imported since the last guard (no file lookups: it runs every
    forward)."""
    if "peft" in sys.modules and len(sys.modules) != _GUARDED_AT[0]:
        _GUARDED_AT[0] = len(sys.modules)
        guard_adapter_merges()


class Guards:
    """The refusals installed on an attached module (part of :class:`SessionRuntime`), and their
    removal at detach."""

    module: torch.nn.Module
    device: torch.device
    published: dict
    places: list

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
            # Set on each instance, shadowing the class's methods until detach takes them off.
            setattr(m, "_apply", guard(m))
            setattr(m, "__deepcopy__", self._refuse_deepcopy)
            setattr(m, "__reduce_ex__", self._refuse_pickle)
        # Diffusers' own placement and casting hooks would move or cast weights the arena holds.
        for method in PLACEMENT_METHODS:
            if method not in self.module.__dict__ and callable(getattr(self.module, method, None)):
                setattr(self.module, method, functools.partial(self._refuse_placement, method))
        name = type(self.module).__name__
        refuse_training = refusing_true(
            self.module.train,
            f"{name} is offloaded by ddo, which serves inference only (block memory is reused between blocks): keep "
            "it in eval mode, or call remove_dynamic_offload(module) first",
        )
        refuse_grad = refusing_true(
            self.module.requires_grad_,
            f"{name} is offloaded by ddo, which serves inference only: its weights cannot require grad (their memory "
            "is reused between blocks); call remove_dynamic_offload(module) first",
        )
        setattr(self.module, "train", refuse_training)
        setattr(self.module, "requires_grad_", refuse_grad)

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

    def _remove_guards(self) -> None:
        """Takes off every refusal :meth:`_guard_moves` and attach installed on the module."""
        for m in self.module.modules():
            m.__dict__.pop("_apply", None)
            m.__dict__.pop("__deepcopy__", None)
            m.__dict__.pop("__reduce_ex__", None)
        for guarded in ("__deepcopy__", "train", "requires_grad_"):
            self.module.__dict__.pop(guarded, None)
        for method in PLACEMENT_METHODS:
            guard = self.module.__dict__.get(method)
            if isinstance(guard, functools.partial) and guard.func == self._refuse_placement:
                del self.module.__dict__[method]
        if self.module.__dict__.get("fuse_lora") == self._refuse_fuse:
            del self.module.__dict__["fuse_lora"]
