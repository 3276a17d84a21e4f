"""Exceptions raised by ddo. Every failure is one of these (or a plain ``TypeError`` for a bad
keyword), never a crash of the native extension."""

from __future__ import annotations

__all__ = ["DynamicOffloadError", "DynamicOffloadConfigError"]


class DynamicOffloadError(RuntimeError):
    """A runtime failure: a module that cannot be offloaded, a missing driver, a failed release.
    The module is left as it was unless the message says otherwise."""


class DynamicOffloadConfigError(ValueError):
    """An invalid setting: the message names the setting, the value, where it came from and what is
    allowed."""
