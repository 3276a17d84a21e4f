"""Progress bars on long host-side work, drawn with ``tqdm.auto`` as Diffusers draws its own.

A bar advances once per piece of work Python drives (a pipeline component loaded, a component
offloaded, a load stage done); work done inside one native call is one step. Bars are shown
when stderr is a terminal, unless Diffusers' bars are off
(``diffusers.utils.logging.disable_progress_bar()``) or ``DDO_PROGRESS=0``; ``DDO_PROGRESS=1``
shows them anywhere (a log file, CI) and over Diffusers' switch."""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Optional

__all__ = ["progress_enabled", "bar"]

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _diffusers_bars_on() -> bool:
    """Diffusers' switch, read only when the host imported Diffusers' logging (it cannot have
    turned bars off otherwise)."""
    logging = sys.modules.get("diffusers.utils.logging")
    if logging is None:
        return True
    enabled = getattr(logging, "is_progress_bar_enabled", None)
    if enabled is not None:
        return bool(enabled())
    disabled = getattr(logging, "are_progress_bars_disabled", None)
    return not disabled() if disabled is not None else True


def progress_enabled() -> bool:
    """Whether ddo draws progress bars now (``DDO_PROGRESS``, then Diffusers' switch, then
    whether stderr is a terminal). An unrecognized ``DDO_PROGRESS`` value is an error."""
    value = os.environ.get("DDO_PROGRESS", "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    if value:
        from .errors import DynamicOffloadConfigError

        raise DynamicOffloadConfigError(
            f"DDO_PROGRESS = {os.environ['DDO_PROGRESS']!r} (from environment) is not a switch; use 1 (bars "
            "everywhere), 0 (no bars), or unset it (bars when stderr is a terminal)"
        )
    if not _diffusers_bars_on():
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def bar(iterable: Optional[Iterable[Any]] = None, **kwargs: Any) -> Any:
    """A ``tqdm.auto`` bar over ``iterable`` (or with ``total=``) on stderr, disabled when
    :func:`progress_enabled` says so; ``kwargs`` go to tqdm."""
    from tqdm.auto import tqdm

    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, disable=not progress_enabled(), **kwargs)
