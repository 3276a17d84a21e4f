"""The published library's weight-store types, which ddo does not provide: ddo's arena owns GPU
weight memory and leases blocks by itself. Constructing one raises with what ddo does instead."""

from __future__ import annotations

import inspect
from typing import Any, Sequence

from ..errors import DynamicOffloadError

__all__ = ["VmmWeightLease", "VmmWeightStore", "VmmWeightStoreStats"]


def _refused(name: str, instead: str, parameters: Sequence[str] = ()) -> type:
    """A published type ddo does not provide: constructing it raises with ``instead``. Its
    signature names the published constructor's ``parameters``."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise DynamicOffloadError(f"{name} is not part of ddo: {instead}")

    signature = inspect.Signature(
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None) for p in parameters]
    )
    return type(
        name,
        (),
        {"__init__": __init__, "__doc__": f"Not part of ddo: {instead}.", "__module__": __name__, "__signature__": signature},
    )


VmmWeightStore = _refused(
    "VmmWeightStore",
    "ddo's arena owns GPU weight memory; offload a component with enable_offload(module, backend='vmm') or "
    "from_pretrained_with_dynamic_offload(..., apply_dynamic=True)",
    ("device_id", "max_resident_bytes"),
)
VmmWeightLease = _refused(
    "VmmWeightLease", "ddo leases a block's weights around its forward by itself; offload with enable_offload"
)
VmmWeightStoreStats = _refused(
    "VmmWeightStoreStats",
    "read the arena's counters from result.metrics_snapshot().as_dict()['runtime'] or result.hook.vmm_runtime_stats()",
    ("reserved_bytes", "resident_bytes", "materializations", "evictions", "copied_bytes"),
)
