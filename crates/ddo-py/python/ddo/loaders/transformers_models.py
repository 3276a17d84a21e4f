"""A transformers model built as its ``from_pretrained`` builds it, with every parameter on the meta
device."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

__all__ = ["meta_transformers"]


def meta_transformers(loader: Any, folder: str, kwargs: Dict[str, Any]) -> Optional[torch.nn.Module]:
    """A transformers model as its ``from_pretrained`` builds it (dtypes, ``_keep_in_fp32_modules``,
    tied weights) with every parameter on the meta device, and non-persistent buffers computed
    as construction computes them. ``None`` when a buffer's values come from the checkpoint."""
    try:
        import accelerate
    except ImportError:
        return None
    dtype_kwargs = {k: kwargs[k] for k in ("dtype", "torch_dtype") if k in kwargs}
    extra = {k: kwargs[k] for k in ("revision", "trust_remote_code", "variant") if k in kwargs}
    # Recent transformers swap layers for kernels of the loading device ("kernelize") by default;
    # a model on the meta device has none, and ddo keeps the model's own layers.
    try:
        module = loader.from_pretrained(folder, device_map="meta", use_kernels=False, **dtype_kwargs, **extra)
    except TypeError as e:
        if "use_kernels" not in str(e):
            raise
        module = loader.from_pretrained(folder, device_map="meta", **dtype_kwargs, **extra)
    missing = [n for n, b in module.named_buffers() if b.is_meta]
    if missing:
        if set(missing) & set(module.state_dict().keys()):
            return None
        # Buffers are computed as construction under the loaded dtype computes them.
        dtype = getattr(module.config, "dtype", None) or getattr(module.config, "torch_dtype", None)
        dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        with accelerate.init_empty_weights(include_buffers=False):
            skeleton = loader._from_config(module.config, **({"dtype": dtype} if isinstance(dtype, torch.dtype) else {}))
        real = dict(skeleton.named_buffers())
        for name in missing:
            owner, _, leaf = name.rpartition(".")
            holder = module.get_submodule(owner) if owner else module
            holder._buffers[leaf] = real[name]
    return module.eval()
