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
    DynamicOffloadApplyResult,
    DynamicOffloadLoadResult,
    enable_diffusers_group_offload,
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
)
from .metrics import DYNAMIC_OFFLOAD_METRICS_SCHEMA_VERSION, DynamicOffloadMetrics
from .settings import (
    DynamicOffloadSettings,
    format_dynamic_offload_presets,
    get_dynamic_offload_presets,
    is_wsl_environment,
    load_dynamic_offload_settings_from_env,
)
from .pipeline import DynamicOffloadPipelineResult, from_pretrained_pipeline_with_dynamic_offload
from .runtime import StreamedWeight, find_execution_units

__version__ = _native.version()

__all__ = [
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
