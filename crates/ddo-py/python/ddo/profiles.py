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
20 observations, the newest one deciding the recommendation."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
import time
import warnings
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple, Union

import torch

from . import _native

__all__ = [
    "DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION",
    "DynamicOffloadProfileSession",
    "dynamic_offload_profile_key",
    "dynamic_offload_profile_path",
    "get_dynamic_offload_profile_dir",
    "get_dynamic_offload_profile_recommendation",
    "load_dynamic_offload_profile",
    "normalize_dynamic_offload_profile_context",
    "record_dynamic_offload_profile",
]

DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION = 1
MAX_PROFILE_OBSERVATIONS = 20
_KEY_PREFIX = "ddo-capacity-v1-"
_GIB = float(1 << 30)
# The budget a recommendation sets, per route.
_BUDGET_SETTING = {"vmm_fast_runtime": "vmm_resident_weight_budget_gb", "linear_runtime": "resident_module_budget_gb"}

PathLike = Union[str, os.PathLike]


def get_dynamic_offload_profile_dir(*, environ: Optional[Mapping[str, str]] = None) -> str:
    """``DDO_PROFILE_DIR`` when set, else ``~/.ddo/profiles``."""
    env = os.environ if environ is None else environ
    chosen = env.get("DDO_PROFILE_DIR")
    return os.path.expanduser(chosen) if chosen else os.path.join(os.path.expanduser("~"), ".ddo", "profiles")


def normalize_dynamic_offload_profile_context(context: Mapping[str, Any]) -> Dict[str, Any]:
    """The context as canonical JSON data (string keys, sorted); a value JSON cannot carry raises
    ``DynamicOffloadConfigError``."""
    if not isinstance(context, Mapping) or not context:
        raise _native.DynamicOffloadConfigError("a capacity profile context is a non-empty mapping of names to JSON values")
    try:
        return json.loads(json.dumps(dict(context), sort_keys=True, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise _native.DynamicOffloadConfigError(
            f"capacity profile context {context!r} is not JSON data ({e}); use strings, numbers, booleans, lists "
            "and mappings"
        ) from None


def _canonical(context: Mapping[str, Any]) -> str:
    return json.dumps(normalize_dynamic_offload_profile_context(context), sort_keys=True, separators=(",", ":"))


def dynamic_offload_profile_key(context: Mapping[str, Any]) -> str:
    """``ddo-capacity-v1-`` + the first 24 hex digits of the SHA-256 of the context's canonical
    JSON (sorted keys, no spaces)."""
    return _KEY_PREFIX + hashlib.sha256(_canonical(context).encode("utf-8")).hexdigest()[:24]


def dynamic_offload_profile_path(context: Mapping[str, Any], profile_dir: Optional[PathLike] = None) -> str:
    """Where the profile of ``context`` is stored."""
    directory = os.fspath(profile_dir) if profile_dir is not None else get_dynamic_offload_profile_dir()
    return os.path.join(directory, dynamic_offload_profile_key(context) + ".json")


def _invalid(path: str, why: str) -> Exception:
    return _native.DynamicOffloadConfigError(
        f"capacity profile {path} is not valid ({why}): delete it, or build it again with build_profile=True"
    )


def _check(path: str, data: Any, context: Mapping[str, Any]) -> Dict[str, Any]:
    if not isinstance(data, dict):
        raise _invalid(path, "not a JSON object")
    if data.get("schema_version") != DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION:
        version = data.get("schema_version")
        raise _invalid(path, f"schema_version {version!r}, this ddo reads {DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION}")
    if data.get("key") != dynamic_offload_profile_key(context):
        raise _invalid(path, f"key {data.get('key')!r} is not this context's")
    if not isinstance(data.get("observations"), list):
        raise _invalid(path, "observations is not a list")
    rec = data.get("recommendation")
    if rec is not None:
        budget = rec.get("budget_gb") if isinstance(rec, dict) else None
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget < 0:
            raise _invalid(path, f"recommendation budget_gb {budget!r} is not a finite number >= 0")
        if rec.get("setting") not in _BUDGET_SETTING.values():
            allowed = sorted(_BUDGET_SETTING.values())
            raise _invalid(path, f"recommendation setting {rec.get('setting')!r} is not one of {allowed}")
    return data


def load_dynamic_offload_profile(
    context: Mapping[str, Any], profile_dir: Optional[PathLike] = None
) -> Optional[Dict[str, Any]]:
    """The stored profile of ``context``, or ``None`` when there is none. A file that is not a
    valid profile raises ``DynamicOffloadConfigError`` naming it."""
    path = dynamic_offload_profile_path(context, profile_dir)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise _invalid(path, f"not JSON: {e}") from None
    return _check(path, data, context)


def record_dynamic_offload_profile(
    context: Mapping[str, Any],
    observation: Mapping[str, Any],
    *,
    recommendation: Optional[Mapping[str, Any]] = None,
    profile_dir: Optional[PathLike] = None,
) -> Dict[str, Any]:
    """Appends ``observation`` to the profile of ``context`` (the last 20 are kept) and, when
    given, replaces its recommendation (``{"budget_gb": ..., "setting": ...}``). The file is
    written to a temporary file in the same folder, flushed to disk and renamed over the old one,
    so a reader sees the old profile or the new one, never a part. Returns the stored profile."""
    path = dynamic_offload_profile_path(context, profile_dir)
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    data = load_dynamic_offload_profile(context, profile_dir) or {
        "schema_version": DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION,
        "key": dynamic_offload_profile_key(context),
        "context": normalize_dynamic_offload_profile_context(context),
        "recommendation": None,
        "observations": [],
    }
    data["observations"] = (data["observations"] + [dict(observation)])[-MAX_PROFILE_OBSERVATIONS:]
    if recommendation is not None:
        data["recommendation"] = dict(recommendation)
    _check(path, json.loads(json.dumps(data, allow_nan=False)), context)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
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
    return data


def get_dynamic_offload_profile_recommendation(
    context: Mapping[str, Any], profile_dir: Optional[PathLike] = None
) -> Optional[Dict[str, Any]]:
    """The stored recommendation of ``context`` (``budget_gb``, ``setting``, how it was
    measured), or ``None``."""
    data = load_dynamic_offload_profile(context, profile_dir)
    return None if data is None else data.get("recommendation")


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
    margin = max(0, int(total) - int(peak) - int(headroom))
    return math.floor((float(build_budget_gb) + margin / _GIB) * 1e4) / 1e4, margin


class DynamicOffloadProfileSession:
    """One component's capacity profile: its context, where it lives, and the recording of a
    measured run."""

    def __init__(self, context: Mapping[str, Any], profile_dir: Optional[PathLike] = None) -> None:
        self.context = normalize_dynamic_offload_profile_context(context)
        self.profile_dir = os.fspath(profile_dir) if profile_dir is not None else get_dynamic_offload_profile_dir()
        self.key = dynamic_offload_profile_key(self.context)
        self.path = dynamic_offload_profile_path(self.context, self.profile_dir)

    @staticmethod
    def recommend_resident_budget(total: float, peak: float, headroom: float) -> float:
        """The published rule: ``max(0, total - peak - headroom)`` (any one unit)."""
        return max(0.0, float(total) - float(peak) - float(headroom))

    def recommendation(self) -> Optional[Dict[str, Any]]:
        return get_dynamic_offload_profile_recommendation(self.context, self.profile_dir)

    def record_success(self, observation: Mapping[str, Any], recommendation: Mapping[str, Any]) -> Dict[str, Any]:
        return record_dynamic_offload_profile(
            self.context, observation, recommendation=recommendation, profile_dir=self.profile_dir
        )


def _explicit(origin: str) -> bool:
    """Whether a setting's origin is the user's (not a default or a preset)."""
    return origin != "default" and not origin.startswith("preset")


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
    if route not in _BUDGET_SETTING:
        if build:
            raise _native.DynamicOffloadConfigError(
                f"build_profile = true measures ddo's GPU weight budget, and component {settings.component} takes route "
                f"{route}, which has none: use route linear_runtime or vmm_fast_runtime, or leave build_profile off"
            )
        return settings, {"name": name, "status": "not_applicable"}
    setting = _BUDGET_SETTING[route]
    device = torch.device(settings.device)
    session = DynamicOffloadProfileSession(profile_context(module, settings.component, route, str(device), name))
    info: Dict[str, Any] = {"name": name, "key": session.key, "path": session.path, "setting": setting}
    if build:
        if device.type != "cuda":
            raise _native.DynamicOffloadConfigError(
                f"build_profile = true measures GPU memory, and component {settings.component} runs on {device}: run "
                "it on a CUDA device to build the profile, or leave build_profile off (profile_name alone applies a "
                "recorded profile)"
            )
        info.update(status="building", budget_gb=float(values[setting]))
        return settings, info
    recommendation = session.recommendation()
    if recommendation is None:
        warnings.warn(
            f"ddo: capacity profile {name!r} has no recording at {session.path}; the budget stays "
            f"{setting} = {values[setting]} (build one with build_profile=True and result.profile_run())",
            stacklevel=3,
        )
        info.update(status="not_found", budget_gb=float(values[setting]))
        return settings, info
    budget = float(recommendation["budget_gb"])
    info["recommended_budget_gb"] = budget
    if _explicit(str(settings.origins.get(setting, "default"))):
        info.update(status="explicit_budget", budget_gb=float(values[setting]))
        return settings, info
    recorded_total = recommendation.get("device_total_bytes")
    if recorded_total is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if int(recorded_total) != int(total):
            warnings.warn(
                f"ddo: capacity profile {name!r} was measured on a GPU of {recorded_total} bytes, {device} has {total}: "
                f"not applied; build it again on this GPU",
                stacklevel=3,
            )
            info.update(status="device_changed", budget_gb=float(values[setting]))
            return settings, info
    if setting == "vmm_resident_weight_budget_gb" and budget <= 0:
        raise _native.DynamicOffloadCapacityError(
            f"capacity profile {name!r} ({session.path}) leaves no GPU memory for weights (recommended {budget} GiB): "
            "build it again with a lighter run or a lower profile_vram_headroom_gb, or set vmm_resident_weight_budget_gb"
        )
    settings = _resolve_with(settings, {setting: budget, "profile_resident_module_budget_gb": budget})
    info.update(status="applied", budget_gb=budget)
    return settings, info


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
    session = DynamicOffloadProfileSession(
        profile_context(result.module, result.settings.component, result.settings.route_name, str(device), info["name"])
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
        "free_margin_gb": round(margin / _GIB, 4),
        "device_total_bytes": int(total),
        "recorded_at": observation["recorded_at"],
    }
    session.record_success(observation, recommendation)
    info.update(status="recorded", recommended_budget_gb=budget, peak_bytes=int(peak), free_margin_bytes=int(margin))
