"""A Diffusers model built from its config with every parameter on the meta device: its bytes come
from the checkpoint."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

__all__ = ["meta_module"]


def meta_module(loader: Any, folder: str, dtype: Any) -> Optional[torch.nn.Module]:
    """The model built from its config as Diffusers' ``from_pretrained(torch_dtype=dtype)``
    builds it, with every parameter on the meta device (its bytes come from the checkpoint):
    constructed under ``dtype`` as the default dtype, non-persistent buffers computed, and
    parameters of the class's ``_keep_in_fp32_modules`` in fp32. ``None`` when the model has
    persistent buffers (their values come from the checkpoint) or cannot be built that way."""
    try:
        import accelerate
        from diffusers.models.modeling_utils import no_init_weights
    except ImportError:
        return None
    config = loader.load_config(folder)
    previous = torch.get_default_dtype()
    floating = isinstance(dtype, torch.dtype) and dtype.is_floating_point
    try:
        if floating:
            torch.set_default_dtype(dtype)
        with no_init_weights(), accelerate.init_empty_weights():
            module = loader.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    persistent = set(module.state_dict().keys()) - {n for n, _ in module.named_parameters(remove_duplicate=False)}
    if persistent:
        return None
    keep = getattr(loader, "_keep_in_fp32_modules", None) or []
    keep = [keep] if isinstance(keep, str) else list(keep)
    if floating:
        # One replacement per parameter, set under every name it has (tied parameters stay tied).
        replaced: Dict[int, torch.nn.Parameter] = {}
        for name, param in list(module.named_parameters(remove_duplicate=False)):
            want = torch.float32 if any(k in name.split(".") for k in keep) else dtype
            if id(param) not in replaced and param.is_floating_point() and param.dtype != want:
                replaced[id(param)] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=want, device="meta"), requires_grad=param.requires_grad
                )
            if id(param) in replaced:
                owner, _, leaf = name.rpartition(".")
                holder = module.get_submodule(owner) if owner else module
                holder._parameters[leaf] = replaced[id(param)]
    return module.eval()
