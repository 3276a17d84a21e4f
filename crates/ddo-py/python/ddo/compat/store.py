"""The published library's legacy weight store (``VmmWeightStore``, its leases and its counters),
which ddo does not provide: ddo's arena owns GPU weight memory, plans it when a component is
offloaded, and leases each block's weights around that block's forward by itself. The types keep
the published constructors, methods and counters, so a host's code imports and type-checks the
same; constructing one, or calling any of its methods, raises
:class:`ddo.DynamicOffloadUnsupportedError` saying what ddo does instead and which call to use."""

from __future__ import annotations

from typing import Any, NoReturn, Optional

from ..errors import DynamicOffloadUnsupportedError

__all__ = ["VmmWeightLease", "VmmWeightStore", "VmmWeightStoreStats"]

_OFFLOAD = (
    "offload the component with enable_offload(module, backend='vmm') or "
    "from_pretrained_with_dynamic_offload(..., apply_dynamic=True)"
)
_COUNTERS = (
    "read the arena's counters from result.hook.vmm_runtime_stats() or "
    "result.metrics_snapshot().as_dict()['runtime']"
)


def _refuse(name: str, instead: str) -> NoReturn:
    raise DynamicOffloadUnsupportedError(f"{name} is not part of ddo: {instead}")


class VmmWeightStore:
    """The published store of CPU tensors mapped into CUDA VMM slots by key. Not part of ddo:
    ddo's arena reserves, uploads, leases and evicts a component's weights by itself. Every
    member raises :class:`ddo.DynamicOffloadUnsupportedError` with the ddo call to use."""

    def __init__(self, device_id: int = 0, max_resident_bytes: int = 0) -> None:
        _refuse(
            "VmmWeightStore",
            "ddo's arena owns GPU weight memory under the component's GPU budget "
            f"(vmm_resident_weight_budget_gb); {_OFFLOAD}",
        )

    @property
    def stats(self) -> "VmmWeightStoreStats":
        """Refused: the arena's counters are in ``result.hook.vmm_runtime_stats()``."""
        _refuse("VmmWeightStore.stats", _COUNTERS)

    def reserve(self, key: str, size_bytes: int) -> NoReturn:
        """Refused: ddo reserves a component's device range when it is offloaded."""
        _refuse(
            "VmmWeightStore.reserve()",
            f"ddo reserves each component's device address range, sized by its plan, when it attaches; {_OFFLOAD}",
        )

    def acquire(self, key: str, source: Any, *, stream: Optional[Any] = None) -> NoReturn:
        """Refused: ddo does not copy arbitrary CPU tensors into a store by key."""
        _refuse(
            "VmmWeightStore.acquire()",
            "ddo does not copy an arbitrary CPU tensor into a store by key: it uploads each block's weights (from "
            "the checkpoint, or the module's own host tensors) before the block runs and holds that lease until "
            f"the block's forward ends; {_OFFLOAD}",
        )

    def release(self, key: str) -> NoReturn:
        """Refused: each block's lease is given back by that block's own post-forward hook."""
        _refuse(
            "VmmWeightStore.release()",
            "ddo gives each block's lease back when the block's forward ends, fenced on the stream that used it; "
            f"{_OFFLOAD}",
        )

    def evict(self, key: str) -> NoReturn:
        """Refused: ddo evicts whole blocks under the budget; ``result.unload()`` frees a component."""
        _refuse(
            "VmmWeightStore.evict()",
            "ddo evicts whole blocks under the GPU budget by itself; to free a component's device memory call "
            "result.unload() (result.reload() before its next forward), or result.reclaim() for idle execution "
            "slots, on the result of enable_offload",
        )

    def close(self) -> NoReturn:
        """Refused: an offload is closed with ``remove_dynamic_offload(module)``."""
        _refuse(
            "VmmWeightStore.close()",
            "close an offload with remove_dynamic_offload(module) or result.remove() on the result of enable_offload",
        )


class VmmWeightLease:
    """The published store's lease (a context yielding the CUDA view). Not part of ddo: ddo
    leases a block's weights around its forward by itself."""

    def __init__(self, store: Any = None, slot: Any = None, tensor: Any = None) -> None:
        _refuse(
            "VmmWeightLease",
            f"ddo leases a block's weights around its forward by itself; offload with enable_offload. {_COUNTERS}",
        )


class VmmWeightStoreStats:
    """The published store's aggregate counters. Not part of ddo as a type: the same figures are
    keys of ``result.hook.vmm_runtime_stats()`` (``copied_bytes``, ``evictions``,
    ``resident_bytes``; ``reserved_bytes`` and ``materializations`` are ``None`` there, as ddo's
    arena measures neither)."""

    def __init__(
        self,
        reserved_bytes: int = 0,
        resident_bytes: int = 0,
        materializations: int = 0,
        evictions: int = 0,
        copied_bytes: int = 0,
    ) -> None:
        _refuse("VmmWeightStoreStats", _COUNTERS)

    @property
    def reserved_bytes(self) -> NoReturn:
        """Refused: ``vmm_runtime_stats()["reserved_bytes"]`` (``None``: ddo reserves no address space per key)."""
        _refuse("VmmWeightStoreStats.reserved_bytes", _COUNTERS)

    @property
    def resident_bytes(self) -> NoReturn:
        """Refused: ``vmm_runtime_stats()["resident_bytes"]``."""
        _refuse("VmmWeightStoreStats.resident_bytes", _COUNTERS)

    @property
    def materializations(self) -> NoReturn:
        """Refused: ddo counts unit uploads, ``vmm_runtime_stats()["uploads"]``."""
        _refuse("VmmWeightStoreStats.materializations", _COUNTERS)

    @property
    def evictions(self) -> NoReturn:
        """Refused: ``vmm_runtime_stats()["evictions"]``."""
        _refuse("VmmWeightStoreStats.evictions", _COUNTERS)

    @property
    def copied_bytes(self) -> NoReturn:
        """Refused: ``vmm_runtime_stats()["copied_bytes"]`` (the arena's ``upload_bytes``)."""
        _refuse("VmmWeightStoreStats.copied_bytes", _COUNTERS)
