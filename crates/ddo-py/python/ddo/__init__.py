"""ddo: run Diffusers models larger than the GPU.

Weights stay in host memory (or on disk) and are streamed to the GPU just before each block runs,
overlapping the copies with computation. The model's math never changes: outputs equal the
resident run's bit for bit. A host switches from diffusers-dynamic-offloader by changing its
import::

    import ddo
    result = ddo.enable_offload(pipe.transformer, component="transformer", preset="auto")
    ...
    print(result.metrics_snapshot().format_profile())

Configuration resolution, unit discovery, planning, the arena, metrics and checkpoint validation
run in the native extension (``ddo._native``, one component session per offloaded module); this
package is glue: PyTorch hooks, DLPack views, streams and exceptions.
"""

from __future__ import annotations

from . import _native
from .api import (
    apply_dynamic_offload,
    enable_diffusers_group_offload,
    enable_dynamic_offload,
    enable_offload,
    enable_pipeline_offload,
    from_pretrained_with_dynamic_offload,
    inspect_host_memory,
    remove_dynamic_offload,
)
from .backend import (
    DynamicOffloadBackend,
    add_dynamic_offload_arguments,
    build_config_from_args,
    resolve_dynamic_offload_backend,
)
from .config import ComponentPolicy, DynamicOffloadConfig
from .errors import (
    DynamicOffloadCapacityError,
    DynamicOffloadCheckpointError,
    DynamicOffloadConfigError,
    DynamicOffloadError,
    DynamicOffloadLifecycleError,
    DynamicOffloadSourceChangedError,
    DynamicOffloadUnsupportedError,
)
from .metrics import DYNAMIC_OFFLOAD_METRICS_SCHEMA_VERSION, DynamicOffloadMetrics
from .settings import (
    DDO_PRESETS,
    DynamicOffloadSettings,
    dynamic_offload_env_value,
    dynamic_offload_preset_env_value,
    format_dynamic_offload_presets,
    get_available_system_ram_gb,
    get_dynamic_offload_presets,
    is_wsl_environment,
    load_dynamic_offload_settings_from_env,
    resolve_dynamic_offload_preset,
)
from .generation import GenerationPlan, Offloaded, load, offload, plan
from .loaders.pipeline import DynamicOffloadPipelineResult, from_pretrained_pipeline_with_dynamic_offload
from .results import DiffusersGroupOffloadResult, DynamicOffloadApplyResult, DynamicOffloadLoadResult
from .runtime import StreamedWeight, find_execution_units

# The published library's names: the hook, phase helpers, timing, the metrics journal, offload
# state, layout inspection, events and the refused store types.
from .compat import (
    DynamicOffloadExecutionTimer,
    DynamicOffloadHook,
    DynamicOffloadMetricsJournal,
    DynamicOffloadPlanEntry,
    DynamicOffloadState,
    DynamicOffloadUnitState,
    VmmWeightLease,
    VmmWeightStore,
    VmmWeightStoreStats,
    add_dynamic_offload_lifecycle_arguments,
    build_dynamic_offload_event_payload,
    clear_dynamic_offload_pinned_tensor_cache,
    clear_dynamic_offload_plan_cache,
    detect_quantized_backend_modules,
    get_dynamic_offload_state,
    inspect_vmm_component,
    maybe_purge_windows_standby_cache,
    purge_windows_standby_cache,
    purge_windows_standby_cache_event,
    release_native_vmm_idle_cache,
    release_pytorch_host_cache,
)

# Capacity profiles.
from .profiles import (
    DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION,
    DynamicOffloadProfileSession,
    dynamic_offload_profile_key,
    dynamic_offload_profile_path,
    get_dynamic_offload_profile_capacity,
    get_dynamic_offload_profile_dir,
    get_dynamic_offload_profile_recommendation,
    load_dynamic_offload_profile,
    normalize_dynamic_offload_profile_context,
    record_dynamic_offload_profile,
)


__version__ = _native.version()

__all__ = [
    # ddo's one call: a whole generation planned for this machine.
    "GenerationPlan",
    "Offloaded",
    "load",
    "offload",
    "plan",
    "DDO_PRESETS",
    "DiffusersGroupOffloadResult",
    "DynamicOffloadHook",
    "DynamicOffloadPlanEntry",
    "VmmWeightLease",
    "VmmWeightStore",
    "VmmWeightStoreStats",
    "apply_dynamic_offload",
    "build_dynamic_offload_event_payload",
    "clear_dynamic_offload_pinned_tensor_cache",
    "clear_dynamic_offload_plan_cache",
    "detect_quantized_backend_modules",
    "dynamic_offload_env_value",
    "dynamic_offload_preset_env_value",
    "enable_dynamic_offload",
    "get_available_system_ram_gb",
    "inspect_vmm_component",
    "resolve_dynamic_offload_preset",
    "ComponentPolicy",
    "DYNAMIC_OFFLOAD_METRICS_SCHEMA_VERSION",
    "DynamicOffloadApplyResult",
    "DynamicOffloadPipelineResult",
    "DynamicOffloadBackend",
    "DynamicOffloadCapacityError",
    "DynamicOffloadCheckpointError",
    "DynamicOffloadConfig",
    "DynamicOffloadConfigError",
    "DynamicOffloadError",
    "DynamicOffloadLifecycleError",
    "DynamicOffloadSourceChangedError",
    "DynamicOffloadUnsupportedError",
    "DynamicOffloadLoadResult",
    "DynamicOffloadMetrics",
    "DynamicOffloadSettings",
    "add_dynamic_offload_arguments",
    "build_config_from_args",
    "enable_diffusers_group_offload",
    "enable_offload",
    "enable_pipeline_offload",
    "find_execution_units",
    "format_dynamic_offload_presets",
    "from_pretrained_pipeline_with_dynamic_offload",
    "from_pretrained_with_dynamic_offload",
    "get_dynamic_offload_presets",
    "inspect_host_memory",
    "is_wsl_environment",
    "load_dynamic_offload_settings_from_env",
    "remove_dynamic_offload",
    "resolve_dynamic_offload_backend",
    "StreamedWeight",
]
# The lifecycle helpers: phase helpers, timing, the metrics journal, offload state and capacity profiles.
__all__ += [
    "DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION",
    "DynamicOffloadExecutionTimer",
    "DynamicOffloadMetricsJournal",
    "DynamicOffloadProfileSession",
    "DynamicOffloadState",
    "DynamicOffloadUnitState",
    "add_dynamic_offload_lifecycle_arguments",
    "dynamic_offload_profile_key",
    "dynamic_offload_profile_path",
    "get_dynamic_offload_profile_capacity",
    "get_dynamic_offload_profile_dir",
    "get_dynamic_offload_profile_recommendation",
    "get_dynamic_offload_state",
    "load_dynamic_offload_profile",
    "maybe_purge_windows_standby_cache",
    "normalize_dynamic_offload_profile_context",
    "purge_windows_standby_cache",
    "purge_windows_standby_cache_event",
    "record_dynamic_offload_profile",
    "release_native_vmm_idle_cache",
    "release_pytorch_host_cache",
]
