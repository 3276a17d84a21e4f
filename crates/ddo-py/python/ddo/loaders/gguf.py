"""GGUF files with Diffusers parameter names: which file to load, its tensors' types and shapes
(header only), the quantization config, and the model built as Diffusers' ``from_single_file``
builds it with every parameter on the meta device."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union, cast

import torch

from .. import _native
from ..errors import DynamicOffloadError
from . import meta as diffusers_meta

__all__ = ["gguf_config", "gguf_path", "gguf_tensors", "meta_gguf_module"]


def gguf_path(folder: str, gguf_file: Union[str, os.PathLike, None], variant: Optional[str]) -> Optional[str]:
    """The GGUF file to load: ``gguf_file`` (a name in ``folder``, or a path), else the folder's
    one ``*.gguf`` when it holds no safetensors; ``None`` when there is none."""
    if gguf_file is None:
        names = os.listdir(folder) if os.path.isdir(folder) and not variant else []
        ggufs = [n for n in names if n.endswith(".gguf")]
        if len(ggufs) != 1 or any(".safetensors" in n for n in names):
            return None
        gguf_file = ggufs[0]
    elif variant:
        raise DynamicOffloadError(
            f"variant={variant!r} selects safetensors files; it does not apply to gguf_file={gguf_file!r}"
        )
    file = os.path.join(folder, os.fspath(gguf_file))
    if not os.path.isfile(file):
        raise DynamicOffloadError(f"gguf_file {file} is not a file")
    return file


def gguf_tensors(folder: str, path: str) -> Dict[str, tuple]:
    """Each tensor of the GGUF file at ``path`` as ``(GGML type, shape)``, the shape Diffusers'
    GGUF loader gives it (bytes per row last for every type but F32 and F16). Reads the header
    only; a type Diffusers cannot dequantize is refused, as is a folder without ``config.json``."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise DynamicOffloadError(
            f"{folder} has no config.json: a GGUF file ({path}) is loaded with the model's config, so pass the "
            "model folder that holds it (gguf_file= names the file in it, or any path)"
        )
    try:
        import gguf
        from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES
    except ImportError as e:
        raise DynamicOffloadError(f"loading {path} needs gguf and diffusers (pip install gguf): {e}") from None
    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    out: Dict[str, tuple] = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type not in plain and t.tensor_type not in SUPPORTED_GGUF_QUANT_TYPES:
            supported = ", ".join(q.name for q in (*plain, *SUPPORTED_GGUF_QUANT_TYPES))
            raise _native.DynamicOffloadCheckpointError(
                f"{path}: tensor {t.name} has GGUF type {t.tensor_type.name}, which Diffusers cannot dequantize "
                f"(supported: {supported})"
            )
        out[t.name] = (t.tensor_type, tuple(int(d) for d in t.data.shape))
    return out


def _dtype(kwargs: Dict[str, Any]) -> Any:
    """``dtype``, else ``torch_dtype``, as ``from_single_file`` reads them."""
    return kwargs["dtype"] if kwargs.get("dtype") is not None else kwargs.get("torch_dtype")


def gguf_config(kwargs: Dict[str, Any]) -> Any:
    """The caller's ``quantization_config`` (GGUF only), else Diffusers' GGUF configuration
    computing in ``torch_dtype``."""
    from diffusers import GGUFQuantizationConfig

    config = kwargs.get("quantization_config")
    if config is None:
        return GGUFQuantizationConfig(compute_dtype=_dtype(kwargs))
    if not isinstance(config, GGUFQuantizationConfig):
        raise DynamicOffloadError(f"a GGUF file loads with a GGUFQuantizationConfig, not {type(config).__name__}")
    return config


def meta_gguf_module(loader: Any, folder: str, path: str, tensors: Dict[str, tuple], kwargs: Dict[str, Any]) -> Any:
    """The model as Diffusers' ``from_single_file(path, config=folder, quantization_config=...)``
    builds it, every parameter on the meta device: built under the default dtype (buffers stay
    as built), Linear layers whose weight the file quantizes (BF16 included) become ``GGUFLinear``
    with a meta ``GGUFParameter`` of the file's type and byte shape, and F32/F16 tensors' parameters
    take ``torch_dtype`` (fp32 in ``_keep_in_fp32_modules``). ``None`` when the model cannot be
    built without weights. Every parameter must be in the file by its Diffusers name."""
    import gguf
    from diffusers.quantizers import DiffusersAutoQuantizer
    from diffusers.quantizers.gguf.utils import GGML_QUANT_SIZES, GGUFLinear, GGUFParameter

    quantizer = DiffusersAutoQuantizer.from_config(gguf_config(kwargs))
    quantizer.validate_environment()
    dtype = quantizer.update_torch_dtype(_dtype(kwargs))
    module = diffusers_meta.meta_module(loader, folder, None)
    if module is None:
        return None
    params = list(module.named_parameters(remove_duplicate=False))
    missing = next((n for n, _ in params if n not in tensors), None)
    if missing is not None:
        raise _native.DynamicOffloadCheckpointError(
            f"{path} has no tensor {missing}: ddo streams GGUF tensors by their Diffusers parameter names, and this "
            f"file's keys are in another layout (an original checkpoint's); use a GGUF file with {type(module).__name__}'s "
            "Diffusers names, or load this one with Diffusers' from_single_file"
        )
    plain = {gguf.GGMLQuantizationType.F32: torch.float32, gguf.GGMLQuantizationType.F16: torch.float16}
    meta = lambda shape, d: torch.empty(shape, dtype=d, device="meta")  # noqa: E731
    state = {
        n: meta(shape, plain[q]) if q in plain else GGUFParameter(meta(shape, torch.uint8), quant_type=q)
        for n, (q, shape) in tensors.items()
    }
    keep = getattr(loader, "_keep_in_fp32_modules", None) or []
    keep = [keep] if isinstance(keep, str) else list(keep)
    quantizer.preprocess_model(model=module, device_map=None, state_dict=state, keep_in_fp32_modules=keep)
    replaced: Dict[int, torch.nn.Parameter] = {}
    for name, param in params:
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        param = cast(torch.nn.Parameter, owner._parameters[leaf])  # a parameter of the module built above
        if id(param) not in replaced:
            q, shape = tensors[name]
            parts = name.split(".")
            fp32 = any(k in parts for k in keep)
            block, size = GGML_QUANT_SIZES[q]
            values = (*shape[:-1], shape[-1] // size * block) if q not in plain else shape
            if tuple(values) != tuple(param.shape):
                raise _native.DynamicOffloadCheckpointError(
                    f"{path}: tensor {name} ({q.name}) holds shape {list(values)}, the model's parameter has "
                    f"{list(param.shape)}"
                )
            if q in plain:
                new = meta(shape, torch.float32 if fp32 else dtype)
            elif isinstance(owner, GGUFLinear) and leaf == "weight":
                new = GGUFParameter(meta(shape, torch.uint8), quant_type=q)
            elif q == gguf.GGMLQuantizationType.BF16 and any(m in parts for m in quantizer.modules_to_not_convert):
                # Diffusers dequantizes it at load; the session converts BF16 the same way.
                new = meta(values, torch.float32 if fp32 else quantizer.compute_dtype)
            else:
                raise _native.DynamicOffloadCheckpointError(
                    f"{path}: tensor {name} has GGUF type {q.name}; ddo streams quantized tensors as stored, into the "
                    f"weights of Linear layers Diffusers quantizes only ({type(owner).__name__} {owner_path or '(root)'} is "
                    "not one): store it as F32 or F16 (or BF16 in modules Diffusers keeps unquantized)"
                )
            replaced[id(param)] = new if isinstance(new, GGUFParameter) else torch.nn.Parameter(new, requires_grad=False)
        owner._parameters[leaf] = replaced[id(param)]
    quantizer.postprocess_model(module)
    module.hf_quantizer = quantizer
    return module.eval()
