"""Exceptions raised by ddo, defined by the native extension. Every failure is one of these (or a
plain ``TypeError`` for a bad keyword), never a crash of the native extension.

- :class:`DynamicOffloadError` (``RuntimeError``): every ddo failure.
  - :class:`DynamicOffloadCheckpointError`: weights missing, corrupt, changed, or not fitting.
    - :class:`DynamicOffloadSourceChangedError`: a checkpoint file (or a host tensor ddo streams
      from) changed while in use; detected before any changed byte is used.
  - :class:`DynamicOffloadLifecycleError`: a call that does not fit the component's state.
  - :class:`DynamicOffloadConfigError` (also a ``ValueError``): an invalid setting, named with
    its value, origin and what is allowed.
    - :class:`DynamicOffloadCapacityError`: a budget too small for the working set.
"""

from __future__ import annotations

from ._native import (
    DynamicOffloadCapacityError,
    DynamicOffloadCheckpointError,
    DynamicOffloadConfigError,
    DynamicOffloadError,
    DynamicOffloadLifecycleError,
    DynamicOffloadSourceChangedError,
)

__all__ = [
    "DynamicOffloadError",
    "DynamicOffloadConfigError",
    "DynamicOffloadCapacityError",
    "DynamicOffloadCheckpointError",
    "DynamicOffloadLifecycleError",
    "DynamicOffloadSourceChangedError",
]
