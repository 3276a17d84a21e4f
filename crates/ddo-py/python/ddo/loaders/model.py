"""Building a model for loading: without weights (meta) where the route streams every weight from
the checkpoint, else by the model class's own loader; then each parameter bound to its checkpoint
slice."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

from . import checkpoint, gguf, meta, transformers_models

__all__ = ["bind_source", "build_module"]


def build_module(
    settings: Any,
    path: str,
    folder: str,
    gguf_path: Optional[str],
    gguf_tensors: Any,
    model_loader: Any,
    apply_dynamic: bool,
    from_pretrained_kwargs: Dict[str, Any],
) -> torch.nn.Module:
    """The model to offload. With ``apply_dynamic`` on the native and disk routes it is built
    without weights where it can be; otherwise loaded (``from_single_file`` for a GGUF file,
    else ``from_pretrained``)."""
    module = None
    if apply_dynamic:
        # The native and disk routes stream every weight from the checkpoint (its mapping, or
        # reads into staging): build the module without weights (meta) so host memory holds the
        # model at most once.
        if settings.route_facts["reads_checkpoint"]:
            if gguf_tensors is not None and gguf_path is not None:
                module = gguf.meta_gguf_module(model_loader, folder, gguf_path, gguf_tensors, from_pretrained_kwargs)
            elif checkpoint.is_transformers(model_loader):
                module = transformers_models.meta_transformers(model_loader, folder, from_pretrained_kwargs)
            elif hasattr(model_loader, "from_config"):
                module = meta.meta_module(model_loader, folder, _dtype(from_pretrained_kwargs))
    if module is None and gguf_path:
        kwargs = {**from_pretrained_kwargs, "quantization_config": gguf.gguf_config(from_pretrained_kwargs)}
        module = model_loader.from_single_file(gguf_path, config=folder, **kwargs)
    elif module is None:
        module = model_loader.from_pretrained(os.fspath(path), **from_pretrained_kwargs)
    return module


def _dtype(kwargs: Dict[str, Any]) -> Any:
    """``torch_dtype``, else ``dtype`` (Diffusers' newer name), as ``from_pretrained`` reads them."""
    return kwargs["torch_dtype"] if kwargs.get("torch_dtype") is not None else kwargs.get("dtype")


def bind_source(module: torch.nn.Module, source: Dict[str, Any], path: str, gguf_path: Optional[str]) -> int:
    """Records the checkpoint ``source`` (opened at ``path``) on ``module`` and counts the
    parameters and buffers bound to a checkpoint slice by name (and shape)."""
    source["path"] = path
    setattr(module, "_ddo_source", source)
    names = {t["name"]: t for t in source["tensors"]}
    bound = 0
    for n, p in list(module.named_parameters()) + list(module.named_buffers()):
        t = names.get(n)
        # A GGUF tensor's shape was checked against its parameter's when the module was built.
        if t is not None and (gguf_path is not None or list(t["shape"]) == list(p.shape)):
            bound += 1
    return bound
