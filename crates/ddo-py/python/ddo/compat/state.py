"""What ddo did to one module, as plain data (``get_dynamic_offload_state(module)``), and the
``[dynamic-offload-profile]`` summary lines built from it."""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, TextIO, Tuple

import torch

__all__ = ["DynamicOffloadState", "DynamicOffloadUnitState", "get_dynamic_offload_state", "print_profile_summary"]

_GIB = float(1 << 30)
# The attribute enable_offload sets on an offloaded module (api._STATE_ATTR).
_STATE_ATTR = "_ddo_offload"


def _gib(n: int) -> float:
    return round(n / _GIB, 4)


@dataclass(frozen=True)
class DynamicOffloadUnitState:
    """One execution unit: a block ddo hooks (``placement`` ``streamed``: uploaded into a slot
    for each forward; ``resident``: kept in the arena), or the rest of the module's parameters
    (path ``resident``, ``placement`` ``pinned``: always on the device)."""

    path: str
    placement: str
    parameter_count: int
    bytes: int

    @property
    def name(self) -> str:
        """The unit's path, under the published entries' name."""
        return self.path


@dataclass(frozen=True)
class DynamicOffloadState:
    """A module's offload as ddo knows it. Sizes are the parameters' bytes in their dtypes
    (buffers, never streamed, are ``buffer_bytes``). ``patched_module_count`` counts the modules
    whose forward ddo hooks (the units); on routes that do not stream through ddo's arena
    (``diffusers_group_offload``, ``none``) there are no units and ``bytes_by_placement`` names
    who places the weights. While unloaded (``result.unload()``) there are no units either and
    every byte is ``unloaded``."""

    component: str
    route: str
    execution_device: str
    module_count: int
    parameter_count: int
    total_bytes: int
    buffer_bytes: int
    bytes_by_placement: Mapping[str, int]
    unit_count: int = 0
    streamed_unit_count: int = 0
    resident_unit_count: int = 0
    patched_module_count: int = 0
    unloaded: bool = False
    units: Tuple[DynamicOffloadUnitState, ...] = field(default_factory=tuple)
    # The published state's accounting, filled from ddo's own figures (``state_of``): setup by
    # action (``attach``: the native attach, its seconds and the bytes it placed) and copies by
    # name (``unit_upload``: the arena's uploads, their seconds, bytes and count; ``forward_input``:
    # inputs moved by the hook's ``pre_forward``). A host may add its own with :meth:`add_setup` /
    # :meth:`add_copy`.
    setup_seconds_by_action: Dict[str, float] = field(default_factory=dict)
    setup_bytes_by_action: Dict[str, int] = field(default_factory=dict)
    copy_seconds_by_name: Dict[str, float] = field(default_factory=dict)
    copy_bytes_by_name: Dict[str, int] = field(default_factory=dict)
    copy_calls_by_name: Dict[str, int] = field(default_factory=dict)
    # The Linear weights kept on the device (in resident units and the always-resident rest).
    selected_resident_linear_weights: Tuple[str, ...] = field(default_factory=tuple)
    # The always-resident patterns as resolved.
    resolved_resident_module_patterns: Tuple[str, ...] = field(default_factory=tuple)
    # What planning decided (ddo's plan: units, slots, budget), from the setup metrics.
    planner_decisions: Dict[str, Any] = field(default_factory=dict)

    # ddo refuses SDNQ-quantized modules, so an offloaded module has no SDNQ parameters.
    sdnq_pinned_parameter_bytes = 0
    sdnq_pinned_parameter_count = 0
    sdnq_unpinned_parameter_bytes = 0
    sdnq_unpinned_parameter_count = 0

    @property
    def selected_pinned_linear_weights(self) -> None:
        """The published library pins Linear weights one by one; ddo registers host memory by
        range (``setup.registered_bytes`` / ``pinned_bytes`` in metrics), so it has no list of
        pinned weights: ``None``."""
        return None

    def add_setup(self, action: str, seconds: float, byte_count: int = 0) -> None:
        """Adds ``seconds`` and ``byte_count`` bytes to setup action ``action`` (the published
        accounting)."""
        self.setup_seconds_by_action[action] = self.setup_seconds_by_action.get(action, 0.0) + float(seconds)
        self.setup_bytes_by_action[action] = self.setup_bytes_by_action.get(action, 0) + int(byte_count)

    def add_copy(self, name: str, seconds: float, byte_count: int, calls: int = 1) -> None:
        """Adds one copy (``calls`` of them) of ``byte_count`` bytes taking ``seconds`` under
        ``name``."""
        self.copy_seconds_by_name[name] = self.copy_seconds_by_name.get(name, 0.0) + float(seconds)
        self.copy_bytes_by_name[name] = self.copy_bytes_by_name.get(name, 0) + int(byte_count)
        self.copy_calls_by_name[name] = self.copy_calls_by_name.get(name, 0) + int(calls)

    def clone_for_runtime(self) -> "DynamicOffloadState":
        """A copy whose accounting is its own (what the published hook keeps per run)."""
        return copy.deepcopy(self)

    @property
    def entries(self) -> Tuple[DynamicOffloadUnitState, ...]:
        """The units, under the published name."""
        return self.units

    @property
    def selected_resident_modules(self) -> Tuple[str, ...]:
        """The paths of the units kept on the device (``resident`` and ``pinned``)."""
        return tuple(u.path for u in self.units if u.placement != "streamed")

    def as_dict(self) -> Dict[str, Any]:
        """Plain data: bytes as they are, ``total_gb`` / ``gb_by_placement`` in GiB (4 decimals),
        and the published ``entries`` (``name``, ``placement``, ``bytes``, ``gb`` to 6 decimals)
        and ``selected_resident_modules``."""
        return {
            "component": self.component,
            "route": self.route,
            "execution_device": self.execution_device,
            "module_count": self.module_count,
            "parameter_count": self.parameter_count,
            "total_bytes": self.total_bytes,
            "total_gb": _gib(self.total_bytes),
            "buffer_bytes": self.buffer_bytes,
            "bytes_by_placement": dict(self.bytes_by_placement),
            "gb_by_placement": {k: _gib(v) for k, v in self.bytes_by_placement.items()},
            "unit_count": self.unit_count,
            "streamed_unit_count": self.streamed_unit_count,
            "resident_unit_count": self.resident_unit_count,
            "patched_module_count": self.patched_module_count,
            "unloaded": self.unloaded,
            "units": [
                {"path": u.path, "placement": u.placement, "parameter_count": u.parameter_count, "bytes": u.bytes}
                for u in self.units
            ],
            "entries": [
                {"name": u.path, "placement": u.placement, "bytes": u.bytes, "gb": round(u.bytes / float(1 << 30), 6)}
                for u in self.units
            ],
            "selected_resident_modules": list(self.selected_resident_modules),
            "selected_resident_linear_weights": list(self.selected_resident_linear_weights),
            "selected_pinned_linear_weights": self.selected_pinned_linear_weights,
            "resolved_resident_module_patterns": list(self.resolved_resident_module_patterns),
            "setup_runtime": {
                action: {"seconds": seconds, "gb": _gib(self.setup_bytes_by_action.get(action, 0))}
                for action, seconds in self.setup_seconds_by_action.items()
            },
            "copy_runtime": {
                name: {
                    "calls": self.copy_calls_by_name.get(name, 0),
                    "seconds": seconds,
                    "gb": _gib(self.copy_bytes_by_name.get(name, 0)),
                }
                for name, seconds in self.copy_seconds_by_name.items()
            },
            "sdnq_parameter_pinning": {"pinned_count": 0, "pinned_gb": 0.0, "unpinned_count": 0, "unpinned_gb": 0.0},
            "planner_decisions": dict(self.planner_decisions),
        }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _distinct_bytes(module: torch.nn.Module) -> Tuple[int, int, int]:
    """``(parameter count, parameter bytes, buffer bytes)``, each tensor once."""
    params = {id(p): p for p in module.parameters()}
    buffers = {id(b): b for b in module.buffers()}
    return len(params), sum(_nbytes(p) for p in params.values()), sum(_nbytes(b) for b in buffers.values())


def _session_units(runtime: Any) -> Tuple[List[DynamicOffloadUnitState], Dict[str, int], int]:
    """Units of an attached session, bytes by placement, and the distinct parameter count."""
    groups: List[List[str]] = [list(g) for g in runtime.session.parameter_names()]
    sizes = {g[0]: _nbytes(runtime.shapes[g[0]]) for g in groups if g[0] in runtime.shapes}
    streamed_names = {n for names in runtime.streamed.values() for n in names}
    units = runtime.session.units()
    streamed_ids = set(runtime.streamed)
    hooked = [(uid, path) for uid, path, pinned in units if not pinned]
    # Each distinct parameter belongs to the first hooked unit whose path prefixes one of its
    # names; the rest form the always-resident unit.
    owner: Dict[str, Optional[int]] = {}
    for g in groups:
        owner[g[0]] = next(
            (uid for uid, path in hooked if any(n.startswith(path + ".") for n in g)),
            None,
        )
    out: List[DynamicOffloadUnitState] = []
    for uid, path, pinned in units:
        members = [name for name, o in owner.items() if (o is None if pinned else o == uid)]
        placement = "pinned" if pinned else ("streamed" if uid in streamed_ids else "resident")
        out.append(DynamicOffloadUnitState(path, placement, len(members), sum(sizes.get(n, 0) for n in members)))
    placement_bytes = {"resident": 0, "streamed": 0}
    for g in groups:
        key = "streamed" if any(n in streamed_names for n in g) else "resident"
        placement_bytes[key] += sizes.get(g[0], 0)
    return out, placement_bytes, len(groups)


def state_of(result: Any) -> DynamicOffloadState:
    """The state of one offload result (``DynamicOffloadApplyResult``)."""
    module = result.module
    module_count = sum(1 for _ in module.modules())
    runtime = result.runtime
    route = getattr(result, "runtime_route", "") or result.route
    count, total, buffer_bytes = _distinct_bytes(module)
    component = str(result.settings.component)
    device = str(result.execution_device)
    if runtime is None or runtime.session is None:
        who = str(result.setup.get("placement", "resident")) if route == "none" else route
        return DynamicOffloadState(component, route, device, module_count, count, total, buffer_bytes, {who: total})
    if runtime.is_unloaded():
        # Weights are meta placeholders and the arena is freed: no unit holds anything.
        names = [g[0] for g in runtime.session.parameter_names() if g[0] in runtime.shapes]
        total = sum(_nbytes(runtime.shapes[n]) for n in names)
        return DynamicOffloadState(
            component, route, device, module_count, len(names), total, buffer_bytes, {"unloaded": total}, unloaded=True
        )
    units, placement, count = _session_units(runtime)
    total = sum(placement.values())
    streamed = sum(1 for u in units if u.placement == "streamed")
    hooked = sum(1 for u in units if u.placement != "pinned")
    return _with_accounting(result, module, units, DynamicOffloadState(
        component=component,
        route=route,
        execution_device=device,
        module_count=module_count,
        parameter_count=count,
        total_bytes=total,
        buffer_bytes=buffer_bytes,
        bytes_by_placement=placement,
        unit_count=len(units),
        streamed_unit_count=streamed,
        resident_unit_count=len(units) - streamed,
        patched_module_count=hooked,
        units=tuple(units),
    ))


# The setup figures that are the plan's decisions.
_PLANNER_KEYS = (
    "unit_count", "resident_units", "streamed_units", "execution_slots", "slot_bytes", "gpu_budget_bytes",
    "headroom_bytes", "streamed_bytes_per_pass", "host_source", "host_tier_reason", "conversion",
)


def _with_accounting(
    result: Any, module: torch.nn.Module, units: List[DynamicOffloadUnitState], state: DynamicOffloadState
) -> DynamicOffloadState:
    """``state`` with the published accounting filled from ddo's metrics: only figures ddo
    measured (an absent setup time or upload counter leaves its entry out)."""
    data = result.runtime.metrics("snapshot")
    setup, runtime = data.get("setup", {}), data.get("runtime", {})
    if setup.get("setup_seconds") is not None:
        state.add_setup("attach", setup["setup_seconds"], state.total_bytes)
    if all(k in runtime for k in ("upload_seconds", "upload_bytes", "uploads")):
        state.add_copy("unit_upload", runtime["upload_seconds"], runtime["upload_bytes"], runtime["uploads"])
    # Inputs the host moved through the hook's pre_forward (ddo's forward does not count its own).
    hook = getattr(result, "_hook", None)
    for name, (seconds, byte_count, calls) in (hook.input_copies() if hook is not None else {}).items():
        state.add_copy(name, seconds, byte_count, calls)
    state.planner_decisions.update({k: setup[k] for k in _PLANNER_KEYS if k in setup})
    # Units ddo hooks are "resident" or "streamed"; the rest of the module ("pinned") stays on
    # the device.
    kept = [u.path for u in units if u.placement == "resident"]
    hooked = [u.path for u in units if u.placement != "pinned"]
    rest_is_kept = any(u.placement == "pinned" for u in units)

    def inside(path: str, paths: List[str]) -> bool:
        return any(path == p or path.startswith(p + ".") for p in paths)

    weights = [
        f"{path}.weight" if path else "weight"
        for path, m in module.named_modules()
        if isinstance(m, torch.nn.Linear)
        and m._parameters.get("weight") is not None
        and (inside(path, kept) or (rest_is_kept and not inside(path, hooked)))
    ]
    patterns = result.settings.values.get("always_resident_modules_pattern") or ()
    return DynamicOffloadState(
        **{
            **{f: getattr(state, f) for f in state.__dataclass_fields__},
            "selected_resident_linear_weights": tuple(weights),
            "resolved_resident_module_patterns": tuple([patterns] if isinstance(patterns, str) else patterns),
        }
    )


def get_dynamic_offload_state(module: torch.nn.Module) -> Optional[DynamicOffloadState]:
    """What ddo did to ``module``, or ``None`` when ddo does not offload it (never was, or
    ``remove()`` ran)."""
    result = getattr(module, _STATE_ATTR, None)
    if result is None:
        return None
    return state_of(result)


def _unit_list(units: List[DynamicOffloadUnitState], top_n: int) -> str:
    ranked = sorted(units, key=lambda u: (-u.bytes, u.path))[: max(0, top_n)]
    return ", ".join(f"{u.path}={_gib(u.bytes):.4f}" for u in ranked) or "none"


def print_profile_summary(result: Any, top_n: int = 8, *, file: Optional[TextIO] = None) -> None:
    """Prints ``[dynamic-offload-profile]`` lines for one offload result: the summary, bytes by
    placement, the run's counters, the ``top_n`` largest streamed and resident units, and the
    capacity profile when one was looked up."""
    out = file if file is not None else sys.stdout
    tag = "[dynamic-offload-profile]"
    state = state_of(result)
    data = result.metrics_snapshot().as_dict()
    setup, runtime = data.get("setup", {}), data.get("runtime", {})
    seconds = setup.get("setup_seconds")
    lines = [
        f"{tag} component={state.component} route={state.route} device={state.execution_device} "
        f"modules={state.module_count} parameters={state.parameter_count} total_gib={_gib(state.total_bytes):.4f} "
        f"units={state.unit_count} streamed_units={state.streamed_unit_count} "
        f"resident_units={state.resident_unit_count} patched_modules={state.patched_module_count}"
        + (f" setup_seconds={seconds:.6f}" if seconds is not None else ""),
        f"{tag} placement "
        + " ".join(f"{k}_gib={_gib(v):.4f}" for k, v in sorted(state.bytes_by_placement.items()))
        + f" buffers_gib={_gib(state.buffer_bytes):.4f}",
    ]
    keys = ("passes", "uploads", "upload_bytes", "upload_seconds", "wait_seconds")
    counters = []
    for k in (k for k in keys if k in runtime):
        v = runtime[k]
        counters.append(f"upload_gib={_gib(v):.4f}" if k == "upload_bytes" else f"{k}={v:.6f}" if isinstance(v, float) else f"{k}={v}")
    if counters:
        lines.append(f"{tag} runtime " + " ".join(counters))
    streamed = [u for u in state.units if u.placement == "streamed"]
    resident = [u for u in state.units if u.placement != "streamed"]
    if state.units:
        for kind, group in (("streamed", streamed), ("resident", resident)):
            shown = min(top_n, len(group))
            lines.append(f"{tag} {kind} units (top {shown} of {len(group)}, GiB): {_unit_list(group, top_n)}")
    profile = setup.get("capacity_profile")
    if profile:
        lines.append(f"{tag} capacity_profile " + " ".join(f"{k}={v}" for k, v in sorted(profile.items())))
    print("\n".join(lines), file=out)
