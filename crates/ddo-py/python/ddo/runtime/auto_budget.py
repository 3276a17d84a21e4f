"""The automatic GPU budget (``auto_budget_policy = balanced``): after each pass the device is
sampled and the rule (``ddo-policy``'s ``AutoBudget``) says whether the arena is planned again
under a new budget. This module samples, applies and warns; the rule decides."""

from __future__ import annotations

import json
import warnings
from typing import Any, Callable, Dict, Optional, Protocol, Tuple

import torch

from .. import _native

__all__ = ["AutoBudget", "BudgetedRuntime", "auto_budget_of", "device_free_bytes"]


class BudgetedRuntime(Protocol):
    """What the automatic budget reads and drives: the execution device, the leases blocks hold
    now, the session, its metrics, and a re-plan under a new budget."""

    device: torch.device
    leases: Dict[Any, Any]
    session: Any

    def metrics(self, phase: Optional[str] = None) -> Dict[str, Any]: ...

    def set_budget(self, total: int) -> bool: ...


def device_free_bytes(device: torch.device) -> int:
    """Free memory of ``device``: the GPU's (the driver's count), or for the host backend the
    host's available memory as the platform's admission probe reads it."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = json.loads(_native.observe_host_memory()).get("mem_available_bytes")
    if available is None:
        raise _native.DynamicOffloadError(
            "the automatic GPU budget sizes the host backend's arena from the host's available memory, which this "
            "kernel does not report (MemAvailable in /proc/meminfo): set auto_budget_policy off and a fixed "
            "vmm_resident_weight_budget_gb"
        )
    return int(available)


class AutoBudget:
    """One component's automatic budget: samples the device after a pass, re-plans the arena
    when the rule says so, and tells the rule how that went."""

    def __init__(self, runtime: BudgetedRuntime, rule: Any, free: Callable[[torch.device], int]) -> None:
        self.runtime = runtime
        self.rule = rule
        # The free-memory sample (replaceable, e.g. to simulate a smaller card).
        self.free = free

    @property
    def headroom(self) -> int:
        """The bytes kept free."""
        return int(self.rule.headroom_bytes)

    def _arena(self) -> Tuple[int, int]:
        """(budget, device bytes the arena holds now)."""
        data = self.runtime.metrics()
        setup, runtime = data.get("setup", {}), data.get("runtime", {})
        held = int(runtime.get("resident_bytes") or 0) + int(runtime.get("slot_bytes") or 0)
        return int(setup.get("gpu_budget_bytes") or 0), held

    def after_pass(self) -> None:
        free = int(self.free(self.runtime.device))
        target = self.rule.after_pass(free, lambda: (*self._arena(), bool(self.runtime.leases)))
        if target is None:
            return
        try:
            changed = self.runtime.set_budget(target)
        except BaseException as e:
            if not isinstance(e, _native.DynamicOffloadError):
                # Interrupted (Ctrl-C): the next pass decides as this one would have.
                self.rule.interrupted()
                raise
            warnings.warn("ddo: " + self.rule.refused(bool(self.runtime.session.is_unloaded()), str(e)), stacklevel=4)
            return
        self.rule.replanned(bool(changed), self._arena()[0])

    def setup(self) -> Dict[str, Any]:
        """The metrics' ``setup.auto_budget``."""
        return dict(json.loads(self.rule.report()))


def auto_budget_of(runtime: BudgetedRuntime, plan: Any) -> Optional[AutoBudget]:
    """The automatic budget ``plan`` asks for, or ``None`` (policy off)."""
    rule = _native.AutoBudget.for_plan(plan)
    return AutoBudget(runtime, rule, device_free_bytes) if rule is not None else None
