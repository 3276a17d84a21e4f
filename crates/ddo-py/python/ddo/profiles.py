"""Named capacity profiles: a run measured on the GPU sizes the GPU weight budget of later runs.

With ``profile_name`` and ``build_profile=True``, ``result.profile_run()`` measures the run it
surrounds on CUDA (synchronized before and after): the peak is the largest of the device memory
in use before and after and of the memory outside PyTorch plus PyTorch's peak reservation, and
``free_margin = max(0, total - peak - profile_vram_headroom_gb)`` is what stayed free. The
recommended budget is the run's own budget plus that margin: ``vmm_resident_weight_budget_gb``
on the native route (the whole arena), ``resident_module_budget_gb`` on the linear route (the
resident blocks beside the slots). A later attach with the same ``profile_name``, and no budget
set explicitly (an argument, a config, a variable), takes the recommendation as its budget and
says so in ``setup.capacity_profile``. The file is ``<dir>/<key>.json`` with ``dir`` =
``DDO_PROFILE_DIR`` or ``~/.ddo/profiles`` and ``key`` derived from the profile's context (name,
model class, component, route, execution device); it is replaced atomically and keeps the last
20 observations, the newest one deciding the recommendation. A profile file that cannot be read
or is not valid is never applied: the attach warns and keeps its budget (``status: invalid``).

Hosts keep their own profiles with the same files: ``DynamicOffloadProfileSession(execution_context,
capacity_context)`` loads an exact workload's profile and a workload family's, ``record_success``
records an observation in both, and an observation's ``capacity`` (``{"metric": "tokens",
"value": 4096}`` with ``status`` ``success`` or ``failure``) is merged into the family's
``capacity_limits`` (the largest success and the smallest failure per metric), which
``get_dynamic_offload_profile_capacity(profile, metric)`` reads back."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import reprlib
import os
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple, Union

import torch

from . import _native

__all__ = [
    "DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION",
    "DynamicOffloadProfileSession",
    "dynamic_offload_profile_key",
    "dynamic_offload_profile_path",
    "get_dynamic_offload_profile_capacity",
    "get_dynamic_offload_profile_dir",
    "get_dynamic_offload_profile_recommendation",
    "load_dynamic_offload_profile",
    "normalize_dynamic_offload_profile_context",
    "record_dynamic_offload_profile",
]

DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION = 1
MAX_PROFILE_OBSERVATIONS = 20
_KEY_PREFIX = "ddo-capacity-v1-"
_THREAD_LOCK = threading.Lock()
_GIB = float(1 << 30)

PathLike = Union[str, os.PathLike]


def get_dynamic_offload_profile_dir(profile_dir: Optional[PathLike] = None) -> Path:
    """``profile_dir`` when given, else ``DDO_PROFILE_DIR`` when set, else ``~/.ddo/profiles``."""
    if profile_dir is not None and not isinstance(profile_dir, (str, bytes, os.PathLike)):
        raise _native.DynamicOffloadConfigError(
            f"profile_dir is a folder (str or Path), not {type(profile_dir).__name__} {_shown(profile_dir)}"
        )
    chosen = os.fsdecode(profile_dir) if profile_dir is not None else os.environ.get("DDO_PROFILE_DIR")
    return Path(chosen).expanduser() if chosen else Path.home() / ".ddo" / "profiles"


def normalize_dynamic_offload_profile_context(context: Mapping[str, Any]) -> Dict[str, Any]:
    """The context as canonical JSON data (string keys, sorted); a value JSON cannot carry raises
    ``DynamicOffloadConfigError``."""
    if not isinstance(context, Mapping) or not context:
        raise _native.DynamicOffloadConfigError("a capacity profile context is a non-empty mapping of names to JSON values")
    return _json_data(context, "capacity profile context")


def _number(value: Any) -> Optional[float]:
    """``value`` as a finite float, or ``None`` when it is not a finite real number (a bool, a
    string, an integer too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _shown(value: Any) -> str:
    """A short repr of ``value`` (its type when even that cannot be made)."""
    try:
        return reprlib.repr(value)
    except (ValueError, RecursionError):
        return f"<{type(value).__name__}>"


def _json_data(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value if not isinstance(value, Mapping) else dict(value), sort_keys=True, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as e:
        shown = _shown(value) if not isinstance(e, RecursionError) else type(value).__name__
        raise _native.DynamicOffloadConfigError(
            f"{what} {shown} is not JSON data ({str(e)[:200]}); use strings, finite numbers, booleans, lists and "
            "mappings"
        ) from None


def _canonical(context: Mapping[str, Any]) -> str:
    return json.dumps(normalize_dynamic_offload_profile_context(context), sort_keys=True, separators=(",", ":"))


def dynamic_offload_profile_key(context: Mapping[str, Any]) -> str:
    """``ddo-capacity-v1-`` + the first 24 hex digits of the SHA-256 of the context's canonical
    JSON (sorted keys, no spaces)."""
    return _KEY_PREFIX + hashlib.sha256(_canonical(context).encode("utf-8")).hexdigest()[:24]


def dynamic_offload_profile_path(context: Mapping[str, Any], profile_dir: Optional[PathLike] = None) -> Path:
    """Where the profile of ``context`` is stored (nothing is created)."""
    return get_dynamic_offload_profile_dir(profile_dir) / (dynamic_offload_profile_key(context) + ".json")


def _invalid(path: Path, why: str) -> Exception:
    return _native.DynamicOffloadConfigError(
        f"capacity profile {path} is not valid ({why}): delete it, or build it again with build_profile=True"
    )


def _check(path: Path, data: Any, context: Mapping[str, Any]) -> Dict[str, Any]:
    if not isinstance(data, dict):
        raise _invalid(path, "not a JSON object")
    if data.get("schema_version") != DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION:
        version = data.get("schema_version")
        raise _invalid(path, f"schema_version {version!r}, this ddo reads {DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION}")
    key = data.get("profile_key", data.get("key"))
    if key != dynamic_offload_profile_key(context):
        raise _invalid(path, f"profile_key {key!r} is not this context's")
    if "context" in data and data["context"] != normalize_dynamic_offload_profile_context(context):
        raise _invalid(path, "its context is not this context")
    if not isinstance(data.get("observations", []), list):
        raise _invalid(path, "observations is not a list")
    limits = data.get("capacity_limits")
    if limits is not None and not isinstance(limits, dict):
        raise _invalid(path, "capacity_limits is not a mapping")
    rec = data.get("recommendation")
    if rec is not None and not isinstance(rec, dict):
        raise _invalid(path, "recommendation is not a mapping")
    return data


def _read_profile(context: Mapping[str, Any], profile_dir: Optional[PathLike]) -> Optional[Dict[str, Any]]:
    """The stored profile, ``None`` when there is none; raises ``DynamicOffloadConfigError``
    naming the file when it cannot be read or is not a valid profile of ``context``."""
    path = dynamic_offload_profile_path(context, profile_dir)
    if path.parent.exists() and not path.parent.is_dir():
        raise _native.DynamicOffloadConfigError(
            f"capacity profile folder {path.parent} is a file: set DDO_PROFILE_DIR or profile_dir to a folder"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise _invalid(path, f"cannot be read: {e}") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise _invalid(path, f"not JSON: {e}") from None
    return _check(path, data, context)


def load_dynamic_offload_profile(
    context: Mapping[str, Any], profile_dir: Optional[PathLike] = None
) -> Optional[Dict[str, Any]]:
    """The stored profile of ``context``, or ``None`` when there is none. A file that cannot be
    read or is not a valid profile of this context is ignored with a warning naming it and what
    to do."""
    # A context or profile_dir of the wrong kind is the caller's error, raised.
    normalize_dynamic_offload_profile_context(context)
    get_dynamic_offload_profile_dir(profile_dir)
    try:
        return _read_profile(context, profile_dir)
    except _native.DynamicOffloadConfigError as e:
        warnings.warn(f"ddo: {e}; it is ignored", stacklevel=2)
        return None


def _merge_capacity_limits(limits: Mapping[str, Any], observation: Mapping[str, Any]) -> Dict[str, Any]:
    """``capacity_limits`` with ``observation``'s ``capacity`` ({metric, value}) merged: the
    largest value that succeeded and the smallest that failed, per metric."""
    merged = {k: dict(v) for k, v in limits.items() if isinstance(v, Mapping)}
    capacity = observation.get("capacity")
    status = observation.get("status")
    if not isinstance(capacity, Mapping) or status not in ("success", "failure"):
        return merged
    metric, value = capacity.get("metric"), _number(capacity.get("value"))
    if not isinstance(metric, str) or not metric or value is None:
        return merged
    entry = merged.setdefault(metric, {})
    key, pick = ("max_success", max) if status == "success" else ("min_failure", min)
    # A recorded limit that is not a finite number (a file edited by hand) is replaced.
    recorded = _number(entry.get(key))
    entry[key] = value if recorded is None else pick(value, recorded)
    return merged


def record_dynamic_offload_profile(
    context: Mapping[str, Any],
    observation: Mapping[str, Any],
    profile_dir: Optional[PathLike] = None,
    recommendation: Optional[Mapping[str, Any]] = None,
) -> Path:
    """Appends ``observation`` to the profile of ``context`` (the last 20 are kept), merges its
    ``capacity`` ({"metric": ..., "value": ...} with ``status`` ``success`` or ``failure``) into
    ``capacity_limits`` and, when given, replaces the recommendation. The file is written to a
    temporary file in the same folder, flushed to disk and renamed over the old one, so a reader
    sees the old profile or the new one, never a part. An existing file that is not a valid
    profile is replaced, with a warning. Returns the profile's path."""
    normalized = normalize_dynamic_offload_profile_context(context)
    observation = _json_data(observation, "capacity profile observation")
    if not isinstance(observation, dict):
        raise _native.DynamicOffloadConfigError(f"a capacity profile observation is a mapping, not {observation!r:.100}")
    if recommendation is not None:
        recommendation = _json_data(recommendation, "capacity profile recommendation")
        if not isinstance(recommendation, dict):
            raise _native.DynamicOffloadConfigError(
                f"a capacity profile recommendation is a mapping, not {recommendation!r:.100}"
            )
    path = dynamic_offload_profile_path(normalized, profile_dir)
    directory = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _native.DynamicOffloadConfigError(
            f"capacity profile folder {directory} cannot be created ({e}): set DDO_PROFILE_DIR or profile_dir to a "
            "writable folder"
        ) from None
    if path.is_dir():
        raise _native.DynamicOffloadConfigError(
            f"capacity profile {path} is a folder, not a file: remove it, or set DDO_PROFILE_DIR or profile_dir elsewhere"
        )
    # Records of one context from several threads or processes take turns: none is lost.
    with _locked(directory / f".{path.name}.lock"):
        return _record_locked(path, normalized, observation, recommendation, profile_dir)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with _THREAD_LOCK:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _record_locked(
    path: Path,
    normalized: Dict[str, Any],
    observation: Dict[str, Any],
    recommendation: Optional[Dict[str, Any]],
    profile_dir: Optional[PathLike],
) -> Path:
    directory = path.parent
    prior = load_dynamic_offload_profile(normalized, profile_dir) or {}
    data = {
        "schema_version": DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION,
        "profile_key": dynamic_offload_profile_key(normalized),
        "updated_at": _seconds_now(),
        "context": normalized,
        "capacity_limits": _merge_capacity_limits(prior.get("capacity_limits") or {}, observation),
        "observations": (list(prior.get("observations") or []) + [observation])[-MAX_PROFILE_OBSERVATIONS:],
    }
    if recommendation is not None:
        data["recommendation"] = recommendation
    elif isinstance(prior.get("recommendation"), dict):
        data["recommendation"] = prior["recommendation"]
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        # Readable as any file the user writes (mkstemp makes it private).
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


def get_dynamic_offload_profile_capacity(profile: Mapping[str, Any], metric: str) -> Optional[Dict[str, float]]:
    """The limits recorded for a capacity ``metric`` of a loaded profile (``max_success``,
    ``min_failure``), or ``None``."""
    if not isinstance(metric, str):
        raise _native.DynamicOffloadConfigError(f"a capacity metric is a name (str), not {_shown(metric)}")
    limits = profile.get("capacity_limits") if isinstance(profile, Mapping) else None
    entry = limits.get(metric) if isinstance(limits, Mapping) else None
    if not isinstance(entry, Mapping):
        return None
    out = {}
    for key in ("max_success", "min_failure"):
        value = _number(entry.get(key))
        if value is not None:
            out[key] = value
    return out or None


def get_dynamic_offload_profile_recommendation(profile: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The recommendation stored in a loaded profile, or ``None``."""
    rec = profile.get("recommendation") if isinstance(profile, Mapping) else None
    return dict(rec) if isinstance(rec, Mapping) else None


def profile_context(module: torch.nn.Module, component: str, route: str, device: str, name: str) -> Dict[str, Any]:
    """The context a component's profile is stored under."""
    cls = type(module)
    return {
        "identity_version": 1,
        "name": name,
        "model_class": f"{cls.__module__}.{cls.__qualname__}",
        "component": component,
        "execution_mode": route,
        "execution_device": device,
    }


def recommend_budget_gb(build_budget_gb: float, total: int, peak: int, headroom: int) -> Tuple[float, int]:
    """``(budget GiB, free margin bytes)``: the margin is ``max(0, total - peak - headroom)``
    bytes, the budget the build's budget plus the margin, rounded down to 1/10000 GiB."""
    budget, margin = _native.recommend_budget_gb(float(build_budget_gb), int(total), int(peak), int(headroom))
    return float(budget), int(margin)


def _recommended_budget(recommendation: Mapping[str, Any]) -> Optional[float]:
    """The GiB a recommendation names: ddo's ``budget_gb``, or the published
    ``profile_resident_module_budget_gb`` (``auto_full_pin_resident_budget_gb`` in older files)."""
    for key in ("budget_gb", "profile_resident_module_budget_gb", "auto_full_pin_resident_budget_gb"):
        if key in recommendation:
            value = _number(recommendation[key])
            return value if value is not None and value >= 0 else None
    return None


class DynamicOffloadProfileSession:
    """A host's profile pair: ``execution_context`` names one exact workload (its
    recommendation sizes the budget), ``capacity_context`` a family of workloads (its
    ``capacity_limits`` say which sizes succeeded and failed). Both are loaded at construction."""

    def __init__(
        self,
        execution_context: Mapping[str, Any],
        capacity_context: Optional[Mapping[str, Any]] = None,
        profile_dir: Optional[PathLike] = None,
    ) -> None:
        self.execution_context = normalize_dynamic_offload_profile_context(execution_context)
        self.capacity_context = (
            normalize_dynamic_offload_profile_context(capacity_context) if capacity_context is not None else None
        )
        self.profile_dir = profile_dir
        self.key = dynamic_offload_profile_key(self.execution_context)
        self.path = dynamic_offload_profile_path(self.execution_context, profile_dir)
        self._reload()

    def _reload(self) -> None:
        self.execution_profile = load_dynamic_offload_profile(self.execution_context, self.profile_dir)
        self.capacity_profile = (
            load_dynamic_offload_profile(self.capacity_context, self.profile_dir)
            if self.capacity_context is not None
            else None
        )

    def apply_settings(self, settings: Any, *, allow_recommendation: bool = True) -> Tuple[Any, Optional[Dict[str, Any]]]:
        """``(settings, recommendation)``: ``settings`` with the execution profile's recommended
        budget as its GPU weight budget (``vmm_resident_weight_budget_gb`` on the native route,
        ``resident_module_budget_gb`` on the linear route, and ``profile_resident_module_budget_gb``)
        unless that budget was set explicitly; ``(settings, None)`` when it was."""
        from .settings import DynamicOffloadSettings

        if not isinstance(settings, DynamicOffloadSettings):
            raise _native.DynamicOffloadConfigError(
                f"apply_settings() takes DynamicOffloadSettings (load_dynamic_offload_settings_from_env(), "
                f"result.settings), not {type(settings).__name__}"
            )
        recommendation = get_dynamic_offload_profile_recommendation(self.execution_profile or {})
        if not allow_recommendation or not recommendation:
            return settings, recommendation

        def refused(why: str) -> Tuple[Any, None]:
            warnings.warn(f"ddo: capacity profile {self.path}: {why}; the settings are not changed", stacklevel=3)
            return settings, None

        outcome, setting, budget, why = _profile_outcome(settings, recommendation, keep_resident_budget=True)
        if outcome == "explicit_budget":
            return settings, None
        if outcome == "not_applicable":
            return refused(f"route {settings.route_name} has no GPU weight budget to size")
        if outcome != "apply":
            return refused(str(why))
        try:
            return _resolve_with(settings, {setting: budget, "profile_resident_module_budget_gb": budget}), recommendation
        except _native.DynamicOffloadConfigError as e:
            return refused(f"its {budget} GiB is refused by the settings ({e})")

    @staticmethod
    def recommend_resident_budget(total_vram_gb: float, peak_vram_gb: float, headroom_gb: float) -> float:
        """The published rule: ``max(0, total - peak - headroom)``, rounded to 4 digits."""
        return float(_native.published_resident_budget_gb(float(total_vram_gb), float(peak_vram_gb), float(headroom_gb)))

    def recommendation(self) -> Optional[Dict[str, Any]]:
        """The execution profile's recommendation, or ``None``."""
        return get_dynamic_offload_profile_recommendation(self.execution_profile or {})

    def record_success(
        self, observation: Mapping[str, Any], recommendation: Optional[Mapping[str, Any]] = None
    ) -> Tuple[Path, Optional[Path]]:
        """Records ``observation`` (with ``recommendation``) in the execution profile and in the
        capacity profile; returns both paths (the second ``None`` without a capacity context)."""
        execution_path = record_dynamic_offload_profile(
            self.execution_context, observation, self.profile_dir, recommendation=recommendation
        )
        if self.capacity_context is None:
            capacity_path = None
        elif self.capacity_context == self.execution_context:
            capacity_path = execution_path  # one profile: the observation is recorded once
        else:
            capacity_path = record_dynamic_offload_profile(self.capacity_context, observation, self.profile_dir)
        self._reload()
        return execution_path, capacity_path


def _profile_outcome(
    settings: Any, recommendation: Mapping[str, Any], *, keep_resident_budget: bool = False
) -> Tuple[str, Any, Any, Any]:
    """Whether ``recommendation`` sizes ``settings``' budget, by ddo-policy's capacity-profile rule:
    ``(outcome, setting, budget GiB, why)`` with outcome ``not_applicable``, ``explicit_budget``,
    ``apply``, ``invalid`` or ``device_changed``. ``keep_resident_budget``: a host's own profile
    session, which keeps a resident budget the settings already carry."""
    device = torch.device(settings.device)
    recorded = recommendation.get("setting")
    return tuple(
        _native.capacity_profile_outcome(
            settings.native,
            str(device),
            _device_total_bytes(device),
            keep_resident_budget,
            setting=None if recorded is None else str(recorded),
            budget_gb=_recommended_budget(recommendation),
            recorded_total_bytes=_number(recommendation.get("device_total_bytes")),
        )
    )


def _resolve_with(settings: Any, extra: Dict[str, Any]) -> Any:
    """``settings`` resolved again with ``extra`` as explicit arguments: from the inputs it was
    resolved from, else from its own values."""
    from .settings import resolve_settings

    inputs = dict(getattr(settings, "inputs", None) or {})
    if inputs:
        inputs["arguments"] = {**dict(inputs.get("arguments") or {}), **extra}
        return resolve_settings(settings.component, **inputs)
    return resolve_settings(settings.component, arguments=extra, config=settings.config, use_environment=False)


def apply_capacity_profile(module: torch.nn.Module, settings: Any) -> Tuple[Any, Optional[Dict[str, Any]]]:
    """At attach: the settings to attach with and what the profile did (``None`` without
    ``profile_name``). Statuses: ``applied`` (the budget is the recommendation), ``building``
    (``build_profile``: this run is measured), ``explicit_budget`` (a budget was set, so the
    profile is not applied), ``not_found`` (nothing recorded yet), ``device_changed`` (recorded
    on a GPU of another size), ``not_applicable`` (a route without ddo's arena)."""
    values = settings.values
    name = str(values.get("profile_name") or "")
    build = bool(values.get("build_profile"))
    route = settings.route_name
    if not name:
        if build:
            raise _native.DynamicOffloadConfigError(
                "build_profile = true records a capacity profile under profile_name, which is empty: set profile_name"
            )
        return settings, None
    setting = settings.route_facts.get("budget_setting")
    if setting is None:
        if build:
            raise _native.DynamicOffloadConfigError(
                f"build_profile = true measures ddo's GPU weight budget, and component {settings.component} takes route "
                f"{route}, which has none: use route linear_runtime or vmm_fast_runtime, or leave build_profile off"
            )
        return settings, {"name": name, "status": "not_applicable"}
    device = torch.device(settings.device)
    context = profile_context(module, settings.component, route, str(device), name)
    path = dynamic_offload_profile_path(context)
    info: Dict[str, Any] = {
        "name": name,
        "key": dynamic_offload_profile_key(context),
        "path": str(path),
        "setting": setting,
    }
    if build:
        if device.type != "cuda":
            raise _native.DynamicOffloadConfigError(
                f"build_profile = true measures GPU memory, and component {settings.component} runs on {device}: run "
                "it on a CUDA device to build the profile, or leave build_profile off (profile_name alone applies a "
                "recorded profile)"
            )
        info.update(status="building", budget_gb=float(values[setting]))
        return settings, info

    def not_applied(status: str, why: str) -> Tuple[Any, Dict[str, Any]]:
        warnings.warn(f"ddo: capacity profile {name!r}: {why}; the budget stays {setting} = {values[setting]}", stacklevel=4)
        info.update(status=status, budget_gb=float(values[setting]))
        return settings, info

    try:
        recommendation = get_dynamic_offload_profile_recommendation(_read_profile(context, None) or {})
    except _native.DynamicOffloadConfigError as e:
        return not_applied("invalid", str(e))
    if recommendation is None:
        return not_applied(
            "not_found", f"no recording at {path} (build one with build_profile=True and result.profile_run())"
        )
    outcome, _, budget, why = _profile_outcome(settings, recommendation)
    if outcome == "explicit_budget":
        info.update(status="explicit_budget", budget_gb=float(values[setting]))
        if budget is not None:
            info["recommended_budget_gb"] = budget
        return settings, info
    if outcome != "apply":
        return not_applied(str(outcome), f"{path}: {why}")
    info["recommended_budget_gb"] = budget
    try:
        settings = _resolve_with(settings, {setting: budget, "profile_resident_module_budget_gb": budget})
    except _native.DynamicOffloadConfigError as e:
        return not_applied("invalid", f"{path} recommends {budget} GiB, which the settings refuse ({e})")
    info.update(status="applied", budget_gb=budget)
    return settings, info


def _device_total_bytes(device: torch.device) -> int:
    """The memory of ``device``: the GPU's, or the host's for the host backend."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def _seconds_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@contextlib.contextmanager
def profile_run(result: Any) -> Iterator[None]:
    """Measures the run inside the block and records it (``build_profile``); a null context
    otherwise. Nothing is recorded when the block raises."""
    info = getattr(result, "capacity_profile", None)
    if not info or info.get("status") not in ("building", "recorded"):
        yield
        return
    device = result.execution_device
    values = result.settings.values
    setting = info["setting"]
    context = profile_context(
        result.module, result.settings.component, result.settings.route_name, str(device), info["name"]
    )
    torch.cuda.synchronize(device)
    free_before, total = torch.cuda.mem_get_info(device)
    reserved_before = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    yield
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    free_after, _ = torch.cuda.mem_get_info(device)
    reserved_after = torch.cuda.memory_reserved(device)
    max_reserved = torch.cuda.max_memory_reserved(device)
    # Memory outside PyTorch's allocator (ddo's arena, other processes), before and after.
    external_before = (total - free_before) - reserved_before
    external_after = (total - free_after) - reserved_after
    peak = max(total - free_before, total - free_after, external_before + max_reserved, external_after + max_reserved)
    headroom = int(float(values["profile_vram_headroom_gb"]) * _GIB)
    build_budget = float(values[setting])
    budget, margin = recommend_budget_gb(build_budget, total, peak, headroom)
    observation = {
        "status": "success",
        "recorded_at": _seconds_now(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device),
        "device_total_bytes": int(total),
        "free_before_bytes": int(free_before),
        "free_after_bytes": int(free_after),
        "external_before_bytes": int(external_before),
        "external_after_bytes": int(external_after),
        "max_reserved_bytes": int(max_reserved),
        "peak_bytes": int(peak),
        "headroom_bytes": headroom,
        "free_margin_bytes": int(margin),
        "setting": setting,
        "build_budget_gb": build_budget,
        "recommended_budget_gb": budget,
        "seconds": seconds,
    }
    recommendation = {
        "setting": setting,
        "budget_gb": budget,
        "profile_resident_module_budget_gb": budget,
        "free_margin_gb": round(margin / _GIB, 4),
        "device_total_bytes": int(total),
        "recorded_at": observation["recorded_at"],
    }
    record_dynamic_offload_profile(context, observation, recommendation=recommendation)
    info.update(status="recorded", recommended_budget_gb=budget, peak_bytes=int(peak), free_margin_bytes=int(margin))
