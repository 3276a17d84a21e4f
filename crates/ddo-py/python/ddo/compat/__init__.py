"""The published library's names that exist for hosts switching from it, as it spells them: the
attached hook (:mod:`.hook`), offload state and its summary lines (:mod:`.state`), execution
timing (:mod:`.timing`), the metrics journal (:mod:`.journal`), phase helpers (:mod:`.phases`),
layout inspection (:mod:`.layout`), the setup event and cache helpers (:mod:`.events`), and the
weight-store types ddo refuses with what it does instead (:mod:`.store`).

These modules sit on ddo's core (runtime, settings, metrics) and never import the entry points
(:mod:`ddo.api`), which use them; entry points and results are in :mod:`ddo.api` and
:mod:`ddo.results`, resolved settings in :mod:`ddo.settings`, capacity profiles in
:mod:`ddo.profiles` (a module path the published library has too)."""

from __future__ import annotations

from .events import (
    build_dynamic_offload_event_payload,
    clear_dynamic_offload_pinned_tensor_cache,
    clear_dynamic_offload_plan_cache,
    detect_quantized_backend_modules,
)
from .hook import DynamicOffloadHook
from .journal import DynamicOffloadMetricsJournal
from .layout import DynamicOffloadPlanEntry, inspect_vmm_component, plan_entries
from .phases import (
    add_dynamic_offload_lifecycle_arguments,
    maybe_purge_windows_standby_cache,
    purge_windows_standby_cache,
    purge_windows_standby_cache_event,
    release_native_vmm_idle_cache,
    release_pytorch_host_cache,
)
from .state import DynamicOffloadState, DynamicOffloadUnitState, get_dynamic_offload_state
from .store import VmmWeightLease, VmmWeightStore, VmmWeightStoreStats
from .timing import DynamicOffloadExecutionTimer

__all__ = [
    "DynamicOffloadExecutionTimer",
    "DynamicOffloadHook",
    "DynamicOffloadMetricsJournal",
    "DynamicOffloadPlanEntry",
    "DynamicOffloadState",
    "DynamicOffloadUnitState",
    "VmmWeightLease",
    "VmmWeightStore",
    "VmmWeightStoreStats",
    "add_dynamic_offload_lifecycle_arguments",
    "build_dynamic_offload_event_payload",
    "clear_dynamic_offload_pinned_tensor_cache",
    "clear_dynamic_offload_plan_cache",
    "detect_quantized_backend_modules",
    "get_dynamic_offload_state",
    "inspect_vmm_component",
    "maybe_purge_windows_standby_cache",
    "plan_entries",
    "purge_windows_standby_cache",
    "purge_windows_standby_cache_event",
    "release_native_vmm_idle_cache",
    "release_pytorch_host_cache",
]
