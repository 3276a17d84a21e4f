"""The placeholder a streamed parameter rests on between passes (:class:`StreamedWeight`)."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

from .. import _native
from .guards import refuse_write
from .torch_internals import DISABLED_TORCH_FUNCTION, make_wrapper_subclass, tree_leaves, tree_map

__all__ = ["StreamedWeight"]


class StreamedWeight(torch.Tensor):
    """A streamed parameter between passes. Its block's device memory holds other blocks' weights
    then, so instead of a view of it the parameter is this placeholder: same shape, dtype and
    device, no storage of its own. Reading it (norms, copies, ``print``, ``numpy()``, pickling)
    gives the source's values, read again on every use; a view of it (an index, ``view``,
    ``.data``) is a placeholder too, and writing into any of them is refused. A forward swaps the
    parameter's view of arena memory in while its block runs."""

    # Set on each placeholder by ``__new__``; ``quant_type`` and ``_ddo_class`` only for a
    # quantized framework parameter's.
    _ddo_runtime: Callable[[], Any]
    _ddo_name: str
    _ddo_chain: tuple
    quant_type: Any
    _ddo_class: Optional[type]

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
        t = make_wrapper_subclass(cls, like, device)
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

    # torch's stub declares ``__repr__`` with an unnamed keyword-only parameter no override can match.
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # noqa: ARG002
        view = " (a view)" if self._ddo_chain else ""
        return f"StreamedWeight({self._ddo_name}{view}, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    # PyTorch's documented opt-out for a subclass; its stub types the attribute as a plain function.
    __torch_function__ = DISABLED_TORCH_FUNCTION  # type: ignore[assignment]

    @property
    def data(self) -> torch.Tensor:
        # ``Tensor.data`` is a C descriptor, which torch's stub types as a tensor.
        return torch.Tensor.data.__get__(self)  # type: ignore[attr-defined]

    @data.setter
    def data(self, _value: torch.Tensor) -> None:
        raise refuse_write(self._ddo_name)

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

    # A classmethod, as PyTorch documents it; its stub types the base's as a plain function.
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for i, a in enumerate(schema.arguments):
                if a.alias_info is None or not a.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
                for target in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(target, StreamedWeight):
                        raise refuse_write(target._ddo_name)
        leaves = tree_leaves((args[1:], kwargs))
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

        args = tree_map(real, args)
        kwargs = tree_map(real, kwargs)
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
