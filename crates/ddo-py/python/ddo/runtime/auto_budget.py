"""The automatic GPU budget (``auto_budget_policy = balanced``): the arena's budget follows the
device's free memory, measured after each pass."""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Dict, Mapping, Optional, Protocol, Tuple

import torch

from .. import _native

__all__ = ["AutoBudget", "BudgetedRuntime", "auto_budget_of", "check_auto_budget_route", "device_free_bytes"]


class BudgetedRuntime(Protocol):
    """What the automatic budget reads and drives: the execution device, the leases blocks hold
    now, the session, its metrics, and a re-plan under a new budget."""

    device: torch.device
    leases: Dict[Any, Any]
    session: Any

    def metrics(self, phase: Optional[str] = None) -> Dict[str, Any]: ...

    def set_budget(self, total: int) -> bool: ...

# The headroom when ``auto_vram_headroom_gb`` is 0 (or unset).
_AUTO_HEADROOM_BYTES = 1 << 30
# A larger budget is planned only when it exceeds the current one by more than this share (or
# 256 MiB): rebuilding the arena re-uploads its resident units.
_AUTO_REPLAN_SHARE = 0.05
_AUTO_REPLAN_BYTES = 256 << 20


def device_free_bytes(device: torch.device) -> int:
    """Free memory of ``device``: the GPU's (the driver's count), or the host's available memory
    for the host backend."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_AVPHYS_PAGES"))


class AutoBudget:
    """``auto_budget_policy = balanced``: the arena's budget is the device's free memory plus
    the arena's own, less the headroom, measured after a pass, so the working set PyTorch keeps
    (activations, its cache) is never counted as free. Planned again after the first pass, and
    after any pass that leaves less than half the headroom free (the working set grew)."""

    def __init__(self, runtime: BudgetedRuntime, headroom: int, free: Callable[[torch.device], int]) -> None:
        self.runtime = runtime
        self.headroom = headroom
        self.free = free
        self.passes = 0
        self.replans = 0
        self.free_bytes: Optional[int] = None
        self.budget_bytes: Optional[int] = None
        self.decision: Optional[str] = None
        # The largest budget refused as too small.
        self.refused: Optional[int] = None

    def _arena(self) -> Tuple[int, int]:
        """(budget, device bytes the arena holds now)."""
        data = self.runtime.metrics()
        setup, runtime = data.get("setup", {}), data.get("runtime", {})
        held = int(runtime.get("resident_bytes") or 0) + int(runtime.get("slot_bytes") or 0)
        return int(setup.get("gpu_budget_bytes") or 0), held

    def after_pass(self) -> None:
        self.passes += 1
        free = self.free(self.runtime.device)
        self.free_bytes = free
        if self.passes > 1 and free >= self.headroom // 2:
            return
        budget, held = self._arena()
        target = max(0, free + held - self.headroom)
        self.budget_bytes = budget
        # Shrinking is never skipped (the device is short); growing only pays past a margin.
        if target == budget or 0 < target - budget <= max(_AUTO_REPLAN_BYTES, int(budget * _AUTO_REPLAN_SHARE)):
            self.decision = "kept_close_enough"
            return
        if self.refused is not None and target <= self.refused:
            self.decision = "kept_too_small"
            return
        if self.runtime.leases:
            # A block runs in another thread: planned again after a later pass.
            self.passes -= 1
            self.decision = "kept_blocks_running"
            return
        try:
            changed = self.runtime.set_budget(target)
        except BaseException as e:
            if not isinstance(e, _native.DynamicOffloadError):
                # Interrupted (Ctrl-C): the next pass plans again as this one would have.
                self.passes -= 1
                raise
            # Said once: a later pass tries again only when more memory is free.
            self.refused = target
            self.decision = "kept_too_small"
            if self.runtime.session.is_unloaded():
                self.decision = "unloaded"
                warnings.warn(
                    f"ddo: the automatic GPU budget could plan the arena under neither {target} bytes nor its last "
                    f"budget {budget} ({e}); the component is unloaded: free GPU memory and call reload()",
                    stacklevel=4,
                )
                return
            warnings.warn(
                f"ddo: the automatic GPU budget would be {target / (1 << 30):.2f} GiB ({free / (1 << 30):.2f} GiB free, "
                f"{self.headroom / (1 << 30):.2f} GiB headroom), which the component cannot run in ({e}); it keeps "
                f"{budget / (1 << 30):.2f} GiB. Free GPU memory or lower auto_vram_headroom_gb",
                stacklevel=4,
            )
            return
        if not changed:
            self.decision = "kept_views_held"
            return
        self.replans += 1
        self.refused = None
        self.budget_bytes = self._arena()[0]
        self.decision = "first_pass" if self.passes == 1 else "working_set_grew"

    def setup(self) -> Dict[str, Any]:
        """The metrics' ``setup.auto_budget``."""
        out: Dict[str, Any] = {"policy": "balanced", "headroom_bytes": self.headroom, "replans": self.replans}
        for key in ("budget_bytes", "free_bytes", "decision"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


def check_auto_budget_route(settings: Mapping[str, Any], route: str) -> None:
    """Refuses ``auto_budget_policy = balanced`` on a route other than the native one (before the
    session opens)."""
    if settings.get("auto_budget_policy") == "balanced" and route != "vmm_fast_runtime":
        raise _native.DynamicOffloadConfigError(
            f"auto_budget_policy = balanced sizes the native arena's GPU budget from the card, and this component "
            f"takes route {route}: use backend vmm (the native route), or leave auto_budget_policy off"
        )


def auto_budget_of(runtime: BudgetedRuntime, settings: Mapping[str, Any]) -> Optional[AutoBudget]:
    """The automatic budget the resolved ``settings`` ask for, or ``None``: the headroom is
    ``auto_vram_headroom_gb``, 1 GiB when 0."""
    if settings.get("auto_budget_policy") != "balanced":
        return None
    headroom = int(float(settings.get("auto_vram_headroom_gb") or 0) * (1 << 30)) or _AUTO_HEADROOM_BYTES
    return AutoBudget(runtime, headroom, device_free_bytes)
