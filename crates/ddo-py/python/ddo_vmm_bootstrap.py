"""Process bootstrap a host imports before CUDA starts, kept so hosts switch libraries by import.

The published library re-executes the host in a fresh process to install its native PyTorch
allocator before CUDA initializes. ddo needs neither: its native route allocates the weight
arena's device memory itself through the CUDA driver, beside PyTorch's own allocator, in the
process as it is. :func:`ensure_vmm_fast_process` therefore returns at once, never re-executes
and never touches CUDA. This module imports nothing heavy (no torch)."""

from __future__ import annotations

import os
import sys
from typing import List, Mapping, Optional, Sequence, Union

__all__ = ["ensure_vmm_fast_process", "vmm_fast_requested"]


def _option(argv: Sequence[str], name: str) -> Optional[str]:
    """The last value of ``--name value`` or ``--name=value`` before a ``--``."""
    value: Optional[str] = None
    args: List[str] = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            break
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
            i += 2
            continue
        if arg.startswith(name + "="):
            value = arg[len(name) + 1 :]
        i += 1
    return value


def vmm_fast_requested(argv: Optional[Sequence[str]] = None, *, default_backend: str = "linear") -> bool:
    """Whether the command line selects the native fast route: ``--ddo-backend vmm`` (else
    ``default_backend``) with ``--ddo-preset auto`` (the default preset), in either the
    ``--x v`` or the ``--x=v`` form. ``argv`` defaults to ``sys.argv[1:]``."""
    args = sys.argv[1:] if argv is None else argv
    backend = (_option(args, "--ddo-backend") or default_backend).strip().lower()
    preset = (_option(args, "--ddo-preset") or "auto").strip().lower()
    return backend == "vmm" and preset == "auto"


def ensure_vmm_fast_process(
    *,
    library_path: Union[str, os.PathLike, None] = None,
    allocator_cache_mib: int = 512,
    argv: Optional[Sequence[str]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> None:
    """Returns without re-executing: ddo installs no PyTorch allocator, so the process needs no
    fresh start and no allocator library (``library_path`` and ``allocator_cache_mib`` have
    nothing to configure; they are checked so a wrong value is still reported)."""
    del argv, environ  # what a re-execution would pass on
    if library_path is not None and not isinstance(library_path, (str, os.PathLike)):
        raise TypeError(f"library_path is a path string or None, not {type(library_path).__name__}")
    if isinstance(allocator_cache_mib, bool) or not isinstance(allocator_cache_mib, int) or allocator_cache_mib < 0:
        raise ValueError(f"allocator_cache_mib = {allocator_cache_mib!r} must be an int >= 0 (MiB)")
