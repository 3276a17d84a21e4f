"""Entry points for Diffusers hosts: offload a component or a pipeline's components, load a model
and offload it, remove an offload, observe host memory. What they return is in :mod:`ddo.results`,
how models are loaded in :mod:`ddo.loaders`."""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

import torch

from . import _native
from . import profiles as _profiles
from .config import DynamicOffloadConfig
from .errors import DynamicOffloadError
from .loaders import checkpoint as _checkpoint, gguf as _gguf, model as _model
from .log import get_logger, info
from .metrics import DynamicOffloadMetrics
from .progress import bar
from .results import (
    _STATE_ATTR,
    DiffusersGroupOffloadResult,
    DynamicOffloadApplyResult,
    DynamicOffloadLoadResult,
    claim,
    offloaded_relative,
    release,
)
from .runtime import SessionRuntime, StreamedWeight
from .settings import DynamicOffloadSettings, resolve_settings

__all__ = [
    "DiffusersGroupOffloadResult",
    "DynamicOffloadApplyResult",
    "DynamicOffloadLoadResult",
    "apply_dynamic_offload",
    "enable_diffusers_group_offload",
    "enable_dynamic_offload",
    "enable_offload",
    "enable_pipeline_offload",
    "from_pretrained_with_dynamic_offload",
    "inspect_host_memory",
    "remove_dynamic_offload",
]

_log = get_logger(__name__)


def _default_device() -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _refuse_training(module: torch.nn.Module) -> None:
    if module.training:
        raise DynamicOffloadError(
            f"{type(module).__name__} is in training mode; ddo offloads inference only: call module.eval() first"
        )


def _host_memory(phase: str) -> Dict[str, Any]:
    out = json.loads(_native.observe_host_memory())
    out["phase"] = phase
    return out



class _Default(str):
    """A keyword's published default, told apart from the same value passed explicitly: left at
    its default, the layers below (``DDO_*`` variables, the preset) still decide."""

    __slots__ = ()


_AUTO = _Default("auto")
_CUDA0 = _Default("cuda:0")


def _given(value: Any) -> bool:
    return value is not None and not isinstance(value, _Default)



def enable_diffusers_group_offload(
    module: torch.nn.Module,
    *,
    onload_device: Union[str, torch.device] = _CUDA0,
    offload_device: Union[str, torch.device] = "cpu",
    offload_type: str = "leaf_level",
    use_stream: bool = True,
    record_stream: bool = False,
    low_cpu_mem_usage: bool = True,
    num_blocks_per_group: int = 1,
    apply_hook: bool = True,
    record_event: Optional[Callable[[str, Dict[str, Any]], Any]] = None,
    event_name: str = "setup_diffusers_group_offload",
) -> DiffusersGroupOffloadResult:
    """Applies Diffusers' own group offload hooks (``apply_group_offloading``). Left at its
    default, ``onload_device`` is ``cuda:0``, or the CPU on a machine without CUDA; streams are
    turned off on a CPU execution device. ``apply_hook=False`` only builds the payload;
    ``record_event(event_name, payload)`` is called with it."""
    device = torch.device(onload_device if _given(onload_device) else _default_device())
    if device.type != "cuda":
        use_stream, record_stream = False, False
    kwargs: Dict[str, Any] = dict(
        onload_device=device,
        offload_device=torch.device(offload_device),
        offload_type=offload_type,
        use_stream=use_stream,
        record_stream=record_stream,
        low_cpu_mem_usage=low_cpu_mem_usage,
    )
    if offload_type == "block_level":
        kwargs["num_blocks_per_group"] = num_blocks_per_group
    if apply_hook:
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(module, **kwargs)
    applied = {k: kwargs[k] for k in ("offload_type", "use_stream", "record_stream", "low_cpu_mem_usage")}
    if offload_type == "block_level":
        applied["num_blocks_per_group"] = num_blocks_per_group
    if record_event is not None:
        record_event(event_name, dict(applied))
    return DiffusersGroupOffloadResult(module=module, event_payload=applied)


def enable_offload(
    module: torch.nn.Module,
    *,
    settings: Optional[DynamicOffloadSettings] = None,
    config: Optional[DynamicOffloadConfig] = None,
    component: str = "model",
    preset: str = _AUTO,
    route: Optional[str] = None,
    group_offload: Optional[bool] = None,
    dynamic_offload: Optional[bool] = None,
    offload_type: Optional[str] = None,
    use_stream: Optional[bool] = None,
    record_stream: Optional[bool] = None,
    group_low_cpu_mem_usage: Optional[bool] = None,
    num_blocks_per_group: Optional[int] = None,
    execution_device: Union[str, torch.device] = _CUDA0,
    offload_device: Union[str, torch.device] = "cpu",
    low_cpu_mem_usage: bool = True,
    running_on_wsl: Optional[bool] = None,
    environ: Optional[Mapping[str, str]] = None,
    use_environment: bool = True,
    apply_hook: bool = True,
    record_event: Optional[Callable[[str, Dict[str, Any]], Any]] = None,
    dynamic_event_name: Optional[str] = None,
    group_event_name: Optional[str] = None,
    **config_overrides: Any,
) -> DynamicOffloadApplyResult:
    """Offloads one component by its resolved route (see the README's route table):
    ``linear_runtime`` (default), ``linear_convolution`` (``route="linear_convolution"``),
    ``vmm_fast_runtime`` (``backend="vmm"``) and ``vmm_runtime`` (preset ``nvme_baseline``) (the
    module of these two must come from :func:`from_pretrained_with_dynamic_offload`),
    ``diffusers_group_offload`` or ``none``.

    Explicit keywords beat ``config``, which beats component policies, ``DDO_<COMPONENT>_*``,
    ``DDO_*``, the preset and defaults; ``config_overrides`` are config field names (``backend``
    among them; an unknown one is a ``TypeError``). ``preset`` and ``execution_device`` left at
    their defaults (``auto``, ``cuda:0``) let ``DDO_PRESET`` / ``DDO_EXECUTION_DEVICE`` decide;
    without CUDA the default device is the CPU (the host backend). ``settings`` (from
    :func:`load_dynamic_offload_settings_from_env`) is used as resolved, re-resolved for this
    ``component`` when it was resolved for another. ``group_low_cpu_mem_usage`` is the
    component's Diffusers ``low_cpu_mem_usage``; ``low_cpu_mem_usage=False`` applies when that
    is unset. ``apply_hook=False`` resolves and reports without touching the module;
    ``record_event(name, payload)`` receives the setup event (``dynamic_event_name`` /
    ``group_event_name``). Bad settings raise :class:`DynamicOffloadConfigError`; a module that
    cannot be offloaded raises :class:`DynamicOffloadError`; in both cases the module is left as
    it was.
    """
    _refuse_misplaced_config("enable_offload", config_overrides)
    _check_types(module=module, config=config, settings=settings, environ=environ)
    why = offloaded_relative(module)
    if why is not None:
        raise DynamicOffloadError(f"{why}; call remove_dynamic_offload on it first")
    arguments: Dict[str, Any] = {k: v for k, v in config_overrides.items()}
    if "target_module_classes" in arguments:
        arguments["target_module_classes"] = [
            c if isinstance(c, str) else c.__name__ for c in arguments["target_module_classes"]
        ]
    for k, v in (("preset", preset), ("route", route)):
        if _given(v):
            arguments[k] = v
    if _given(execution_device):
        arguments["execution_device"] = str(execution_device)
    if _device_type(offload_device) != "cpu":
        arguments["offload_device"] = str(offload_device)
    if group_low_cpu_mem_usage is None and not low_cpu_mem_usage:
        group_low_cpu_mem_usage = False
    group = {
        "group_offload": group_offload,
        "dynamic_offload": dynamic_offload,
        "offload_type": offload_type,
        "use_stream": use_stream,
        "record_stream": record_stream,
        "low_cpu_mem_usage": group_low_cpu_mem_usage,
        "num_blocks_per_group": num_blocks_per_group,
    }
    if settings is not None:
        # As published: keywords and overrides apply on top of the settings.
        settings = settings.resolved_again(
            component, arguments=arguments, group=group, config=config, environ=environ, use_environment=use_environment
        )
    else:
        settings = resolve_settings(
            component,
            arguments=arguments,
            group=group,
            config=config,
            environ=environ,
            use_environment=use_environment,
            running_on_wsl=running_on_wsl,
        )
    settings, capacity_profile = _profiles.apply_capacity_profile(module, settings)
    device = torch.device(settings.device)
    name = settings.route_name
    if device.type == "cuda":
        if settings.runs_in_session and not _native.cuda_driver_present():
            raise DynamicOffloadError(
                f"route {name} on {device} needs a CUDA driver and none was found; use "
                "execution_device='cpu' (the host backend) on machines without an NVIDIA GPU"
            )
        if not torch.cuda.is_available():
            raise DynamicOffloadError(f"execution device {device} is not available: PyTorch sees no CUDA device")
    for w in settings.warnings:
        warnings.warn(f"ddo: {w}", stacklevel=2)
    result = DynamicOffloadApplyResult(
        module=module, route=settings.route_facts["published_name"], settings=settings, execution_device=device, runtime_route=name
    )
    result.capacity_profile = capacity_profile
    if not apply_hook:
        result.applied = False
        _record(record_event, result, dynamic_event_name, group_event_name)
        return result
    claim(module)
    try:
        t = time.perf_counter()
        setup = _attach(result, module, settings, device, name)
        setup["setup_seconds"] = time.perf_counter() - t
        result.setup = setup
        setattr(module, _STATE_ATTR, result)
        verbose = bool(settings.values.get("verbose"))
        info(_log, f"[ddo] {component}: route {name} on {device}", shown=verbose)
        if verbose and result.runtime is not None:
            info(_log, result.metrics_snapshot().format_profile().rstrip("\n"), shown=True)
        _record(record_event, result, dynamic_event_name, group_event_name)
    except BaseException:
        # All or nothing: whatever was applied is removed again, and the module is free.
        with contextlib.suppress(BaseException):
            result.remove()
        release(module)
        raise
    return result


def _attach(
    result: DynamicOffloadApplyResult,
    module: torch.nn.Module,
    settings: DynamicOffloadSettings,
    device: torch.device,
    name: str,
) -> Dict[str, Any]:
    """Applies the resolved route to ``module``; returns the setup section."""
    setup: Dict[str, Any] = {}
    if settings.runs_in_session:
        _refuse_training(module)
        source = getattr(module, "_ddo_source", None)
        checkpoint = None
        if settings.route_facts["reads_checkpoint"]:
            if source is None:
                raise DynamicOffloadError(
                    f"route {name} streams weights from the checkpoint: load the component with "
                    "ddo.from_pretrained_with_dynamic_offload"
                )
            checkpoint = source["path"]
        runtime = SessionRuntime(module, settings.native, checkpoint=checkpoint)
        runtime.attach()
        result.runtime = runtime
        result.source = source
    elif name == "diffusers_group_offload":
        _refuse_training(module)
        g = settings.route
        applied = enable_diffusers_group_offload(
            module,
            onload_device=device,
            offload_type=g["offload_type"],
            use_stream=g["use_stream"],
            record_stream=g["record_stream"],
            low_cpu_mem_usage=g["low_cpu_mem_usage"],
            num_blocks_per_group=g["num_blocks_per_group"],
        ).event_payload
        setup["group_offload"] = applied

        def count(_m: torch.nn.Module, _args: tuple) -> None:
            result.passes += 1

        result.handles.append(module.register_forward_pre_hook(count))
    elif name == "none":
        placement = settings.route.get("placement", "resident")
        if placement == "resident":
            module.to(device)
        setup["placement"] = placement
    else:
        raise DynamicOffloadError(f"route {name} (preset {settings.effective_preset}) is not built yet; use preset auto")
    return setup


def _refuse_misplaced_config(call: str, overrides: Mapping[str, Any]) -> None:
    """A ``dynamic_offload_config=`` given to a call that takes the configuration as ``config=``
    is refused naming the keyword (not as an unknown config field)."""
    if "dynamic_offload_config" in overrides:
        raise TypeError(
            f"{call} takes the DynamicOffloadConfig as config=..., not dynamic_offload_config= "
            "(the loaders take config= too, and dynamic_offload_config= as the published library's name)"
        )


def config_keyword(
    call: str, config: Any, dynamic_offload_config: Optional[DynamicOffloadConfig]
) -> Optional[DynamicOffloadConfig]:
    """The one configuration a loader was given, as ``config=`` or as the published library's
    ``dynamic_offload_config=``; both at once is refused."""
    if config is not None and dynamic_offload_config is not None:
        raise TypeError(
            f"{call} got the configuration twice, as config= and as dynamic_offload_config= (its published name): "
            "pass it once, as config="
        )
    return config if config is not None else dynamic_offload_config


def _device_type(device: Any) -> str:
    """``cpu`` for any form of the host (``"cpu"``, ``"cpu:0"``, ``torch.device("cpu", 0)``)."""
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        return str(device)


def _check_types(**values: Any) -> None:
    """Arguments of the wrong kind, refused with what is expected (before anything happens)."""
    expected = {
        "module": (torch.nn.Module, "a torch.nn.Module"),
        "config": (DynamicOffloadConfig, "a ddo.DynamicOffloadConfig (build one with ddo.DynamicOffloadConfig(**fields))"),
        "settings": (DynamicOffloadSettings, "ddo.DynamicOffloadSettings (from load_dynamic_offload_settings_from_env)"),
        "environ": (Mapping, "a mapping of variable names to values"),
    }
    for name, value in values.items():
        kind, text = expected[name]
        if value is None and name != "module":
            continue
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be {text}, not {type(value).__name__}")


def _record(
    record_event: Optional[Callable[[str, Dict[str, Any]], Any]],
    result: DynamicOffloadApplyResult,
    dynamic_event_name: Optional[str],
    group_event_name: Optional[str],
) -> None:
    """Hands the setup event to the host's recorder, named by route."""
    if record_event is None:
        return
    if result.route == "diffusers_group_offload":
        name = group_event_name or "setup_diffusers_group_offload"
    elif result.route == "dynamic_offload":
        name = dynamic_event_name or "setup_dynamic_offload"
    else:
        name = "setup_no_offload"
    record_event(name, result.event_payload)



def remove_dynamic_offload(module: torch.nn.Module, recurse: bool = True) -> None:
    """Removes ddo from ``module`` (a no-op when it is not offloaded) and, with ``recurse``,
    from every submodule offloaded on its own."""
    _check_types(module=module)
    targets = list(module.modules()) if recurse else [module]
    for m in targets:
        result = getattr(m, _STATE_ATTR, None)
        if result is not None:
            result.remove()


_FALLBACK_COMPONENTS = ("text_encoder", "text_encoder_2", "transformer", "unet", "vae")


def enable_pipeline_offload(
    pipeline: Any,
    *,
    settings: Optional[DynamicOffloadSettings] = None,
    components: Union[Sequence[str], Mapping[str, Any], None] = None,
    preset: str = _AUTO,
    execution_device: Union[str, torch.device] = _CUDA0,
    offload_device: Union[str, torch.device] = "cpu",
    low_cpu_mem_usage: bool = True,
    running_on_wsl: Optional[bool] = None,
    environ: Optional[Mapping[str, str]] = None,
    use_environment: bool = True,
    apply_hook: bool = True,
    record_event: Optional[Callable[[str, Dict[str, Any]], Any]] = None,
    config: Optional[DynamicOffloadConfig] = None,
    **config_overrides: Any,
) -> Dict[str, DynamicOffloadApplyResult]:
    """Offloads every ``torch.nn.Module`` component of a Diffusers pipeline by its own resolved
    route (VAE and text-encoder defaults included). ``components`` is a list of names, or a
    mapping of names to modules; by default the pipeline's ``components``, else its
    ``text_encoder``, ``text_encoder_2``, ``transformer``, ``unet`` and ``vae`` attributes.
    Components that are not modules are skipped. A component left unmanaged by its route is
    moved to the execution device (``setup`` records ``unmanaged_module_moved_to_execution_device``).
    If one component fails, the ones already done are removed again and the error re-raised."""
    if isinstance(components, (str, bytes)):
        raise TypeError(f"components is a list of names or a mapping of names to modules, not the string {components!r}")
    if isinstance(components, Mapping):
        items: Mapping[str, Any] = dict(components)
        names = list(items)
    else:
        items = getattr(pipeline, "components", None) or {
            n: getattr(pipeline, n) for n in _FALLBACK_COMPONENTS if getattr(pipeline, n, None) is not None
        }
        if not items and components is None:
            raise DynamicOffloadError(
                "the pipeline has no .components mapping and none of text_encoder, text_encoder_2, transformer, "
                "unet, vae; pass components={name: module}"
            )
        names = list(components) if components is not None else list(items.keys())
        missing = [n for n in names if n not in items]
        if missing:
            raise DynamicOffloadError(f"the pipeline has no component(s) {', '.join(missing)}; it has {', '.join(items)}")
    modules = [n for n in names if isinstance(items.get(n), torch.nn.Module)]
    keywords: Dict[str, Any] = dict(
        settings=settings,
        running_on_wsl=running_on_wsl,
        environ=environ,
        use_environment=use_environment,
        apply_hook=apply_hook,
        record_event=record_event,
        preset=preset,
        execution_device=execution_device,
        offload_device=offload_device,
        low_cpu_mem_usage=low_cpu_mem_usage,
        config=config,
        **config_overrides,
    )
    done: Dict[str, DynamicOffloadApplyResult] = {}
    try:
        with bar(modules, desc="ddo offload", unit="component") as progress:
            for name in progress:
                progress.set_postfix_str(name, refresh=False)
                done[name] = enable_offload(items[name], component=name, **keywords)
                r = done[name]
                if apply_hook and r.should_move_to_execution_device:
                    items[name].to(r.execution_device)
                    r.setup["unmanaged_module_moved_to_execution_device"] = True
    except BaseException:
        for r in done.values():
            with contextlib.suppress(Exception):
                r.remove()
        raise
    return done



_TARGET_CLASSES = (torch.nn.Linear, torch.nn.Embedding)


def enable_dynamic_offload(
    module: torch.nn.Module,
    *,
    component: str = "model",
    settings: Optional[DynamicOffloadSettings] = None,
    config: Optional[DynamicOffloadConfig] = None,
    preset: str = _AUTO,
    execution_device: Union[str, torch.device] = _CUDA0,
    offload_device: Union[str, torch.device] = "cpu",
    target_module_classes: Sequence[type] = _TARGET_CLASSES,
    skip_modules_pattern: Sequence[str] = (),
    always_resident_modules_pattern: Union[str, Sequence[str], None] = None,
    running_on_wsl: Optional[bool] = None,
    environ: Optional[Mapping[str, str]] = None,
    use_environment: bool = True,
    apply_hook: bool = True,
    record_event: Optional[Callable[[str, Dict[str, Any]], Any]] = None,
    event_name: str = "setup_dynamic_offload",
    **config_overrides: Any,
):
    """ddo's runtime route for ``module`` whatever its component's preset default
    (:func:`enable_offload` with ``route="dynamic_offload"``). ``target_module_classes`` other
    than ``(Linear, Embedding)`` and a non-empty ``skip_modules_pattern`` are refused with what
    ddo does instead (it streams every parameter of each block)."""
    overrides = dict(config_overrides)
    if tuple(target_module_classes) != _TARGET_CLASSES:
        overrides["target_module_classes"] = [c if isinstance(c, str) else c.__name__ for c in target_module_classes]
    if tuple(skip_modules_pattern):
        overrides["skip_modules_pattern"] = list(skip_modules_pattern)
    if always_resident_modules_pattern is not None:
        p = always_resident_modules_pattern
        overrides["always_resident_modules_pattern"] = [p] if isinstance(p, str) else list(p)
    _refuse_misplaced_config("enable_dynamic_offload", overrides)
    # No component route default applies here: the route is ddo's runtime, on top of settings too.
    overrides.update(route="dynamic_offload", preset=preset, execution_device=execution_device, config=config)
    return enable_offload(
        module,
        component=component,
        settings=settings,
        offload_device=offload_device,
        running_on_wsl=running_on_wsl,
        environ=environ,
        use_environment=use_environment,
        apply_hook=apply_hook,
        record_event=record_event,
        dynamic_event_name=event_name,
        **overrides,
    )


def apply_dynamic_offload(module: torch.nn.Module, config: Optional[DynamicOffloadConfig] = None):
    """Attaches ddo's runtime route to ``module`` with ``config`` and returns what runs it
    (``result.hook``); :func:`remove_dynamic_offload` detaches it."""
    return enable_offload(module, config=config, route="dynamic_offload").hook



def from_pretrained_with_dynamic_offload(
    pretrained_model_name_or_path: Union[str, os.PathLike],
    *,
    model_loader: Any = None,
    subfolder: Optional[str] = None,
    gguf_file: Union[str, os.PathLike, None] = None,
    config: Any = None,
    dynamic_offload_config: Optional[DynamicOffloadConfig] = None,
    apply_dynamic: bool = False,
    component: str = "model",
    profile_name: Optional[str] = None,
    build_profile: Optional[bool] = None,
    **from_pretrained_kwargs: Any,
) -> DynamicOffloadLoadResult:
    """Validates the checkpoint (every header, before any load), builds the model (``model_loader``,
    by default the class its ``config.json`` names: a Diffusers ``_class_name``, else the first
    transformers ``architectures`` entry), binds each parameter to its checkpoint slice by name,
    and with ``apply_dynamic`` offloads it. On the native and disk routes with ``apply_dynamic``
    the model is built without weights and every weight streams from the checkpoint; otherwise it
    is loaded with ``model_loader.from_pretrained``.
    A corrupt checkpoint raises :class:`DynamicOffloadError` naming the file and tensor.

    ``gguf_file`` (a file in the folder, or a path; by default the folder's one ``*.gguf`` when it
    holds no safetensors) loads a GGUF file with Diffusers parameter names, the model's
    ``config.json`` in the folder, as Diffusers' ``from_single_file(gguf_file, config=folder,
    quantization_config=GGUFQuantizationConfig(compute_dtype=torch_dtype))`` loads it: on the
    native route its tensors stream as they are stored (quantized ones as ``GGUFParameter`` s that
    ``GGUFLinear`` dequantizes in its forward); on the linear route through ``from_single_file``.

    ``config`` is the offload's :class:`DynamicOffloadConfig` (the keyword :func:`enable_offload`
    takes); ``dynamic_offload_config`` is the published library's name for it (not both). A
    ``config`` that is not a ``DynamicOffloadConfig`` (a transformers ``PretrainedConfig``) goes to
    ``model_loader.from_pretrained`` as before.

    ``profile_name`` / ``build_profile`` set those config fields of the offload (a named capacity
    profile, :mod:`ddo.profiles`); they need ``apply_dynamic=True``."""
    if config is not None and not isinstance(config, DynamicOffloadConfig):
        from_pretrained_kwargs["config"] = config
        config = None
    dynamic_offload_config = config_keyword("from_pretrained_with_dynamic_offload", config, dynamic_offload_config)
    if profile_name is not None or build_profile is not None:
        if not apply_dynamic:
            raise _native.DynamicOffloadConfigError(
                "profile_name and build_profile configure the offload: pass apply_dynamic=True with them"
            )
        chosen = {k: v for k, v in (("profile_name", profile_name), ("build_profile", build_profile)) if v is not None}
        dynamic_offload_config = (dynamic_offload_config or DynamicOffloadConfig()).replace(**chosen)
    # One step per stage Python drives: validate (every header), load (build the module), attach.
    stages = bar(total=3 if apply_dynamic else 2, desc=f"ddo {component}", unit="stage", leave=False)
    stages.set_postfix_str("validate")
    clock = time.perf_counter()
    seconds: Dict[str, float] = {}
    path = _checkpoint.local_path(pretrained_model_name_or_path, from_pretrained_kwargs.get("revision"))
    folder = os.path.join(path, subfolder) if subfolder else path
    gguf_path = _gguf.gguf_path(folder, gguf_file, from_pretrained_kwargs.get("variant"))
    checkpoint = gguf_path or _checkpoint.variant_checkpoint(folder, from_pretrained_kwargs.get("variant"))
    source = _checkpoint.association(checkpoint)
    gguf_tensors = _gguf.gguf_tensors(folder, gguf_path) if gguf_path else None
    if model_loader is None:
        model_loader = _checkpoint.loader_of(folder)
    elif not (hasattr(model_loader, "from_pretrained") or hasattr(model_loader, "from_config")):
        raise TypeError(
            f"model_loader must be a model class with from_pretrained (a Diffusers or transformers class), not "
            f"{type(model_loader).__name__}"
        )
    if gguf_path and _checkpoint.is_transformers(model_loader):
        raise DynamicOffloadError(
            f"{gguf_path}: ddo loads GGUF files of Diffusers models; transformers models load GGUF through their own "
            "from_pretrained(gguf_file=...) (dequantized), then enable_offload"
        )
    if subfolder and not gguf_path:
        from_pretrained_kwargs["subfolder"] = subfolder
    ahead = None
    try:
        settings = resolve_settings(component, config=dynamic_offload_config) if apply_dynamic else None
        # A cold checkpoint the mapping tier will serve is read while the module is built.
        ahead = _checkpoint.read_ahead(settings, source["files"]) if settings is not None else None
        result = _load_and_attach(
            stages, seconds, clock, settings, path, folder, checkpoint, source, gguf_path, gguf_tensors,
            model_loader, apply_dynamic, component, dynamic_offload_config, from_pretrained_kwargs,
        )
    finally:
        read_ahead_bytes = ahead.stop() if ahead is not None else 0
        stages.close()
    result.stage_seconds = seconds
    result.read_ahead_bytes = read_ahead_bytes
    return result



def _load_and_attach(
    stages: Any, seconds: Dict[str, float], clock: float, settings: Any, path: str, folder: str, checkpoint: str,
    source: Dict[str, Any], gguf_path: Optional[str], gguf_tensors: Any, model_loader: Any, apply_dynamic: bool,
    component: str, dynamic_offload_config: Optional[DynamicOffloadConfig], from_pretrained_kwargs: Dict[str, Any],
) -> DynamicOffloadLoadResult:
    seconds["validate"] = time.perf_counter() - clock
    stages.update()
    stages.set_postfix_str("load")
    module = _model.build_module(
        settings, path, folder, gguf_path, gguf_tensors, model_loader, apply_dynamic, from_pretrained_kwargs
    )
    bound = _model.bind_source(module, source, checkpoint, gguf_path)
    result = DynamicOffloadLoadResult(module=module, source=source, bound=bound)
    seconds["load"] = time.perf_counter() - clock - seconds["validate"]
    stages.update()
    if apply_dynamic:
        stages.set_postfix_str("attach")
        module.eval()
        attaching = time.perf_counter()
        result.offload = enable_offload(module, component=component, config=dynamic_offload_config)
        result.offload.source = source
        seconds["attach"] = time.perf_counter() - attaching
        stages.update()
    return result



def inspect_host_memory(
    module: Optional[torch.nn.Module] = None, *, phase: str = "", max_storage_samples: int = 16
) -> DynamicOffloadMetrics:
    """Route ``host_memory_observation``: this process's RSS and the host's limits, and with
    ``module`` a census of its host (CPU) parameter and buffer storages, grouped by storage, with
    up to ``max_storage_samples`` of the largest (bytes, tensor names, and the checkpoint file a
    storage is bound to when the module came from :func:`from_pretrained_with_dynamic_offload`).
    Never touches CUDA."""
    if max_storage_samples < 0:
        raise ValueError(f"max_storage_samples must be >= 0, not {max_storage_samples}")
    setup: Dict[str, Any] = {}
    if module is not None:
        storages: Dict[tuple, Dict[str, Any]] = {}
        tensors = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
        for name, t in tensors:
            if t.device.type != "cpu" or t.is_meta or isinstance(t, StreamedWeight):
                continue
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            entry = storages.setdefault(key, {"bytes": storage.nbytes(), "tensors": []})
            entry["tensors"].append(name)
        source = getattr(module, "_ddo_source", None) or {}
        files = {t["name"]: t.get("file") for t in source.get("tensors", [])}
        samples = sorted(storages.values(), key=lambda e: -e["bytes"])[:max_storage_samples]
        for e in samples:
            shard = next((files[n] for n in e["tensors"] if files.get(n)), None)
            if shard:
                e["shard"] = shard
        setup = {
            "host_storage_groups": len(storages),
            "host_storage_bytes": sum(e["bytes"] for e in storages.values()),
            "host_storage_samples": samples,
        }
    return DynamicOffloadMetrics(route="host_memory_observation", setup=setup, host_memory=_host_memory(phase or "inspect"))
