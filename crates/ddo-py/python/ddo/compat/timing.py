"""Execution timing around a denoise loop (``result.execution_timer()``).

On CUDA the clock is a CUDA event on PyTorch's current stream at each boundary: the times cover
the compute stream's work, waits for ddo's uploads included, and reading them never blocks unless
``snapshot(wait=True)``. On the host backend the compute runs on the calling thread, so the clock
is ``time.perf_counter`` and a snapshot is complete as soon as the timer finished."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional, Union

import torch

from .. import _native
from ..metrics import DynamicOffloadMetrics

__all__ = ["DYNAMIC_OFFLOAD_TIMING_SCHEMA_VERSION", "DynamicOffloadExecutionTimer", "execution_timer"]

DYNAMIC_OFFLOAD_TIMING_SCHEMA_VERSION = 1

_NATIVE_UNITS_REFUSED = (
    "{what} asks for per-unit upload and compute windows, and ddo records no CUDA events around each unit, so it has "
    "none to report: leave it unset. ddo offers the timer's phase, step and tail times on the compute stream, and per "
    "component in metrics_snapshot().as_dict()['runtime']: upload_seconds (host time enqueuing uploads), "
    "wait_seconds (time compute waited for uploads), prefetch_hits / prefetch_misses"
)


def _flag(name: str, value: Any) -> bool:
    """A switch given as a bool (or 0 / 1); anything else is refused rather than read as true."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise _native.DynamicOffloadConfigError(f"{name} is True or False, not {value!r:.80}")


class DynamicOffloadExecutionTimer:
    """Times one run: the whole phase, each step between :meth:`mark_step` calls and the tail
    after the last one. Single use: enter it once (``with result.execution_timer(enabled=True) as
    t:``), call ``t.mark_step()`` at the end of every denoise step, read :meth:`snapshot` after.

    ``device`` is where the run's work is timed: a CUDA device (``"cuda"``, the published
    default: CUDA events on its current stream) or ``"cpu"`` (``None`` too: the host clock).
    ``diagnostic_step_wait`` makes every mark wait on the host until the step's work completed
    and records that wait; it changes the run's overlap, so the snapshot says
    ``benchmark_eligible: false``."""

    def __init__(
        self,
        enabled: bool = False,
        device: Union[str, torch.device, None] = "cuda",
        native_factory: Any = None,
        diagnostic_step_wait: bool = False,
    ) -> None:
        if native_factory is not None and native_factory is not False:
            raise _native.DynamicOffloadConfigError(_NATIVE_UNITS_REFUSED.format(what="native_factory"))
        self.enabled = _flag("enabled", enabled)
        try:
            self.device = torch.device(device) if device is not None else torch.device("cpu")
        except (RuntimeError, TypeError) as e:
            raise _native.DynamicOffloadConfigError(
                f"the execution timer's device {device!r} is not a device ({e}): pass 'cuda', 'cuda:N' or 'cpu'"
            ) from None
        if self.device.type not in ("cuda", "cpu"):
            raise _native.DynamicOffloadConfigError(
                f"the execution timer times CUDA streams or the host thread, not {self.device}: pass 'cuda:N' or 'cpu'"
            )
        if self.enabled and self.device.type == "cuda" and not torch.cuda.is_available():
            raise _native.DynamicOffloadConfigError(
                f"the execution timer uses CUDA events on {self.device}, and PyTorch sees no CUDA device: pass "
                "device='cpu' to time the host thread"
            )
        if self.device.type == "cuda" and self.device.index is None and self.enabled:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.diagnostic_step_wait = _flag("diagnostic_step_wait", diagnostic_step_wait)
        self._cuda = self.device.type == "cuda"
        self._state = "idle"
        self._failed = False
        self._stream: Optional[int] = None
        # One entry per boundary: start, every mark, end (CUDA events or perf_counter seconds).
        self._marks: List[Any] = []
        self._wait_calls = 0
        self._wait_seconds = 0.0

    # ---- recording ------------------------------------------------------------------------

    def _record(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self) -> "DynamicOffloadExecutionTimer":
        """Records the start (what entering the ``with`` block does)."""
        if not self.enabled:
            return self
        if self._state != "idle":
            raise _native.DynamicOffloadLifecycleError(
                "an execution timer times one run and was already started: create a new one with "
                "result.execution_timer(enabled=True)"
            )
        if self._cuda:
            if not torch.cuda.is_available():
                raise _native.DynamicOffloadError(
                    f"the execution timer uses CUDA events on {self.device}, and PyTorch sees no CUDA device"
                )
            self._stream = int(torch.cuda.current_stream(self.device).cuda_stream)
        self._marks = [self._record()]
        self._state = "running"
        return self

    def mark_step(self) -> None:
        """Ends one step (call it after each denoise step)."""
        if not self.enabled:
            return
        if self._state != "running":
            raise _native.DynamicOffloadLifecycleError(
                f"mark_step() needs a running timer (it is {self._state}): call it inside the timer's with block"
            )
        mark = self._record()
        self._marks.append(mark)
        if self.diagnostic_step_wait:
            t = time.perf_counter()
            if self._cuda:
                mark.synchronize()
            self._wait_seconds += time.perf_counter() - t
            self._wait_calls += 1

    def finish(self, *, failed: bool = False) -> None:
        """Records the end (what leaving the ``with`` block does); ``failed`` when the run raised."""
        if not self.enabled or self._state != "running":
            return
        self._marks.append(self._record())
        self._failed = failed
        self._state = "finished"

    def __enter__(self) -> "DynamicOffloadExecutionTimer":
        return self.start()

    def __exit__(self, exc_type: Any, _exc: Any, _tb: Any) -> None:
        self.finish(failed=exc_type is not None)

    # ---- reading --------------------------------------------------------------------------

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000.0 if self._cuda else b - a

    def snapshot(self, *, wait: bool = False) -> Dict[str, Any]:
        """The published timing snapshot (schema version 1). ``status``: ``disabled``,
        ``not_finished`` (still running, or never started), ``pending`` (the GPU has not reached
        the end yet; ``wait=True`` waits for it) or ``complete``. Times are seconds;
        ``steady_state_seconds_per_step`` is the mean of the steps after the first."""
        out: Dict[str, Any] = {
            "schema_version": DYNAMIC_OFFLOAD_TIMING_SCHEMA_VERSION,
            "clock": "cuda_event" if self._cuda else "host_perf_counter",
            "unit": "seconds",
            "scope": "compute_stream_with_dependencies" if self._cuda else "host_thread",
            "failed": self._failed,
            "status": "disabled",
            "stream": self._stream,
            "phase_seconds": None,
            "step_seconds": [],
            "tail_seconds": None,
            "steady_state_seconds_per_step": None,
            "step_count": 0,
            "diagnostic_step_wait": {
                "enabled": self.diagnostic_step_wait,
                "scope": "host_wait_for_step_completion",
                "calls": self._wait_calls,
                "host_seconds": self._wait_seconds,
                "benchmark_eligible": False,
            },
        }
        if not self.enabled:
            return out
        out["step_count"] = max(0, len(self._marks) - (2 if self._state == "finished" else 1))
        if self._state != "finished":
            out["status"] = "not_finished"
            return out
        if self._cuda:
            end = self._marks[-1]
            if wait:
                end.synchronize()
            # Marks may sit on different streams (a host switching streams): every one must be done.
            if not all(m.query() for m in self._marks):
                out["status"] = "pending"
                return out
        marks = self._marks
        steps = [self._seconds(marks[i], marks[i + 1]) for i in range(len(marks) - 2)]
        out.update(
            status="complete",
            phase_seconds=self._seconds(marks[0], marks[-1]),
            step_seconds=steps,
            tail_seconds=self._seconds(marks[-2], marks[-1]),
            steady_state_seconds_per_step=sum(steps[1:]) / (len(steps) - 1) if len(steps) > 1 else None,
        )
        return out

    def attach(self, report: DynamicOffloadMetrics, *, wait: bool = False) -> DynamicOffloadMetrics:
        """``report`` (a metrics snapshot) with this timer's snapshot under
        ``runtime.execution_timing``."""
        if not isinstance(report, DynamicOffloadMetrics):
            raise TypeError(f"attach() takes a DynamicOffloadMetrics (result.metrics_snapshot()), not {type(report).__name__}")
        runtime = dict(report.runtime)
        runtime["execution_timing"] = self.snapshot(wait=wait)
        return dataclasses.replace(report, runtime=runtime)


def execution_timer(
    result: Any,
    *,
    enabled: bool = False,
    native_units: bool = False,
    native_capacity: int = 4096,
    diagnostic_step_wait: bool = False,
) -> DynamicOffloadExecutionTimer:
    """A timer on ``result``'s execution device (``result.execution_timer()``).
    ``native_units`` (per-unit upload and compute windows) is refused: ddo records no CUDA events
    around each unit, and would not report windows it did not measure."""
    if isinstance(native_capacity, bool) or not isinstance(native_capacity, int) or not 1 <= native_capacity <= 8192:
        raise _native.DynamicOffloadConfigError(f"native_capacity = {native_capacity!r} must be an int in 1..8192")
    if native_units:
        raise _native.DynamicOffloadConfigError(_NATIVE_UNITS_REFUSED.format(what="native_units = true"))
    return DynamicOffloadExecutionTimer(enabled, result.execution_device, diagnostic_step_wait=diagnostic_step_wait)
