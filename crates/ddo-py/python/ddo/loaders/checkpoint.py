"""Where a model's weights are: a local folder or the Hugging Face cache, the checkpoint of a
variant, the model class its ``config.json`` names, the checkpoint's tensors (every header
validated), and a head start reading it into the page cache."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Sequence, Union

from .. import _native
from ..errors import DynamicOffloadError

__all__ = ["association", "is_transformers", "loader_of", "local_path", "read_ahead", "variant_checkpoint"]


def association(path: str) -> Dict[str, Any]:
    """The checkpoint at ``path`` (a file, an index or a folder): its files and tensors, every
    header validated."""
    return json.loads(_native.inspect_checkpoint(path))


def read_ahead(settings: Any, files: Sequence[str]) -> Any:
    """Starts reading ``files`` into the page cache when the native route will map them whole
    and the host can hold them (ddo-compose decides); ``None`` otherwise."""
    try:
        return _native.read_ahead(settings.native, list(files))
    except _native.DynamicOffloadCheckpointError:
        # Only a head start: a file it cannot open is opened (and named) by the load itself.
        return None



def variant_checkpoint(folder: str, variant: Optional[str]) -> str:
    """What to open for ``variant`` (``fp16``) of the model in ``folder``, as Diffusers and
    transformers name variant files: its index (``*.safetensors.index.fp16.json``) or its one
    file (``*.fp16.safetensors``). Without a variant, the folder (variant files beside plain ones
    are skipped)."""
    if not variant or not os.path.isdir(folder):
        return folder
    names = sorted(os.listdir(folder))
    indexes = [n for n in names if n.endswith(f".safetensors.index.{variant}.json")]
    files = [n for n in names if n.endswith(f".{variant}.safetensors")]
    if len(indexes) == 1:
        return os.path.join(folder, indexes[0])
    if not indexes and len(files) == 1:
        return os.path.join(folder, files[0])
    raise DynamicOffloadError(
        f"{folder} has no single checkpoint of variant {variant!r} "
        f"(indexes {indexes or 'none'}, files {files or 'none'}); pass another variant= or none"
    )



def local_path(path: Union[str, os.PathLike], revision: Optional[str], cache_dir: Optional[str] = None) -> str:
    """``path`` itself when it exists; else a Hugging Face hub id (``org/name``) resolved in the
    local hub cache (``cache_dir``, else ``HF_HUB_CACHE`` / ``HF_HOME``), without network access."""
    text = os.fspath(path)
    if os.path.exists(text) or text.count("/") != 1 or text.startswith((".", "/", "~")):
        return text
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise DynamicOffloadError(
            f"{text!r} is not a local path, and resolving it as a hub id needs huggingface_hub (pip install huggingface_hub)"
        ) from None
    try:
        return snapshot_download(text, revision=revision, local_files_only=True, cache_dir=cache_dir)
    except LocalEntryNotFoundError:
        from huggingface_hub.constants import HF_HUB_CACHE

        raise DynamicOffloadError(
            f"{text!r} is neither a local path nor in the Hugging Face cache at {cache_dir or HF_HUB_CACHE}"
            f"{f' (revision {revision})' if revision else ''}; ddo reads the cache only: fetch it first with "
            f"`hf download {text}` (or huggingface_hub.snapshot_download), or pass a local folder"
        ) from None


def loader_of(folder: str) -> Any:
    """The class a model folder's ``config.json`` names: a Diffusers ``_class_name``, else the
    first transformers ``architectures`` entry."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise DynamicOffloadError(
            f"{folder} has no config.json: point at a model folder (or its subfolder=), or pass model_loader="
        ) from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise DynamicOffloadError(f"{path} cannot be read as JSON ({e}); fix the file or pass model_loader=") from None
    if not isinstance(config, dict):
        raise DynamicOffloadError(f"{path} holds {type(config).__name__}, not an object; fix the file or pass model_loader=")
    class_name = config.get("_class_name")
    if class_name is not None:
        import diffusers

        loader = getattr(diffusers, str(class_name), None)
        if not isinstance(loader, type):
            raise DynamicOffloadError(f"{folder}/config.json names class {class_name!r}, which diffusers does not have; pass model_loader=")
        return loader
    architectures = config.get("architectures") or []
    if architectures:
        import transformers

        loader = getattr(transformers, str(architectures[0]), None)
        if loader is None:
            raise DynamicOffloadError(
                f"{folder}/config.json names architecture {architectures[0]!r}, which transformers "
                f"{transformers.__version__} does not have; pass model_loader="
            )
        return loader
    raise DynamicOffloadError(
        f"{folder}/config.json names neither a Diffusers class (_class_name) nor a transformers architecture "
        "(architectures); pass model_loader="
    )


def is_transformers(loader: Any) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(loader, type) and issubclass(loader, PreTrainedModel)
