"""ddo's one call: the plan of a whole generation on this machine, and a pipeline run by it.

:func:`load` loads a Diffusers pipeline folder (or cached hub id) and :func:`offload` takes a
pipeline object; both plan every model component for the card and the host as measured
(``ddo-policy``'s generation plan: route, host tier, GPU budget, prefetch depth and encoding,
each with its reason), attach them, and let the phases of a generation (text encoders,
denoiser, VAE) share the card. :func:`plan` shows the plan without loading anything. This
module gathers the facts and applies the plan; the choices are made in Rust."""

from __future__ import annotations

import contextlib
import inspect
import json
import numbers
import os
import socket
import statistics
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from . import _native
from .config import DynamicOffloadConfig
from .errors import (
    DynamicOffloadCapacityError,
    DynamicOffloadCheckpointError,
    DynamicOffloadConfigError,
    DynamicOffloadError,
)
from .loaders.checkpoint import variant_checkpoint
from .loaders.pipeline import (
    DynamicOffloadPipelineResult,
    _class_of,
    _dtype_of,
    _is_component,
    from_pretrained_pipeline_with_dynamic_offload,
    read_index,
)
from .results import DynamicOffloadApplyResult
from .settings import resolve_settings

__all__ = ["GenerationPlan", "Offloaded", "cache_dir", "load", "offload", "plan"]

_FLOAT = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
#: Diffusers' loading keywords a plan reads (what the components' bytes depend on, where they are).
_PLAN_KEYWORDS = ("dtype", "torch_dtype", "variant", "revision", "cache_dir")
_VAE_DECODE = ("exact", "tiled", "sliced")


def cache_dir() -> Optional[str]:
    """ddo's cache folder (the machine profile, the encoded files): ``$DDO_CACHE_DIR``, else
    ``ddo`` beside the Hugging Face cache (``$HF_HOME/ddo``, ``$XDG_CACHE_HOME/huggingface/ddo``,
    ``~/.cache/huggingface/ddo``); ``None`` when no variable locates one."""
    found = _native.cache_dir()
    return None if found is None else str(found)


class GenerationPlan:
    """The plan of a whole generation: ``components`` (each component's choice as a dict:
    ``route``, ``host_tier``, ``budget_bytes``, ``streamed_bytes_per_pass``,
    ``copy_seconds_per_pass``, ``encoding``, ``reasons``, ``config``), ``phases``, ``notes`` and
    the ``machine`` it was made for. ``table()`` (and ``str()``) print it."""

    def __init__(self, data: Dict[str, Any], machine: Dict[str, Any]) -> None:
        self.data = data
        self.machine = machine
        self.components: Dict[str, Dict[str, Any]] = {c["name"]: c for c in data["components"]}
        self.phases: List[Dict[str, Any]] = data["phases"]
        self.notes: List[str] = data["notes"]
        self.device: str = data["device"]

    def table(self) -> str:
        """The plan as a table, with the reason for each choice."""
        m = self.machine
        measured = []
        if m.get("link_bytes_per_second"):
            measured.append(f"link {m['link_bytes_per_second'] / 1e9:.1f} GB/s")
        if m.get("decode_bytes_per_second"):
            measured.append(f"decode {m['decode_bytes_per_second'] / 1e9:.0f} GB/s")
        if m.get("host_available_bytes") is not None:
            measured.append(f"host room {m['host_available_bytes'] / 2**30:.1f} GiB")
        head = f"machine: {', '.join(measured)}{' (cached profile)' if m.get('cached') else ''}\n" if measured else ""
        return head + str(self.data["table"])

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        routes = ", ".join(f"{n}={c['route']}" for n, c in self.components.items())
        return f"GenerationPlan({self.device}: {routes})"


# ---------------------------------------------------------------------------------------------
# Facts


def _tensor_facts(tensors: List[Tuple[str, int, str]], dtype: Optional[torch.dtype]) -> Dict[str, Any]:
    """Weight bytes as loaded (floating tensors in ``dtype`` when given) and the repeated
    blocks of ``tensors`` ``(name, stored bytes, safetensors dtype)``."""
    loaded = []
    for name, nbytes, stored in tensors:
        if dtype is not None and stored in _FLOAT and dtype.is_floating_point:
            nbytes = nbytes // _FLOAT[stored] * dtype.itemsize
            stored = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}.get(dtype, stored)
        loaded.append((name, int(nbytes), stored == "BF16"))
    facts: Dict[str, Any] = json.loads(_native.blocks_of_tensors(loaded))
    facts["weight_bytes"] = sum(b for _, b, _ in loaded)
    return facts


def _folder_facts(root: str, index: Dict[str, Any], dtype: Any, variant: Optional[str]) -> List[Dict[str, Any]]:
    """The model components of the pipeline folder ``root`` from their checkpoints' headers."""
    facts = []
    for name, spec in index.items():
        if name.startswith("_") or not _is_component(spec):
            continue
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):
            continue
        loader = _class_of(spec[0], spec[1], f"{root}/model_index.json ({name})")
        if not (isinstance(loader, type) and issubclass(loader, torch.nn.Module)):
            continue
        try:
            checkpoint = variant_checkpoint(folder, variant)
            info = json.loads(_native.inspect_checkpoint(checkpoint))
        except (DynamicOffloadError, OSError) as e:
            raise DynamicOffloadCheckpointError(
                f"{name}: the plan reads each model component's safetensors headers, and {folder}'s cannot be read: {e}"
            ) from None
        tensors = [(t["name"], int(t["len"]), t["dtype"]) for t in info["tensors"]]
        facts.append(dict(_tensor_facts(tensors, _dtype_of(dtype, name)), name=name, from_checkpoint=True))
    return facts


def _module_facts(name: str, module: torch.nn.Module) -> Dict[str, Any]:
    """A model component built in memory, from its parameters and buffers."""
    stored = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64"}
    tensors = [
        (n, t.numel() * t.element_size(), stored.get(t.dtype, "U8"))
        for n, t in list(module.named_parameters()) + list(module.named_buffers())
    ]
    return dict(_tensor_facts(tensors, None), name=name, from_checkpoint=False)


def _device(config: Optional[DynamicOffloadConfig]) -> str:
    """The execution device the configuration names; its default ``cuda:0`` is the host
    backend (``cpu``) where no CUDA driver or device is present."""
    settings = resolve_settings("transformer", config=config)
    device = str(settings.device)
    explicit = config is not None and "execution_device" in config.explicit_fields()
    if device.startswith("cuda") and not explicit and not (_native.cuda_driver_present() and torch.cuda.is_available()):
        return "cpu"
    return device


def _budget_bytes(gpu_budget_gb: Any) -> Optional[int]:
    """``gpu_budget_gb`` in bytes: a number (NumPy's too) from 1 MiB to 1 PiB, in GiB."""
    if gpu_budget_gb is None:
        return None
    if isinstance(gpu_budget_gb, bool) or not isinstance(gpu_budget_gb, numbers.Real):
        raise DynamicOffloadConfigError(f"gpu_budget_gb must be a number of GiB, not {gpu_budget_gb!r}")
    value = float(gpu_budget_gb)
    if not 2**-10 <= value <= 2**20:
        raise DynamicOffloadConfigError(
            f"gpu_budget_gb is {gpu_budget_gb!r}: give the GiB the weights may take on the card, from 1 MiB (0.0009765625) "
            "to 1 PiB (1048576)"
        )
    return int(value * 2**30)


def _check_sources(config: Any, dtype: Any) -> None:
    """The configuration and the dtype the one call takes, refused by name when of another kind."""
    if config is not None and not isinstance(config, DynamicOffloadConfig):
        hint = (
            ": put it in config=ddo.DynamicOffloadConfig(components={name: policy})"
            if type(config).__name__ == "ComponentPolicy" else ""
        )
        raise DynamicOffloadConfigError(f"config must be a ddo.DynamicOffloadConfig, not {type(config).__name__}{hint}")
    dtypes = list(dtype.values()) if isinstance(dtype, dict) else [dtype]
    wrong = [d for d in dtypes if d is not None and not isinstance(d, torch.dtype)]
    if wrong:
        raise DynamicOffloadConfigError(
            f"dtype must be a torch.dtype (torch.bfloat16) or a mapping of component names to them, not {wrong[0]!r}"
        )


def _machine(
    device: str, config: Optional[DynamicOffloadConfig], refresh: bool = False, gpu_budget_gb: Any = None
) -> Dict[str, Any]:
    """The machine as measured: the card's memory now, the cached (or measured) link and
    decoding speeds, and the host's room under admission."""
    settings = resolve_settings("transformer", config=config)
    margin = int(float(settings.values.get("system_ram_headroom_gb", 6.0)) * 2**30)
    room = _native.host_room_bytes(margin)
    budget = _budget_bytes(gpu_budget_gb)
    if device == "cpu":
        available = room or 0
        return {
            "device": "cpu", "card_total_bytes": budget or available, "card_free_bytes": available,
            "host_available_bytes": room, "budget_bytes": budget,
        }
    d = torch.device(device)
    free, total = torch.cuda.mem_get_info(d)
    props = torch.cuda.get_device_properties(d)
    key = f"{props.name}|{total}|{getattr(props, 'pci_bus_id', d.index)}|cuda {torch.version.cuda}|{socket.gethostname()}"
    folder = cache_dir()
    # Without a cache folder the machine is measured at each plan.
    file = os.path.join(folder, "machine.json") if folder else ""
    profile = json.loads(_native.machine_profile(device, key, file, refresh or not folder))
    return {
        "device": device, "card_total_bytes": int(total), "card_free_bytes": int(free),
        "link_bytes_per_second": profile.get("link_bytes_per_second"),
        "decode_bytes_per_second": profile.get("decode_bytes_per_second"),
        "host_available_bytes": room, "budget_bytes": budget, "cached": profile.get("cached", False),
    }


def _plan(components: List[Dict[str, Any]], machine: Dict[str, Any]) -> GenerationPlan:
    request = {"machine": {k: v for k, v in machine.items() if k != "cached"}, "components": components}
    return GenerationPlan(json.loads(_native.plan_generation(json.dumps(request))), machine)


def _pipeline_modules(pipe: Any) -> Dict[str, torch.nn.Module]:
    components = getattr(pipe, "components", None)
    if not isinstance(components, dict):
        raise DynamicOffloadError(
            f"{type(pipe).__name__} has no .components mapping: pass a Diffusers pipeline (or a folder to ddo.load)"
        )
    return {n: m for n, m in components.items() if isinstance(m, torch.nn.Module)}


def plan(
    source: Any,
    *,
    config: Optional[DynamicOffloadConfig] = None,
    gpu_budget_gb: Optional[float] = None,
    refresh: bool = False,
    **diffusers_kwargs: Any,
) -> GenerationPlan:
    """The plan :func:`load` (for a folder or hub id) or :func:`offload` (for a pipeline) would
    follow on this machine, made from the checkpoints' headers or the modules: nothing is
    loaded. ``gpu_budget_gb`` bounds what the plan shares of the card (on the host backend it
    plans the host device as a card of that size); ``refresh`` measures the machine again
    instead of reading its cached profile."""
    dtype = diffusers_kwargs.get("dtype", diffusers_kwargs.get("torch_dtype"))
    _check_sources(config, dtype)
    unknown = sorted(k for k in diffusers_kwargs if k not in _PLAN_KEYWORDS)
    if unknown:
        raise TypeError(
            f"ddo.plan() got the keyword(s) {', '.join(unknown)}: it takes Diffusers' {', '.join(_PLAN_KEYWORDS)} "
            "(the others change nothing it plans)"
        )
    device = _device(config)
    if isinstance(source, (str, os.PathLike)):
        root, index = read_index(source, diffusers_kwargs.get("revision"), diffusers_kwargs.get("cache_dir"))
        components = _folder_facts(root, index, dtype, diffusers_kwargs.get("variant"))
    else:
        components = [_module_facts(n, m) for n, m in _pipeline_modules(source).items()]
    return _plan(components, _machine(device, config, refresh, gpu_budget_gb))


# ---------------------------------------------------------------------------------------------
# Running


def _explicit(config: Optional[DynamicOffloadConfig]) -> Dict[str, Any]:
    return {k: getattr(config, k) for k in config.explicit_fields()} if config is not None else {}


def _own_configs(
    p: GenerationPlan,
    config: Optional[DynamicOffloadConfig],
    component_configs: Optional[Mapping[str, DynamicOffloadConfig]] = None,
) -> Dict[str, DynamicOffloadConfig]:
    """Each component's configuration: the plan's choice, under what the user's ``config`` sets
    explicitly, under what ``component_configs[name]`` sets explicitly (the user's settings win,
    the component's own last)."""
    own = dict(component_configs or {})
    unknown = sorted(n for n in own if n not in p.components)
    if unknown:
        raise DynamicOffloadConfigError(
            f"component_configs names {', '.join(unknown)}, which the pipeline has no model component of "
            f"(it has {', '.join(p.components)})"
        )
    for c in own.values():
        _check_sources(c, None)
    out = {}
    mine = _explicit(config)
    own_policies = dict(getattr(config, "components", None) or {}) if config is not None else {}
    for name, choice in p.components.items():
        planned = dict(choice["config"])
        theirs = {**mine, **_explicit(own.get(name))}
        if name in own_policies or any(k in theirs for k in ("route", "backend", "preset", "execution_mode")):
            planned = {}  # the user chose this component's route: the plan stays out of it
        out[name] = DynamicOffloadConfig().replace(**{**planned, **theirs})
    return out


@dataclass
class _Phase:
    """One phase's record: when it started, the denoiser's pass starts, its measured peak."""

    name: str
    passes: List[float] = field(default_factory=list)
    started: Optional[float] = None
    seconds: float = 0.0
    # PyTorch's allocated bytes as the phase last began, and the most it took above them.
    base: Optional[int] = None
    activation_bytes: Optional[int] = None


class Offloaded:
    """A pipeline run by ddo's plan. ``pipeline`` is the Diffusers pipeline; call the result as
    you would call it (``result(prompt, ...)``): that first checks the VAE decode fits at the
    size asked. ``plan`` is the :class:`GenerationPlan`, ``components`` each offloaded
    component's :class:`DynamicOffloadApplyResult`, ``report()`` the plan beside what ran,
    ``remove()`` takes the offload off."""

    def __init__(
        self,
        pipeline: Any,
        generation_plan: GenerationPlan,
        components: Dict[str, DynamicOffloadApplyResult],
        vae_decode: str,
    ) -> None:
        self.pipeline = pipeline
        self.plan = generation_plan
        self.components = components
        self.vae_decode = vae_decode
        self.decode: Dict[str, Any] = {}
        self._calibration: Optional[Tuple[Tuple[int, int], Tuple[int, int]]] = None
        self._handles: List[Any] = []
        self._wrapped: List[Any] = []
        self._calibrating = False
        self._share_lock = threading.RLock()
        # Each streamed component's setup metrics as its own phase left it (before an eviction).
        self._phase_setup: Dict[str, Dict[str, Any]] = {}
        self._phases: Dict[str, _Phase] = {}
        self._current: Optional[str] = None
        self.share: Any = None
        self._reconcile()
        self._share()

    def _reconcile(self) -> None:
        """Where the user's settings overrode the plan, the plan says what runs instead."""
        for name, c in self.plan.components.items():
            r = self.components.get(name)
            ran = r.metrics_snapshot().as_dict().get("execution", {}).get("route") if r is not None else "none"
            if ran and ran != c["route"]:
                c["reasons"].append(f"your configuration runs it on {ran} (the plan chose {c['route']})")
                c["route"] = ran
                if self._runtime(name) is None or ran not in ("vmm_fast_runtime", "vmm_runtime", "linear_runtime"):
                    c["route"] = "none" if self._runtime(name) is None else ran
            runtime = self._runtime(name)
            if runtime is not None and c["route"] in ("vmm_fast_runtime", "vmm_runtime", "linear_runtime"):
                attached = int(runtime.metrics().get("setup", {}).get("gpu_budget_bytes") or 0)
                # A denoiser attaches at its budget: a different one is the user's, and is kept.
                if c["phase"] == "denoise" and attached and attached != c["budget_bytes"]:
                    c["reasons"].append(
                        f"your configuration gives it {attached / 2**30:.2f} GiB (the plan chose {c['budget_bytes'] / 2**30:.2f})"
                    )
                    c["budget_bytes"] = attached
        for c in self.plan.data["components"]:
            c.update(self.plan.components[c["name"]])

    # --- the card's time-sharing -----------------------------------------------------------

    def _runtime(self, name: str) -> Any:
        r = self.components.get(name)
        return getattr(r, "runtime", None) if r is not None else None

    def _share(self) -> None:
        phases = {n: c["phase"] for n, c in self.plan.components.items()}
        arenas = {
            n for n, c in self.plan.components.items()
            if c["route"] in ("vmm_fast_runtime", "vmm_runtime", "linear_runtime") and self._runtime(n) is not None
        }
        # On the host backend the card is simulated by a budget (nothing to share without one).
        simulated = self.plan.device == "cpu" and self.plan.machine.get("budget_bytes") is not None
        if (self.plan.device != "cpu" or simulated) and arenas:
            idle, floors = {}, {}
            for n in arenas:
                floors[n], idle[n] = (int(v) for v in self._runtime(n).session.budget_floor())
            self.share = _native.CardShare(json.dumps(self.plan.data), idle)
            for n in arenas:
                self.share.set_floor(n, floors[n])
                if phases[n] != "denoise":
                    # Until its phase runs it holds its floor, its slots released.
                    runtime = self._runtime(n)
                    with runtime.forward_lock:
                        if runtime.metrics().get("setup", {}).get("gpu_budget_bytes", 0) > floors[n]:
                            runtime.set_budget(floors[n])
                        runtime.session.reclaim()
            if simulated:
                # A simulated card holds weights only: activations stay on the host.
                for phase in ("encode", "denoise", "decode"):
                    self.share.set_activation(phase, 0)
        for name, phase in phases.items():
            module = self.pipeline.components.get(name) if hasattr(self.pipeline, "components") else None
            if not isinstance(module, torch.nn.Module):
                continue
            runtime = self._runtime(name)
            hook = self._entering(phase, name)
            if runtime is not None and hasattr(runtime, "_pass"):
                # A streamed component's passes start its phase, before the pass begins (the
                # budgets change between passes).
                def pass_entering(original: Any, args: tuple, kwargs: dict, _pass: Any = runtime._pass, _hook: Any = hook) -> Any:
                    _hook()
                    return _pass(original, args, kwargs)

                runtime._pass = pass_entering
                self._wrapped.append(runtime)
            else:
                # A component ddo does not stream: its first call (or its children's: a VAE's
                # decode runs its decoder) starts its phase.
                for m in [module, *module.children()]:
                    self._handles.append(m.register_forward_pre_hook(lambda *_a, _h=hook: _h()))

    def _entering(self, phase: str, owner: str) -> Callable[[], None]:
        def enter() -> None:
            if self._calibrating:
                return  # the decode check's own small decodes start no phase
            now = time.perf_counter()
            record = self._phases.setdefault(phase, _Phase(phase))
            if phase == "denoise":
                record.passes.append(now)
            if self._current == phase:
                return
            started = self._phases[self._current].started if self._current is not None else None
            if self._current is not None and started is not None:
                self._phases[self._current].seconds += now - started
                self._measure_activations(self._current)
            self._current = phase
            record.started = now
            if self.share is not None and self.share.entering(phase):
                with self._share_lock:
                    self._apply(phase, owner)
            if self.plan.device != "cpu":
                # The phase's activations: PyTorch's peak above what it held as the phase began.
                device = torch.device(self.plan.device)
                torch.cuda.reset_peak_memory_stats(device)
                record.base = int(torch.cuda.memory_allocated(device))

        return enter

    def _measure_activations(self, phase: str) -> None:
        """What ``phase`` took beside the arenas, measured as it ends: the share plans with it
        from then on (the decode keeps the need its check measured, when larger)."""
        record = self._phases.get(phase)
        if self.plan.device == "cpu" or record is None or record.base is None:
            return
        peak = int(torch.cuda.max_memory_allocated(torch.device(self.plan.device))) - record.base
        record.activation_bytes = max(record.activation_bytes or 0, peak)
        if self.share is not None and (phase != "decode" or peak > int(self.share.activation(phase))):
            self.share.set_activation(phase, int(record.activation_bytes))

    def _free_bytes(self) -> int:
        """Free memory of the card now; on the host backend, what the budget leaves beside the
        arenas (the card it simulates)."""
        if self.plan.device == "cpu":
            held = 0
            for name, c in self.plan.components.items():
                runtime = self._runtime(name)
                if c["route"] != "none" and runtime is not None and not runtime.session.is_unloaded():
                    rt = runtime.metrics().get("runtime", {})
                    held += int(rt.get("resident_bytes") or 0) + int(rt.get("slot_bytes") or 0)
            return max(0, int(self.plan.machine["budget_bytes"]) - held)
        device = torch.device(self.plan.device)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(device)[0])

    def _apply(self, phase: str, owner: str) -> None:
        """Applies the card's sharing as ``phase`` starts (``owner``'s pass, under its own
        forward lock, starts it)."""
        free = self._free_bytes()
        for name, budget, reclaim in self.share.enter(phase, free):
            runtime = self._runtime(name)
            if runtime is None:
                self.share.refused(name, int(budget), bool(reclaim))
                continue
            lock = runtime.forward_lock
            # The owner's pass holds its lock already; another thread's forward of a component
            # keeps that component's budget (the share tries again at its next phase).
            held = name == owner or lock.acquire(blocking=False)
            try:
                if not held:
                    raise DynamicOffloadError(f"{name} runs a forward in another thread")
                if reclaim:
                    self._phase_setup[name] = runtime.metrics().get("setup", {})
                runtime.set_budget(int(budget))
                if reclaim:
                    runtime.session.reclaim()
            except DynamicOffloadError as e:
                self.share.refused(name, int(budget), bool(reclaim))
                warnings.warn(
                    f"ddo: {name} could not take a GPU budget of {budget / 2**30:.2f} GiB for the {phase} phase: {e}",
                    stacklevel=4,
                )
            finally:
                if held and name != owner:
                    lock.release()

    # --- the decode ------------------------------------------------------------------------

    def _output_size(self, kwargs: Dict[str, Any]) -> Tuple[int, int, int]:
        """(height, width, frames) the call asks for, with the pipeline's defaults."""
        pipe = self.pipeline
        defaults = {}
        with contextlib.suppress(TypeError, ValueError):
            defaults = {k: v.default for k, v in inspect.signature(pipe.__call__).parameters.items()}
        scale = int(getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", 8) or 8)
        sample = getattr(pipe, "default_sample_size", None)
        def side(key: str) -> int:
            value = kwargs.get(key, defaults.get(key))
            if isinstance(value, int) and value > 0:
                return value
            if isinstance(sample, int):
                return sample * scale
            raise DynamicOffloadConfigError(f"pass {key}=: the pipeline names no default {key}")
        frames = kwargs.get("num_frames", defaults.get("num_frames"))
        return side("height"), side("width"), int(frames) if isinstance(frames, int) and frames > 0 else 1

    def _calibrate(self, vae: Any) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """The VAE decode's peak working set at two small sizes: ``((pixels, bytes), ...)``."""
        if self._calibration is not None:
            return self._calibration
        device = next(vae.parameters()).device
        channels = int(getattr(vae.config, "latent_channels", 4) or 4)
        z_dim: Any = getattr(vae.config, "z_dim", None)
        self._calibrating = True
        try:
            points = self._decode_points(vae, device, channels, z_dim)
        finally:
            self._calibrating = False
        torch.cuda.empty_cache()
        self._calibration = (points[0], points[1])
        return self._calibration

    def _decode_points(self, vae: Any, device: torch.device, channels: int, z_dim: Any) -> List[Tuple[int, int]]:
        video = z_dim is not None
        points = []
        for side in (16, 32):
            shape = (1, int(z_dim), 1, side, side) if video else (1, channels, side, side)
            latents = torch.zeros(shape, dtype=vae.dtype, device=device)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            with torch.no_grad():
                out = vae.decode(latents, return_dict=False)[0]
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base
            pixels = int(out.shape[-1] * out.shape[-2] * (out.shape[2] if video else 1))
            points.append((pixels, int(peak)))
            del out, latents
        return points

    def check_decode(self, **call_kwargs: Any) -> Dict[str, Any]:
        """Whether the VAE decode fits the card for a call with ``call_kwargs`` (``height``,
        ``width``, ``num_frames``), and what ``vae_decode`` does about it: the decision as a
        dict (``decision``: ``fits``, ``reduced`` or ``refused``, ``message``). A refusal raises
        :class:`DynamicOffloadCapacityError` from ``result(...)`` before any step runs."""
        found = getattr(self.pipeline, "vae", None)
        if self.plan.device == "cpu" or not isinstance(found, torch.nn.Module):
            return {"decision": "fits", "why": "no card to bound" if self.plan.device == "cpu" else "no VAE"}
        vae: Any = found  # a Diffusers VAE: config, dtype, decode, enable_tiling
        if next(vae.parameters()).device.type != "cuda":
            return {"decision": "fits", "why": "the VAE does not decode on the card"}
        height, width, frames = self._output_size(call_kwargs)
        video = getattr(vae.config, "z_dim", None) is not None
        small, large = self._calibrate(vae)
        # A video's frames: its output (3 channels in the VAE's dtype) grows with them.
        per_pixel = 3 * (torch.finfo(vae.dtype).bits // 8) if vae.dtype.is_floating_point else 3
        need = int(_native.decode_need_bytes(small, large, height * width, frames if video else 1, per_pixel))
        device = torch.device(self.plan.device)
        torch.cuda.empty_cache()
        free = int(torch.cuda.mem_get_info(device)[0])
        evictable = int(self.share.evictable_bytes("decode")) if self.share is not None else 0
        size = f"{width}x{height}" + (f"x{frames}" if frames > 1 else "")
        decision: Dict[str, Any] = json.loads(_native.decode_fit(need, free + evictable, self.vae_decode, size))
        if self.share is not None:
            self.share.set_activation("decode", need)
        if decision["decision"] == "reduced":
            if decision["mode"] == "tiled":
                vae.enable_tiling()
            else:
                vae.enable_slicing()
            warnings.warn(f"ddo: {decision['message']}", stacklevel=3)
        self.decode = decision
        return decision

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        decision = self.check_decode(**kwargs)
        if decision["decision"] == "refused":
            raise DynamicOffloadCapacityError(decision["message"])
        return self.pipeline(*args, **kwargs)

    # --- what ran --------------------------------------------------------------------------

    def measured(self) -> Dict[str, Any]:
        """What ran: each phase's seconds, the denoiser's steps (median of the intervals
        between its pass starts) and how many arenas gave the card to another phase."""
        out: Dict[str, Any] = {p: round(r.seconds, 4) for p, r in self._phases.items()}
        passes = self._phases.get("denoise", _Phase("denoise")).passes
        steps = [b - a for a, b in zip(passes, passes[1:]) if b - a < 60]
        if steps:
            out["step_seconds"] = statistics.median(steps[1:] or steps)
            out["first_step_seconds"] = steps[0]
        out["evictions"] = int(self.share.evictions) if self.share is not None else 0
        out["activation_bytes"] = {p: r.activation_bytes for p, r in self._phases.items() if r.activation_bytes is not None}
        return out

    def report(self) -> str:
        """The plan's predictions beside what ran."""
        lines = [self.plan.table(), "measured:"]
        m = self.measured()
        for name, c in self.plan.components.items():
            r = self.components.get(name)
            if r is None or c["route"] == "none":
                continue
            # As its phase ran (an arena evicted since reports its floor now).
            runtime = self._phase_setup.get(name) or r.metrics_snapshot().as_dict().get("setup", {})
            predicted = c.get("copy_seconds_per_pass")
            lines.append(
                f"  {name}: streamed {int(runtime.get('streamed_bytes_per_pass') or 0) / 2**30:.2f} GiB/pass "
                f"(planned {c['streamed_bytes_per_pass'] / 2**30:.2f}), copy floor "
                f"{float(runtime.get('expected_copy_floor_seconds') or 0):.3f} s "
                f"(planned {predicted if predicted is None else round(predicted, 3)})"
            )
        if "step_seconds" in m:
            lines.append(f"  denoise step {m['step_seconds']:.3f} s (first {m['first_step_seconds']:.3f} s)")
        lines.append(f"  phases: {', '.join(f'{k} {v:.2f} s' for k, v in m.items() if k in ('encode', 'denoise', 'decode'))}")
        lines.append(f"  arenas that gave the card to another phase: {m['evictions']}")
        if m["activation_bytes"]:
            planned = {p["phase"]: p["activation_bytes"] for p in self.plan.phases}
            lines.append("  activations: " + ", ".join(
                f"{p} {b / 2**30:.2f} GiB" + (f" (planned {planned[p] / 2**30:.2f})" if p in planned else "")
                for p, b in m["activation_bytes"].items()
            ))
        if self.decode:
            lines.append(f"  decode: {self.decode.get('message') or self.decode['decision']}")
        return "\n".join(lines)

    def remove(self) -> None:
        """Takes the offload off every component and the phase hooks off the pipeline."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for runtime in self._wrapped:
            with contextlib.suppress(AttributeError):
                del runtime._pass
        self._wrapped = []
        for r in self.components.values():
            r.remove()


def _check_vae_decode(vae_decode: str) -> str:
    if vae_decode not in _VAE_DECODE:
        raise DynamicOffloadConfigError(f"vae_decode is {vae_decode!r}: use one of {', '.join(_VAE_DECODE)}")
    return vae_decode


def load(
    path: Union[str, os.PathLike],
    *,
    config: Optional[DynamicOffloadConfig] = None,
    component_configs: Optional[Mapping[str, DynamicOffloadConfig]] = None,
    gpu_budget_gb: Optional[float] = None,
    vae_decode: str = "exact",
    **diffusers_kwargs: Any,
) -> Offloaded:
    """Loads the Diffusers pipeline folder (or cached hub id) ``path`` by ddo's plan for this
    machine (:func:`plan`; ``gpu_budget_gb`` as there): each model component streams from its checkpoint, or stays on the
    card, as the plan says. ``config`` settings set explicitly override the plan, and
    ``component_configs`` (component names to a ``DynamicOffloadConfig``) those of one
    component (``{"transformer": DynamicOffloadConfig(vmm_resident_weight_budget_gb=10)}``); Diffusers'
    loading keywords (``dtype``/``torch_dtype``, ``variant``, ``revision``, ...) pass through as
    Diffusers takes them. ``vae_decode``: ``exact`` refuses a call whose decode cannot fit the
    card (before any step), ``tiled`` or ``sliced`` turn on Diffusers' tiled or sliced decode
    when it would not fit (reported: tiling changes the output)."""
    _check_vae_decode(vae_decode)
    facts_kwargs = {k: v for k, v in diffusers_kwargs.items() if k in _PLAN_KEYWORDS}
    p = plan(path, config=config, gpu_budget_gb=gpu_budget_gb, **facts_kwargs)
    loaded: DynamicOffloadPipelineResult = from_pretrained_pipeline_with_dynamic_offload(
        path, config=config, component_configs=_own_configs(p, config, component_configs), **diffusers_kwargs
    )
    try:
        return Offloaded(loaded.pipeline, p, loaded.offload, vae_decode)
    except BaseException:
        loaded.remove()
        raise


def offload(
    pipeline: Any,
    *,
    config: Optional[DynamicOffloadConfig] = None,
    gpu_budget_gb: Optional[float] = None,
    vae_decode: str = "exact",
) -> Offloaded:
    """Offloads the Diffusers pipeline object ``pipeline`` by ddo's plan for this machine: its
    modules are in memory already, so streamed components take the route that streams a
    module's own host tensors (``linear_runtime``); small ones stay on the card. For checkpoints
    on disk :func:`load` maps them instead (host memory holds each weight once)."""
    from .api import enable_offload

    _check_vae_decode(vae_decode)
    modules = _pipeline_modules(pipeline)
    p = plan(pipeline, config=config, gpu_budget_gb=gpu_budget_gb)
    configs = _own_configs(p, config)
    done: Dict[str, DynamicOffloadApplyResult] = {}
    try:
        for name, module in modules.items():
            done[name] = enable_offload(module, component=name, config=configs[name])
            if done[name].should_move_to_execution_device:
                module.to(done[name].execution_device)
        return Offloaded(pipeline, p, done, vae_decode)
    except BaseException:
        for r in done.values():
            with contextlib.suppress(Exception):
                r.remove()
        raise
