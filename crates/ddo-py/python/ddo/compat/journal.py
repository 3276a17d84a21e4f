"""A metrics journal: one JSON file per denoise boundary (``result.metrics_journal(dir)``).

Each file is written whole or not at all: the record goes to a temporary file in the same
folder, is flushed to disk (``fsync``), then published under its name with a hard link, which
fails if the name exists, so a record is never replaced. Writing never waits for the GPU: a
record holds what the host knew at that boundary (``gpu_completion_proven: false``)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any, Callable, Dict, Optional, Union

from .. import _native
from ..metrics import DynamicOffloadMetrics

__all__ = ["DYNAMIC_OFFLOAD_JOURNAL_SCHEMA_VERSION", "DynamicOffloadMetricsJournal", "publish_json_no_replace"]

DYNAMIC_OFFLOAD_JOURNAL_SCHEMA_VERSION = 1


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_json_no_replace(path: Union[str, os.PathLike], data: Any) -> str:
    """Writes ``data`` as JSON at ``path`` durably and only if ``path`` does not exist (an
    existing file raises ``FileExistsError``; nothing is left behind)."""
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, target)
    finally:
        os.unlink(tmp)
    _fsync_directory(directory)
    return target


class DynamicOffloadMetricsJournal:
    """Writes ``before_denoise.json`` and ``step_NNNN.json`` into ``directory``, each
    ``{schema_version, observation: "partial_host_step_boundary", step_index,
    host_elapsed_seconds, gpu_completion_proven: false, completion_collection_requested: false,
    metrics}``. ``host_elapsed_seconds`` counts from the journal's creation. Disabled, it writes
    nothing and every method returns ``None``."""

    def __init__(
        self,
        directory: Union[str, os.PathLike],
        snapshot: Callable[[], DynamicOffloadMetrics],
        *,
        enabled: bool = False,
    ) -> None:
        self.enabled = bool(enabled)
        self.directory = os.fspath(directory)
        self._snapshot = snapshot
        self._started = time.perf_counter()
        if self.enabled:
            if os.path.exists(self.directory) and not os.path.isdir(self.directory):
                raise _native.DynamicOffloadError(
                    f"metrics journal directory {self.directory} is a file: pass a folder (it is created when missing)"
                )
            os.makedirs(self.directory, exist_ok=True)

    def _record(self, name: str, step_index: Optional[int]) -> Optional[str]:
        if not self.enabled:
            return None
        record: Dict[str, Any] = {
            "schema_version": DYNAMIC_OFFLOAD_JOURNAL_SCHEMA_VERSION,
            "observation": "partial_host_step_boundary",
            "step_index": step_index,
            "host_elapsed_seconds": time.perf_counter() - self._started,
            "gpu_completion_proven": False,
            "completion_collection_requested": False,
            "metrics": self._snapshot().as_dict(),
        }
        return publish_json_no_replace(os.path.join(self.directory, name), record)

    def before_denoise(self) -> Optional[str]:
        """Writes ``before_denoise.json``; returns its path."""
        return self._record("before_denoise.json", None)

    def step(self, index: int) -> Optional[str]:
        """Writes ``step_NNNN.json`` for step ``index`` (0 or more); returns its path."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise _native.DynamicOffloadConfigError(f"step index {index!r} must be an int >= 0")
        return self._record(f"step_{index:04d}.json", index)

    # The published names of the two boundaries.
    record_before_denoise = before_denoise
    record_step = step
