"""Exceptions raised by ddo, defined by the native extension (the one refusal raised only from
Python, :class:`DynamicOffloadUnsupportedError`, is defined here). Every failure is one of these
(or a plain ``TypeError`` for a bad keyword), never a crash of the native extension.

- :class:`DynamicOffloadError` (``RuntimeError``): every ddo failure.
  - :class:`DynamicOffloadCheckpointError`: weights missing, corrupt, changed, or not fitting.
    - :class:`DynamicOffloadSourceChangedError`: a checkpoint file (or a host tensor ddo streams
      from) changed while in use; detected before any changed byte is used.
  - :class:`DynamicOffloadLifecycleError`: a call that does not fit the component's state.
  - :class:`DynamicOffloadConfigError` (also a ``ValueError``): an invalid setting, named with
    its value, origin and what is allowed.
    - :class:`DynamicOffloadCapacityError`: a budget too small for the working set.
  - :class:`DynamicOffloadUnsupportedError`: a published name or call ddo does not provide; the
    message says what ddo does instead and which call to use.
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
    "DynamicOffloadUnsupportedError",
    "DynamicOffloadConfigError",
    "DynamicOffloadCapacityError",
    "DynamicOffloadCheckpointError",
    "DynamicOffloadLifecycleError",
    "DynamicOffloadSourceChangedError",
]


class DynamicOffloadUnsupportedError(DynamicOffloadError):
    """A name or call of the published library that ddo's design does not provide (the legacy
    weight store, building the hook by hand). The message says what ddo does instead and which
    ddo call to use; nothing was changed."""
