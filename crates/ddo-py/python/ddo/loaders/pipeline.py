"""Whole pipelines: one call loads a Diffusers pipeline folder with every model component on the
route its policy names, under one GPU weight budget."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import numbers
import os
from typing import Any, Dict, Mapping, Optional, Union

import torch

from .. import _native
from ..api import config_keyword, enable_offload, from_pretrained_with_dynamic_offload
from ..config import DynamicOffloadConfig
from ..errors import DynamicOffloadCapacityError, DynamicOffloadConfigError, DynamicOffloadError
from ..metrics import DynamicOffloadMetrics
from ..progress import bar
from ..results import DynamicOffloadApplyResult
from ..settings import resolve_settings
from .checkpoint import local_path, variant_checkpoint

__all__ = ["DynamicOffloadPipelineResult", "from_pretrained_pipeline_with_dynamic_offload"]


@dataclasses.dataclass
class DynamicOffloadPipelineResult:
    """What :func:`from_pretrained_pipeline_with_dynamic_offload` loaded.

    - ``pipeline``: the Diffusers pipeline (the class ``model_index.json`` names, or
      ``pipeline_class``), built from the loaded components, ready to call.
    - ``offload``: each offloaded model component's :class:`DynamicOffloadApplyResult` by
      component name (its metrics, ``remove()``, ``unload()``/``reload()``); components given in
      the keywords are used as they are and are not in it.
    - ``budgets_gb``: each ``vmm_fast_runtime`` component's share of ``gpu_budget_gb`` in GiB, by
      name (split by weight bytes, per device with a mapping); empty without ``gpu_budget_gb``.
    - ``devices``: the execution device of each component ``device_map`` placed, by name, as
      ``cuda:N`` or ``cpu`` (the others run on the config's ``execution_device``); empty
      without ``device_map``."""

    pipeline: Any
    offload: Dict[str, DynamicOffloadApplyResult]
    budgets_gb: Dict[str, float]
    devices: Dict[str, str] = dataclasses.field(default_factory=dict)

    def metrics_snapshots(self) -> Dict[str, DynamicOffloadMetrics]:
        """Each offloaded component's metrics."""
        return {name: r.metrics_snapshot() for name, r in self.offload.items()}

    def remove(self) -> None:
        """Removes every component's offload (the pipeline's modules get their weights back
        where they can)."""
        for r in self.offload.values():
            r.remove()


def _class_of(library: str, name: str, where: str) -> Any:
    """The class ``name`` of ``library``, found as Diffusers finds it: a library that is one of
    Diffusers' pipeline modules (``stable_diffusion``) is looked up there."""
    try:
        import diffusers.pipelines

        module = getattr(diffusers.pipelines, library, None)
        module = module if module is not None else importlib.import_module(library)
    except ImportError as e:
        raise DynamicOffloadError(f"{where} names library {library!r}, which cannot be imported: {e}") from None
    found = getattr(module, name, None)
    if not isinstance(found, type) or not hasattr(found, "from_pretrained"):
        raise DynamicOffloadError(f"{where} names {library}.{name}, which is not a class that loads with from_pretrained")
    return found


def read_index(
    path: Union[str, os.PathLike], revision: Optional[str] = None, cache_dir: Optional[str] = None
) -> "tuple[str, Dict[str, Any]]":
    """The local folder of the pipeline ``path`` (a folder, or a hub id in the local cache) and
    its ``model_index.json``; a folder without one, or one that is not an object, is refused."""
    root = local_path(path, revision, cache_dir)
    index_path = os.path.join(root, "model_index.json")
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except FileNotFoundError:
        raise DynamicOffloadError(f"{root} has no model_index.json: pass a Diffusers pipeline folder") from None
    except (ValueError, OSError) as e:
        raise DynamicOffloadError(f"{index_path} cannot be read as JSON: {e}") from None
    if not isinstance(index, dict):
        raise DynamicOffloadError(f"{index_path} holds a {type(index).__name__}, not an object of components")
    return root, index


def _is_component(spec: Any) -> bool:
    """A ``[library, class]`` entry naming a class (not ``[null, null]``, not a plain value)."""
    return isinstance(spec, list) and len(spec) == 2 and all(isinstance(x, str) for x in spec)


def _has_safetensors(folder: str) -> bool:
    return os.path.isdir(folder) and any(f.endswith(".safetensors") for f in os.listdir(folder))


def _weight_bytes(checkpoint: str, dtype: Optional[torch.dtype]) -> int:
    """The bytes a component's weights take loaded: floating tensors in ``dtype`` when given."""
    total = 0
    for t in json.loads(_native.inspect_checkpoint(checkpoint))["tensors"]:
        if dtype is not None and t["dtype"] in ("F32", "F16", "BF16", "F64"):
            count = 1
            for d in t["shape"]:
                count *= int(d)
            total += count * dtype.itemsize
        else:
            total += int(t["len"])
    return total


def _device_name(value: Any, what: str) -> str:
    """A device as ddo names it (``cuda`` is ``cuda:0``); anything else is refused by name."""
    try:
        d = torch.device(value)
    except (RuntimeError, TypeError):
        raise DynamicOffloadConfigError(f"{what} is {value!r}, not a device: use 'cuda:N' or 'cpu'") from None
    if d.type == "cuda":
        return f"cuda:{d.index or 0}"
    if d.type == "cpu":
        return "cpu"
    raise DynamicOffloadConfigError(f"{what} is {value!r}: ddo runs components on 'cuda:N' or 'cpu'")


def _gib(value: Any, what: str) -> float:
    """A positive, finite number of GiB (Python or NumPy numbers), as a float."""
    try:
        number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None
    except OverflowError:
        number = math.inf
    if number is None or not math.isfinite(number) or number <= 0:
        raise DynamicOffloadConfigError(f"{what} must be a positive number of GiB, not {value!r}")
    return number


def _split_budgets(gpu_budget_gb: Any, arena: list, sizes: Dict[str, int], on: Dict[str, str]) -> Dict[str, float]:
    """Each arena component's share of ``gpu_budget_gb`` by weight bytes: of the one budget, or
    of its device's budget when ``gpu_budget_gb`` maps devices to GiB (``on``: each component's
    device)."""
    if not isinstance(gpu_budget_gb, Mapping):
        total = sum(sizes.values()) or 1
        return {n: _gib(gpu_budget_gb, "gpu_budget_gb") * sizes[n] / total for n in arena}
    per_device: Dict[str, float] = {}
    for d, v in gpu_budget_gb.items():
        name = _device_name(d, f"gpu_budget_gb key {d!r}")
        if name in per_device:
            raise DynamicOffloadConfigError(f"gpu_budget_gb names {name} twice (as {d!r} too): give each device one budget")
        per_device[name] = _gib(v, f"gpu_budget_gb[{d!r}]")
    if not per_device:
        raise DynamicOffloadConfigError("gpu_budget_gb is an empty mapping: give each device a budget, or leave it unset")
    unnamed = sorted(f"{n} ({d})" for n, d in on.items() if d not in per_device)
    if unnamed:
        raise DynamicOffloadConfigError(
            f"gpu_budget_gb names {', '.join(per_device)}, and these components on vmm_fast_runtime run elsewhere: "
            f"{', '.join(unnamed)}; add their devices to gpu_budget_gb or place them with device_map"
        )
    idle = sorted(d for d in per_device if d not in on.values())
    if idle:
        raise DynamicOffloadConfigError(
            f"gpu_budget_gb gives {', '.join(idle)} a budget, and no component on vmm_fast_runtime runs there; "
            "remove it, or place a component there with device_map"
        )
    budgets = {}
    for d, v in per_device.items():
        names = [n for n in arena if on[n] == d]
        total = sum(sizes[n] for n in names) or 1
        budgets.update({n: float(v) * sizes[n] / total for n in names})
    return budgets


#: Diffusers' loading keywords that find the pipeline's files: ddo reads local folders and the hub
#: cache only (``cache_dir`` is where it looks), so the download ones change nothing.
_FINDING = ("cache_dir", "local_files_only", "token", "proxies", "force_download")
#: Diffusers' loading keywords handed to each model component's ``from_pretrained`` when it is
#: loaded by its class, as Diffusers hands them (``use_safetensors=False`` also keeps every
#: component off the arena routes, which stream safetensors).
_PER_COMPONENT = ("use_safetensors", "low_cpu_mem_usage", "disable_mmap")
#: Diffusers' loading keywords for what ddo's pipeline loader does not do.
_REFUSED = (
    "custom_pipeline", "custom_revision", "provider", "sess_options", "provider_options", "use_onnx", "max_memory",
    "offload_folder", "offload_state_dict", "load_connected_pipeline", "quantization_config", "use_flashpack",
    "trust_remote_code",
)


def _transformers_dtype_keyword() -> str:
    """``dtype`` for transformers 4.56 and later, ``torch_dtype`` before (its older name)."""
    try:
        import transformers
    except ImportError:
        return "dtype"
    parts = []
    for p in transformers.__version__.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return "dtype" if tuple(parts) >= (4, 56) else "torch_dtype"


def _dtype_of(dtype: Any, name: str) -> Optional[torch.dtype]:
    """Component ``name``'s dtype as Diffusers reads ``dtype``: one dtype for all, or a mapping of
    component names (``"default"`` for the others; float32 without one)."""
    if isinstance(dtype, Mapping):
        return dtype.get(name, dtype.get("default", torch.float32))
    return dtype


def _diffusers_keywords(kwargs: Dict[str, Any], dtype: Any, torch_dtype: Any) -> Any:
    """Takes Diffusers' loading keywords out of ``kwargs`` (what is left goes to the pipeline's
    constructor) and returns the one dtype (``dtype`` or its older name ``torch_dtype``)."""
    refused = sorted(k for k in kwargs if k in _REFUSED)
    if refused:
        raise DynamicOffloadConfigError(
            f"{', '.join(refused)}: Diffusers' loading keyword(s) that from_pretrained_pipeline_with_dynamic_offload "
            "does not take; load the pipeline with Diffusers and offload it with enable_pipeline_offload instead"
        )
    if dtype is not None and torch_dtype is not None:
        raise DynamicOffloadConfigError("dtype and torch_dtype are one setting (torch_dtype is its older name): pass only dtype")
    dtype = dtype if dtype is not None else torch_dtype
    for d in dtype.values() if isinstance(dtype, Mapping) else [dtype]:
        if d is not None and not isinstance(d, torch.dtype):
            raise DynamicOffloadConfigError(
                f"dtype must be a torch.dtype, or a mapping of component names to torch.dtype, not {dtype!r}"
            )
    return dtype


def _refuse_unknown(pipeline_class: Any, kwargs: Mapping[str, Any], specs: Mapping[str, Any]) -> None:
    """A keyword that is neither a loading keyword nor one the pipeline's constructor takes is
    refused by name (Diffusers' constructor would raise a bare ``TypeError``)."""
    import inspect

    from ..config import _config_field_names

    try:
        params = inspect.signature(pipeline_class.__init__).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(k for k in kwargs if k not in params and k not in specs)
    if not unknown:
        return
    fields = set(_config_field_names(DynamicOffloadConfig))
    if "settings" in unknown or any(k in fields for k in unknown):
        hint = "; offload settings go in config=DynamicOffloadConfig(...)"
    else:
        hint = ""
    raise TypeError(
        f"from_pretrained_pipeline_with_dynamic_offload got {', '.join(unknown)}: neither a loading keyword nor a "
        f"component of {getattr(pipeline_class, '__name__', pipeline_class)} "
        f"({', '.join(n for n in params if n != 'self')}){hint}"
    )


def from_pretrained_pipeline_with_dynamic_offload(
    path: Union[str, os.PathLike],
    *,
    pipeline_class: Any = None,
    config: Optional[DynamicOffloadConfig] = None,
    dtype: Any = None,
    torch_dtype: Any = None,
    dynamic_offload_config: Optional[DynamicOffloadConfig] = None,
    component_configs: Optional[Mapping[str, DynamicOffloadConfig]] = None,
    gpu_budget_gb: Union[float, Mapping[str, float], None] = None,
    device_map: Optional[Mapping[str, Any]] = None,
    revision: Optional[str] = None,
    variant: Optional[str] = None,
    **pipeline_kwargs: Any,
) -> DynamicOffloadPipelineResult:
    """Loads the Diffusers pipeline folder (or cached hub id) ``path``: every model component
    stored as safetensors (transformer or UNet, text encoders, VAE) goes the route
    ``config`` resolves for its name (its ``components`` policies included);
    components on an arena route stream from their checkpoints
    (:func:`from_pretrained_with_dynamic_offload`), the others are loaded by their class and
    handed to :func:`enable_offload`. Tokenizers, schedulers and other parts load as the pipeline
    would load them. ``pipeline_kwargs`` go to the pipeline's constructor (a component given
    there is used as is, not loaded), except Diffusers' own loading keywords, taken as
    ``DiffusionPipeline.from_pretrained`` takes them: ``dtype`` (``torch_dtype`` is its older
    name; one dtype, or a mapping of component names with ``"default"``), ``variant`` and
    ``use_safetensors``, ``low_cpu_mem_usage`` go to every model component (``disable_mmap`` to
    Diffusers ones; transformers components get ``dtype`` or ``torch_dtype`` as their version
    names it);
    ``revision`` and ``cache_dir`` find a hub id in the local cache (``local_files_only``,
    ``token``, ``proxies``, ``force_download`` are accepted: ddo does not download). Loading
    keywords for what this call does not do (``custom_pipeline``, ``quantization_config``,
    ``max_memory``, ...) are refused by name, as is a keyword the pipeline's constructor does not
    take.

    ``config`` is the :class:`DynamicOffloadConfig` (the keyword :func:`enable_offload` takes);
    ``dynamic_offload_config`` is the published library's name for it (not both).
    ``component_configs`` gives named components their own configuration instead (what
    :func:`ddo.load` passes from its plan).

    ``gpu_budget_gb`` is split among the components on ``vmm_fast_runtime`` in proportion to
    their weight bytes as loaded (floating tensors counted in ``dtype`` when given) (each
    gets ``vmm_resident_weight_budget_gb`` = its share); components
    on ``linear_runtime`` take their execution slots plus ``resident_module_budget_gb``. A share
    too small for a component's working set raises :class:`DynamicOffloadCapacityError` naming
    it; a budget with no ``vmm_fast_runtime`` component to split among is refused.

    ``device_map`` places components on execution devices (``{"text_encoder_2": "cuda:1"}``;
    the others run on the config's ``execution_device``). With components on several GPUs,
    ``gpu_budget_gb`` may map each device to its own budget (``{"cuda:0": 10, "cuda:1": 20}``),
    split among the ``vmm_fast_runtime`` components on that device; every such component's
    device must be named, and every named device must run one. A number is split among all of
    them, whatever their devices.
    ``dtype`` and ``variant`` (``fp16``: the ``*.fp16.safetensors`` files) go to every model
    component, whatever its route.
    If any component fails, the ones already offloaded are removed and the error re-raised.

    Returns a :class:`DynamicOffloadPipelineResult`: ``.pipeline`` (the Diffusers pipeline, ready
    to call), ``.offload`` (each offloaded model component's :class:`DynamicOffloadApplyResult`,
    by component name), ``.budgets_gb`` (each ``vmm_fast_runtime`` component's share of
    ``gpu_budget_gb`` in GiB; empty without ``gpu_budget_gb``) and ``.devices`` (each component
    ``device_map`` placed, by name, as ``cuda:N`` / ``cpu``)."""
    config = config_keyword("from_pretrained_pipeline_with_dynamic_offload", config, dynamic_offload_config)
    own_configs: Dict[str, Optional[DynamicOffloadConfig]] = dict(component_configs or {})
    dtype = _diffusers_keywords(pipeline_kwargs, dtype, torch_dtype)
    finding = {k: pipeline_kwargs.pop(k) for k in _FINDING if k in pipeline_kwargs}
    per_component = {k: pipeline_kwargs.pop(k) for k in _PER_COMPONENT if k in pipeline_kwargs}
    streams_safetensors = per_component.get("use_safetensors") is not False
    root, index = read_index(path, revision, finding.get("cache_dir"))
    index_path = os.path.join(root, "model_index.json")
    if gpu_budget_gb is not None and not isinstance(gpu_budget_gb, Mapping) and (
        isinstance(gpu_budget_gb, bool) or not isinstance(gpu_budget_gb, numbers.Real)
    ):
        raise DynamicOffloadConfigError(
            f"gpu_budget_gb must be a number of GiB or a mapping of devices to GiB, not {gpu_budget_gb!r}"
        )
    if gpu_budget_gb is not None and not isinstance(gpu_budget_gb, Mapping):
        _gib(gpu_budget_gb, "gpu_budget_gb")
    if device_map is not None and not isinstance(device_map, Mapping):
        raise DynamicOffloadConfigError(
            f"device_map must map component names to devices ({{'text_encoder_2': 'cuda:1'}}), not {device_map!r}"
        )
    if pipeline_class is None:
        pipeline_class = _class_of("diffusers", str(index.get("_class_name")), index_path)
    specs = {k: v for k, v in index.items() if not k.startswith("_")}
    _refuse_unknown(pipeline_class, pipeline_kwargs, specs)
    devices = {n: _device_name(d, f"device_map[{n!r}]") for n, d in (device_map or {}).items()}
    modules: Dict[str, Any] = {}
    routes: Dict[str, str] = {}
    budget_settings: Dict[str, Optional[str]] = {}
    for component, spec in specs.items():
        if component in pipeline_kwargs or not _is_component(spec):
            continue
        loader = _class_of(spec[0], spec[1], f"{index_path} ({component})")
        if isinstance(loader, type) and issubclass(loader, torch.nn.Module):
            modules[component] = loader
            if streams_safetensors and _has_safetensors(os.path.join(root, component)):
                resolved = resolve_settings(component, config=own_configs.get(component, config))
                routes[component] = resolved.route_name
                budget_settings[component] = resolved.route_facts["budget_setting"]
    unknown = sorted(n for n in devices if n not in modules)
    if unknown:
        raise DynamicOffloadConfigError(
            f"device_map names {', '.join(unknown)}, which is not a model component this call loads (model components: "
            f"{', '.join(modules) or 'none'}); tokenizers and schedulers have no device"
        )

    def device_of(name: str) -> str:
        if name in devices:
            return devices[name]
        return _device_name(resolve_settings(name, config=own_configs.get(name, config)).device, f"the execution device of {name}")

    budgets: Dict[str, float] = {}
    if gpu_budget_gb is not None:
        arena = [n for n, s in budget_settings.items() if s == "vmm_resident_weight_budget_gb"]
        if not arena:
            raise DynamicOffloadConfigError(
                f"gpu_budget_gb={gpu_budget_gb} is split among components on vmm_fast_runtime, and none resolved to it "
                f"({', '.join(f'{n}: {r}' for n, r in routes.items()) or 'no safetensors model components'}); "
                "use backend='vmm', or leave gpu_budget_gb unset"
            )
        sizes = {n: _weight_bytes(variant_checkpoint(os.path.join(root, n), variant), _dtype_of(dtype, n)) for n in arena}
        budgets = _split_budgets(gpu_budget_gb, arena, sizes, {n: device_of(n) for n in arena})
    components: Dict[str, Any] = dict(pipeline_kwargs)
    offload: Dict[str, DynamicOffloadApplyResult] = {}
    progress = bar(specs.items(), total=len(specs), desc="ddo pipeline", unit="component")
    name: Optional[str] = None
    try:
        for name, spec in progress:
            progress.set_postfix_str(name, refresh=False)
            if name in components:
                continue
            if spec is None or (isinstance(spec, list) and spec == [None, None]):
                components[name] = None
                continue
            if not _is_component(spec):
                components[name] = spec  # a plain setting (boundary_ratio, requires_safety_checker)
                continue
            loader = _class_of(spec[0], spec[1], f"{index_path} ({name})")
            folder = os.path.join(root, name)
            if name not in modules:
                components[name] = loader.from_pretrained(folder)
                continue
            placed: Dict[str, Any] = {}
            config_here: Optional[DynamicOffloadConfig]
            base = own_configs.get(name, config)
            if name in devices:
                placed["execution_device"] = devices[name]
                config_here = (base or DynamicOffloadConfig()).replace(**placed)
            else:
                config_here = base
            dtype_kwargs: Dict[str, Any] = {"variant": variant} if variant else {}
            if _dtype_of(dtype, name) is not None:
                keyword = _transformers_dtype_keyword() if spec[0] == "transformers" else "torch_dtype"
                dtype_kwargs[keyword] = _dtype_of(dtype, name)
            if budget_settings.get(name) is not None:
                own = (
                    (config_here or DynamicOffloadConfig()).replace(vmm_resident_weight_budget_gb=budgets[name])
                    if name in budgets
                    else config_here
                )
                try:
                    loaded = from_pretrained_with_dynamic_offload(
                        folder, model_loader=loader, apply_dynamic=True, component=name, config=own,
                        **dtype_kwargs,
                    )
                except DynamicOffloadCapacityError as e:
                    if name not in budgets:
                        raise
                    raise DynamicOffloadCapacityError(
                        f"{name}: its share of gpu_budget_gb={gpu_budget_gb} is {budgets[name]:.4f} GiB (by weight bytes), "
                        f"too small: {e}; raise gpu_budget_gb"
                    ) from None
                components[name] = loaded.module
                assert loaded.offload is not None  # apply_dynamic=True attached it
                offload[name] = loaded.offload
            else:
                mine = {k: v for k, v in per_component.items() if k != "disable_mmap" or spec[0] != "transformers"}
                module = loader.from_pretrained(folder, **dtype_kwargs, **mine)
                offload[name] = enable_offload(module, component=name, config=config_here)
                components[name] = module
        name = None
        pipeline = pipeline_class(**components)
    except BaseException as error:
        if isinstance(error, DynamicOffloadError) and name in modules and hasattr(error, "add_note"):
            with contextlib.suppress(Exception):
                error.add_note(f"while loading component {name} of {root} (on {device_of(name)})")
        for r in offload.values():
            with contextlib.suppress(Exception):
                r.remove()
        raise
    return DynamicOffloadPipelineResult(pipeline=pipeline, offload=offload, budgets_gb=budgets, devices=devices)
