"""Backend selection and the standard host CLI flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from . import _native
from .config import DynamicOffloadConfig
from .errors import DynamicOffloadConfigError

__all__ = [
    "DynamicOffloadBackend",
    "resolve_dynamic_offload_backend",
    "add_dynamic_offload_arguments",
    "build_config_from_args",
]


@dataclass(frozen=True)
class DynamicOffloadBackend:
    """A backend and preset pair, resolved."""

    backend: str
    requested_preset: str
    effective_preset: str
    execution_mode: str

    def build_config(self, **overrides: Any) -> DynamicOffloadConfig:
        """A config selecting this backend and preset, with ``overrides`` (config field names)."""
        return DynamicOffloadConfig(backend=self.backend, preset=self.requested_preset).replace(**overrides)


def resolve_dynamic_offload_backend(backend: str = "linear", preset: str = "auto") -> DynamicOffloadBackend:
    """``linear`` takes the linear presets (``auto`` = ``one_shot_fast``); ``vmm`` takes ``auto``
    (= ``vmm_fast``) and ``nvme_baseline``. Anything else raises
    :class:`DynamicOffloadConfigError` naming what is allowed."""
    effective, mode = _native.resolve_backend(backend, preset)
    return DynamicOffloadBackend(backend, preset, effective, mode)


def add_dynamic_offload_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds ``--ddo-backend``, ``--ddo-preset``, the native budget flags and
    ``--show-profile`` / ``--show-metrics``."""
    g = parser.add_argument_group("dynamic offload (ddo)")
    g.add_argument("--ddo-backend", choices=_native.backends(), default=None, help="offload backend (default linear)")
    g.add_argument("--ddo-preset", default=None, help="preset (default auto); see python -m ddo presets")
    g.add_argument("--ddo-vmm-resident-weight-budget-gb", type=float, default=None, help="GPU weight budget of the native arena, GiB")
    g.add_argument("--ddo-vmm-source-cache-gb", type=float, default=None, help="retained host storage of the checkpoint source, GiB (0..32)")
    g.add_argument(
        "--ddo-vmm-source-registered-gb",
        type=float,
        default=None,
        help="host registration ceiling, GiB, whole 64 MiB segments, at most the storage (0 = same as storage)",
    )
    g.add_argument("--ddo-prefetch-depth", type=int, default=None, help="units kept in flight ahead of execution")
    g.add_argument("--show-profile", action="store_true", help="print the offload profile after the run")
    g.add_argument("--show-metrics", action="store_true", help="print the offload metrics as JSON after the run")
    return parser


def build_config_from_args(args: argparse.Namespace) -> DynamicOffloadConfig:
    """The config the flags of :func:`add_dynamic_offload_arguments` describe. Only flags given on
    the command line are set, so variables and presets still decide the rest."""
    values: dict[str, Any] = {
        "backend": getattr(args, "ddo_backend", None),
        "preset": getattr(args, "ddo_preset", None),
        "vmm_resident_weight_budget_gb": getattr(args, "ddo_vmm_resident_weight_budget_gb", None),
        "vmm_source_cache_gb": getattr(args, "ddo_vmm_source_cache_gb", None),
        "vmm_source_registered_gb": getattr(args, "ddo_vmm_source_registered_gb", None),
        "prefetch_depth": getattr(args, "ddo_prefetch_depth", None),
    }
    if getattr(args, "show_profile", False):
        values["show_profile"] = True
    config = DynamicOffloadConfig(**{k: v for k, v in values.items() if v is not None})
    # Every value and range is checked now, as the flags' own error, not at the first offload.
    from .settings import resolve_settings

    try:
        resolve_settings("model", config=config, use_environment=False)
    except DynamicOffloadConfigError as e:
        flags = ", ".join(f"--ddo-{k.replace('_', '-')}" for k in config.as_dict())
        raise DynamicOffloadConfigError(f"{e} (set by the flags {flags})") from None
    return config
