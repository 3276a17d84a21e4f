"""Backend selection and the standard host CLI flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional

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

    @property
    def requires_native_bootstrap(self) -> bool:
        """Always false: ddo installs no allocator, so no backend needs a fresh process before
        CUDA starts (``ddo_vmm_bootstrap`` exists for hosts that import it, and does nothing)."""
        return False

    def build_config(self, **overrides: Any) -> DynamicOffloadConfig:
        """A config selecting this backend and preset, with ``overrides`` (config field names).
        The backend decides the execution mode: overriding ``execution_mode`` is a ``TypeError``."""
        if "execution_mode" in overrides:
            raise TypeError(
                f"execution_mode is decided by the backend ({self.backend} -> {self.execution_mode}); "
                "resolve another backend or preset instead"
            )
        return DynamicOffloadConfig(backend=self.backend, preset=self.requested_preset).replace(**overrides)

    def build_config_from_args(self, args: argparse.Namespace) -> DynamicOffloadConfig:
        """:func:`build_config_from_args` for this backend and preset."""
        config = build_config_from_args(args)
        return config.replace(backend=self.backend, preset=self.requested_preset)


def resolve_dynamic_offload_backend(
    backend: str = "linear", preset: str = "auto", *, running_on_wsl: Optional[bool] = None
) -> DynamicOffloadBackend:
    """``linear`` takes the linear presets (``auto`` = ``one_shot_fast``); ``vmm`` takes ``auto``
    (= ``vmm_fast``) and ``nvme_baseline``. Anything else raises
    :class:`DynamicOffloadConfigError` naming what is allowed."""
    effective, mode = _native.resolve_backend(backend, preset)
    return DynamicOffloadBackend(backend, preset, effective, mode)


class _Given(argparse.Action):
    """Stores the value and notes that the flag was given, so that flags left at their defaults
    leave the decision to variables and presets."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        given = set(getattr(namespace, "_ddo_given", ()))
        given.add(self.dest)
        setattr(namespace, "_ddo_given", given)


# (flag, config field, type, default, help); type None = a switch.
_FLAGS: tuple = (
    ("--ddo-backend", "backend", str, "linear", "offload backend: linear or vmm"),
    ("--ddo-preset", "preset", str, "auto", "preset; see python -m ddo presets"),
    ("--ddo-vmm-resident-weight-budget-gb", "vmm_resident_weight_budget_gb", float, 4.0, "GPU weight budget of the native arena, GiB"),
    ("--ddo-vmm-total-staging-gb", "vmm_staging_buffer_gb", float, None,
     "total host staging, GiB: half per buffer on the disk route (preset nvme_baseline), the whole read-ahead ring otherwise"),
    ("--ddo-vmm-staging-buffer-gb", "vmm_staging_buffer_gb", float, 0.625,
     "host staging per buffer on the disk route, GiB (the default grows to hold the largest unit)"),
    ("--ddo-vmm-native-transport", "vmm_native_transport", None, False, "registered host transport (always on in ddo)"),
    ("--ddo-vmm-native-source-cache-slot-mb", "vmm_native_source_cache_slot_mb", int, 0,
     "the published micro cache's slot size (use --ddo-vmm-source-cache-gb)"),
    ("--ddo-vmm-native-source-cache-slots", "vmm_native_source_cache_slots", int, 0,
     "the published micro cache's slots (use --ddo-vmm-source-cache-gb)"),
    ("--ddo-vmm-source-cache-gb", "vmm_source_cache_gb", float, 0.0, "retained host storage of the checkpoint source, GiB (0..32)"),
    ("--ddo-vmm-source-registered-gb", "vmm_source_registered_gb", float, 0.0,
     "host registration ceiling, GiB, whole 64 MiB segments, at most the storage (0 = same as storage)"),
    ("--ddo-vmm-component-tensor-ownership", "vmm_component_tensor_ownership", None, False,
     "whole-component ownership (always on in ddo's native route)"),
    ("--ddo-vmm-execution-auxiliary-ownership", "vmm_execution_auxiliary_ownership", None, False,
     "stream non-Linear block parameters too (always on in ddo)"),
    ("--ddo-vmm-component-buffer-limit-mb", "vmm_component_buffer_limit_mb", int, 1,
     "the published component buffer cap, MiB (ddo keeps buffers on the device)"),
    ("--ddo-prefetch-depth", "prefetch_depth", int, None, "units kept in flight ahead of execution"),
    ("--ddo-vmm-weight-encoding", "vmm_weight_encoding", str, None,
     "stream bf16/fp16 weights entropy-coded, decoded on the device: off, auto or on"),
    ("--ddo-vmm-encoded-cache-dir", "vmm_encoded_cache_dir", str, None,
     "folder of encoded files: a later load maps them instead of encoding again"),
    ("--ddo-vmm-peer-store-device", "vmm_peer_store_device", str, None,
     "a GPU (cuda:N) whose memory holds the streamed units, streamed over the peer link"),
    ("--ddo-vmm-peer-store-gb", "vmm_peer_store_gb", float, None, "GiB of the peer GPU the store may take (0 = every streamed unit)"),
)


def add_dynamic_offload_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the published library's flags with its defaults (``--ddo-backend``,
    ``--ddo-preset``, the ``--ddo-vmm-*`` flags, ``--show-profile`` / ``--show-metrics``) and
    ddo's ``--ddo-prefetch-depth``, ``--ddo-vmm-weight-encoding``,
    ``--ddo-vmm-encoded-cache-dir``, ``--ddo-vmm-peer-store-device`` and
    ``--ddo-vmm-peer-store-gb``. Only flags given on the command line reach the config, so
    variables and presets decide the rest."""
    g = parser.add_argument_group("dynamic offload (ddo)")
    for flag, _field, kind, default, text in _FLAGS:
        if kind is None:
            g.add_argument(flag, action=_Given, nargs=0, default=default, help=text)
        elif flag == "--ddo-backend":
            g.add_argument(flag, action=_Given, choices=_native.backends(), default=default, help=text)
        else:
            g.add_argument(flag, action=_Given, type=kind, default=default, help=text)
    g.add_argument("--show-profile", action="store_true", help="print the offload profile after the run")
    g.add_argument("--show-metrics", action="store_true", help="print the offload metrics as JSON after the run")
    return parser


def build_config_from_args(args: argparse.Namespace) -> DynamicOffloadConfig:
    """The config the flags of :func:`add_dynamic_offload_arguments` describe. Only flags given on
    the command line are set, so variables and presets still decide the rest; every value is
    checked now, as the flags' own error."""
    given = set(getattr(args, "_ddo_given", ()))
    values: dict[str, Any] = {}
    flags: dict[str, str] = {}
    for flag, field, _kind, _default, _text in _FLAGS:
        dest = flag[2:].replace("-", "_")
        if dest in given:
            flags[field] = flag
            value = getattr(args, dest)
            if flag == "--ddo-vmm-total-staging-gb":
                # The published split: two slots on the disk route, the whole total otherwise.
                mode = values.get("preset") == "nvme_baseline"
                value = value / 2 if mode else value
            values[field] = value
    if getattr(args, "show_profile", False):
        values["show_profile"] = True
    config = DynamicOffloadConfig(**values)
    from .settings import resolve_settings

    try:
        resolve_settings("model", config=config, use_environment=False)
    except DynamicOffloadConfigError as e:
        # Blame the flags whose setting the message names, else every flag given.
        named = [flag for field, flag in flags.items() if field in str(e)] or list(flags.values())
        raise DynamicOffloadConfigError(f"{e} (set by the flags {', '.join(named)})") from None
    return config
