"""ddo's logger: ``logging.getLogger("ddo")`` and its children (``ddo.api``), silent by default (a
``NullHandler``), configured by hosts as they configure Diffusers' loggers::

    logging.getLogger("ddo").setLevel(logging.INFO)   # route lines of every component

``verbose`` and ``show_profile`` ask for their lines whatever the host configured: when the
``ddo`` loggers are not enabled for INFO or no handler would receive the record, the line is
written to stderr as it is (what users of those settings always saw)."""

from __future__ import annotations

import logging
import sys

__all__ = ["logger", "get_logger", "info"]

logger = logging.getLogger("ddo")
logger.addHandler(logging.NullHandler())


def get_logger(name: str) -> logging.Logger:
    """The child logger ``name`` of ``ddo`` (``ddo.api`` for the module ``ddo.api``)."""
    return logging.getLogger(name if name == "ddo" or name.startswith("ddo.") else f"ddo.{name}")


def _reaches_a_handler(log: logging.Logger) -> bool:
    """Whether a record of ``log`` would reach a handler that writes somewhere (not a
    ``NullHandler``), through the loggers it propagates to."""
    current: logging.Logger | None = log
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


def info(log: logging.Logger, message: str, *, shown: bool = False) -> None:
    """Logs ``message`` at INFO on ``log``. ``shown`` (a setting such as ``verbose`` asked for
    it): when the host's logging would drop or not deliver the record, it goes to stderr as plain
    text instead."""
    if shown and not (log.isEnabledFor(logging.INFO) and _reaches_a_handler(log)):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, message, (), None))
        return
    log.info(message)
