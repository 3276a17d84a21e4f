"""``python -m ddo bench``: one Diffusers model folder, or one ``.safetensors`` checkpoint file with
its model's ``config.json``, run on several routes side by side, each route's output checked
against the resident run's bit for bit.

Routes: ``resident`` (the plain module on the device), ``linear`` (:func:`ddo.enable_offload`,
``linear_runtime``), ``vmm`` (:func:`ddo.from_pretrained_with_dynamic_offload` on
``vmm_fast_runtime`` under a GPU weight budget) and ``diffusers_leaf`` (Diffusers'
``apply_group_offloading`` at leaf level, with a stream on CUDA). Every route loads the model
anew in this process, runs one warm-up forward and then ``steps`` timed ones."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import _native
from ..errors import DynamicOffloadError

__all__ = ["ROUTES", "BUILDERS", "RouteRow", "run_bench", "format_table"]

ROUTES = ("resident", "linear", "vmm", "diffusers_leaf")
GIB = 1 << 30

Inputs = Tuple[str, Dict[str, Any]]


def _flux(config: Dict[str, Any], resolution: int, g: torch.Generator) -> Inputs:
    """Batch 1 at ``resolution``: (resolution / 16)^2 image tokens (8x latents in 2x2 patches),
    512 text tokens."""
    tokens, text = (resolution // 16) ** 2, 512
    inputs = dict(
        hidden_states=torch.randn(1, tokens, config["in_channels"], generator=g),
        encoder_hidden_states=torch.randn(1, text, config["joint_attention_dim"], generator=g),
        pooled_projections=torch.randn(1, config["pooled_projection_dim"], generator=g),
        timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(tokens, 3),
        txt_ids=torch.zeros(text, 3),
        return_dict=False,
    )
    if config.get("guidance_embeds"):
        inputs["guidance"] = torch.tensor([3.5])
    return "forward", inputs


def _sd3(config: Dict[str, Any], resolution: int, g: torch.Generator) -> Inputs:
    """Batch 1 at ``resolution`` (8x latents), 333 text tokens (77 CLIP + 256 T5)."""
    patch = config.get("patch_size", 2)
    side = max(resolution // 8 // patch, 1) * patch
    return "forward", dict(
        hidden_states=torch.randn(1, config["in_channels"], side, side, generator=g),
        encoder_hidden_states=torch.randn(1, 333, config["joint_attention_dim"], generator=g),
        pooled_projections=torch.randn(1, config["pooled_projection_dim"], generator=g),
        timestep=torch.tensor([500.0]),
        return_dict=False,
    )


def _wan(config: Dict[str, Any], resolution: int, g: torch.Generator) -> Inputs:
    """Three latent frames of ``resolution`` x ``resolution`` (8x latents), 512 text tokens; an
    image-to-video model also gets 257 image tokens."""
    _, ph, pw = config.get("patch_size", (1, 2, 2))
    side = max(resolution // 8 // max(ph, pw), 1) * max(ph, pw)
    inputs = dict(
        hidden_states=torch.randn(1, config["in_channels"], 3, side, side, generator=g),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 512, config["text_dim"], generator=g),
        return_dict=False,
    )
    if config.get("image_dim"):
        inputs["encoder_hidden_states_image"] = torch.randn(1, 257, config["image_dim"], generator=g)
    return "forward", inputs


def _vae_decode(config: Dict[str, Any], resolution: int, g: torch.Generator) -> Inputs:
    """``decode`` of latents that make a ``resolution`` x ``resolution`` image."""
    scale = 2 ** (len(config["block_out_channels"]) - 1)
    side = max(resolution // scale, 1)
    return "decode", dict(z=torch.randn(1, config["latent_channels"], side, side, generator=g), return_dict=False)


# Input builders by the class a model folder's config.json names: (method, keyword arguments).
BUILDERS: Dict[str, Callable[[Dict[str, Any], int, torch.Generator], Inputs]] = {
    "FluxTransformer2DModel": _flux,
    "SD3Transformer2DModel": _sd3,
    "WanTransformer3DModel": _wan,
    "AutoencoderKL": _vae_decode,
}


@dataclasses.dataclass
class RouteRow:
    """One route's measurements. ``output`` is ``reference`` (the run others are compared to),
    ``equal``, ``differs``, or empty when the route did not run (``error`` says why)."""

    route: str
    runtime: str = ""
    setup_seconds: Optional[float] = None
    seconds: Optional[float] = None
    ratio: Optional[float] = None
    peak_gpu_bytes: Optional[int] = None
    arena_peak_bytes: Optional[int] = None
    host_rss_bytes: Optional[int] = None
    output: str = ""
    max_abs_difference: Optional[float] = None
    error: Optional[str] = None
    fits: bool = True


def _status(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Resets this process's VmHWM (Linux ``clear_refs`` 5) so each route's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _own_memory(module: torch.nn.Module) -> torch.nn.Module:
    """Every weight in an allocation of its own. A loader may leave weights as views into a file
    mapping at any offset, and CPU kernels take other code paths (rounding differently) for such
    addresses; a device copy, or the arena, is aligned."""
    with torch.no_grad():
        for p in module.parameters():
            p.data = p.data.clone()
    return module


def _component(class_name: str) -> str:
    return "vae" if class_name.startswith("Autoencoder") else "transformer"


def _runtime_route(offload: Any) -> str:
    """ddo's route of an offload (``linear_runtime``, ``vmm_fast_runtime``)."""
    return getattr(offload, "runtime_route", "") or offload.route


def _load(
    route: str, folder: str, loader: Any, device: torch.device, dtype: torch.dtype, budget_gb: float
) -> Tuple[torch.nn.Module, Any, str]:
    """The module of ``route`` ready to run on ``device``, its ddo offload (or ``None``) and the
    runtime it ended up on."""
    from ..api import enable_offload, from_pretrained_with_dynamic_offload
    from ..config import DynamicOffloadConfig

    component = _component(loader.__name__)
    if route == "vmm":
        config = DynamicOffloadConfig(
            backend="vmm", route="dynamic", vmm_resident_weight_budget_gb=budget_gb, execution_device=str(device)
        )
        loaded = from_pretrained_with_dynamic_offload(
            folder, model_loader=loader, apply_dynamic=True, component=component, torch_dtype=dtype,
            dynamic_offload_config=config,
        )
        return loaded.module, loaded.offload, f"{_runtime_route(loaded.offload)}, {budget_gb:g} GiB"
    module = loader.from_pretrained(folder, torch_dtype=dtype).eval()
    if route == "linear":
        offload = enable_offload(module, component=component, backend="linear", route="dynamic", execution_device=device)
        return module, offload, _runtime_route(offload)
    if device.type == "cpu":
        _own_memory(module)
    if route == "resident":
        return module.to(device), None, f"resident on {device}"
    from diffusers.hooks import apply_group_offloading

    stream = device.type == "cuda"
    apply_group_offloading(
        module, onload_device=device, offload_device=torch.device("cpu"), offload_type="leaf_level", use_stream=stream
    )
    return module, None, "diffusers leaf" + (" + stream" if stream else "")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(call: Callable[[], Any], steps: int, device: torch.device) -> Tuple[List[float], torch.Tensor]:
    """One warm-up call (kernels load; ddo learns the block order), then ``steps`` timed calls;
    the seconds of each and the last output."""
    with torch.no_grad():
        out = call()
        times = []
        for _ in range(steps):
            _synchronize(device)
            t = time.perf_counter()
            out = call()
            _synchronize(device)
            times.append(time.perf_counter() - t)
    return times, out


def _first_tensor(out: Any) -> torch.Tensor:
    while not isinstance(out, torch.Tensor):
        out = out[0]
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: same dtype and shape, same bytes (a NaN equals the same NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, getattr(torch.cuda, "OutOfMemoryError", ())) or "out of memory" in str(error)


def _model_folder(folder: str) -> Tuple[Any, Dict[str, Any]]:
    """The class ``folder``'s config.json names (it must have an input builder) and the config."""
    from ..loaders.checkpoint import loader_of

    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise DynamicOffloadError(
            f"{folder} has no config.json: pass a Diffusers model folder (config.json and its safetensors), such as a "
            "pipeline's transformer/ or vae/"
        )
    loader = loader_of(folder)
    if loader.__name__ not in BUILDERS:
        raise DynamicOffloadError(
            f"{folder}/config.json names {loader.__name__}; ddo bench builds inputs for {', '.join(sorted(BUILDERS))}: "
            "benchmark a folder of one of those classes"
        )
    try:
        return loader, dict(loader.load_config(folder))
    except (ValueError, OSError) as e:
        raise DynamicOffloadError(f"{folder}/config.json cannot be read as a Diffusers config ({e}): fix or replace it") from None


def _bench_device(device: Optional[str]) -> torch.device:
    """The device to run on: ``device``, else the first GPU, else the CPU; refused with what to
    pass when it is not one this process can use."""
    if device is not None and not device.strip():
        raise DynamicOffloadError("--device is empty: pass cuda, cuda:N or cpu, or leave it out for the first GPU")
    try:
        dev = torch.device(device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError) as e:
        raise DynamicOffloadError(f"--device {device!r} is not a device ({e}): pass cuda, cuda:N or cpu") from None
    if dev.type not in ("cuda", "cpu"):
        raise DynamicOffloadError(f"--device {dev}: ddo bench runs on cuda, cuda:N or cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DynamicOffloadError(f"device {dev} is not available: PyTorch sees no CUDA device; pass --device cpu")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise DynamicOffloadError(f"--device {dev}: PyTorch sees {torch.cuda.device_count()} CUDA device(s)")
        dev = torch.device("cuda", index)
        torch.empty(0, device=dev)  # the allocator's statistics exist once the device is initialized
    return dev


def _config_of_file(checkpoint: str, config: Optional[str]) -> str:
    """The ``config.json`` a checkpoint file is benchmarked with: ``config`` (the file, or a
    folder holding it), else the one beside the checkpoint; refused saying what to pass."""
    if config is not None:
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        if not os.path.isfile(path):
            raise DynamicOffloadError(
                f"--config {config}: no such file; pass the model's config.json (or a folder holding it, such as a "
                "pipeline's transformer/)"
            )
        return path
    beside = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "config.json")
    if not os.path.isfile(beside):
        raise DynamicOffloadError(
            f"{checkpoint} is a checkpoint file and there is no config.json beside it: pass --config with the model's "
            "config.json (or a folder holding it, such as a pipeline's transformer/), or benchmark the model folder"
        )
    return beside


def _model_source(path: str, config: Optional[str], stack: "contextlib.ExitStack") -> str:
    """The model folder to load ``path`` from. A folder is itself (``config`` is refused: the
    folder's own config.json is the model's). A ``.safetensors`` file gets a temporary folder
    holding links to it (as Diffusers' weights name) and to its config.json, so every route
    loads exactly that file; the folder goes when ``stack`` closes."""
    if os.path.isdir(path):
        if config is not None:
            raise DynamicOffloadError(
                f"--config is for a checkpoint file; {path} is a folder, whose own config.json is the model's: leave "
                "--config out"
            )
        return path
    if not os.path.isfile(path):
        raise DynamicOffloadError(
            f"{path}: no such file or folder; pass a Diffusers model folder (config.json and its safetensors) or a "
            ".safetensors checkpoint file"
        )
    if not path.endswith(".safetensors"):
        raise DynamicOffloadError(
            f"{path} is not a .safetensors file: pass a Diffusers model folder (config.json and its safetensors) or "
            "one .safetensors checkpoint file (with --config when no config.json is beside it)"
        )
    config_path = _config_of_file(path, config)
    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="ddo-bench-"))
    os.symlink(os.path.abspath(config_path), os.path.join(folder, "config.json"))
    os.symlink(os.path.abspath(path), os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    return folder


def denoiser_of(pipeline: str) -> Tuple[str, str]:
    """The denoiser component of the pipeline folder ``pipeline`` (``model_index.json``): its
    ``transformer`` or ``unet``, else the first model component of a class ddo bench builds
    inputs for; ``(name, folder)``."""
    try:
        with open(os.path.join(pipeline, "model_index.json"), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise DynamicOffloadError(f"{pipeline}/model_index.json cannot be read as JSON: {e}") from None
    specs = {k: v for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and len(v) == 2}
    named = [n for n in ("transformer", "unet") if n in specs] + [n for n, v in specs.items() if v[1] in BUILDERS]
    for name in named:
        if os.path.isfile(os.path.join(pipeline, name, "config.json")):
            return name, os.path.join(pipeline, name)
    raise DynamicOffloadError(
        f"{pipeline} is a pipeline folder with no denoiser ddo bench builds inputs for (transformer or unet of "
        f"{', '.join(sorted(BUILDERS))}); its components: {', '.join(specs) or 'none'}"
    )


def device_defaults(
    dev: torch.device, dtype: Optional[torch.dtype], resolution: Optional[int], steps: Optional[int]
) -> Tuple[torch.dtype, int, int, str]:
    """The dtype, resolution and steps to time on ``dev`` where not given, and a line saying
    what was picked and why: on a GPU 1024 px bfloat16 and 5 forwards (what pipelines run); on
    the CPU 256 px float32 and 2 forwards (CPU kernels are slow in bfloat16, and a 1024 px
    forward of a full-size model takes minutes there)."""
    cpu = dev.type == "cpu"
    auto = [k for k, given in (("dtype", dtype), ("resolution", resolution), ("steps", steps)) if given is None]
    chosen_dtype = dtype if dtype is not None else (torch.float32 if cpu else torch.bfloat16)
    chosen_resolution = resolution if resolution is not None else (256 if cpu else 1024)
    chosen_steps = steps if steps is not None else (2 if cpu else 5)
    if not auto:
        why = "as given"
    elif cpu:
        why = (
            f"{', '.join(auto)} picked for the CPU: small and float32, since CPU kernels are slow in bfloat16 and a "
            "full-size forward takes minutes there (pass --dtype/--resolution/--steps to choose)"
        )
    else:
        why = f"{', '.join(auto)} picked for {dev}: a pipeline's usual 1024 px in bfloat16 (pass --dtype/--resolution/--steps to choose)"
    return chosen_dtype, chosen_resolution, chosen_steps, why


def run_bench(
    checkpoint: str,
    *,
    routes: Tuple[str, ...] = ROUTES,
    steps: Optional[int] = None,
    device: Optional[str] = None,
    budget_gb: float = 3.0,
    dtype: Optional[torch.dtype] = None,
    resolution: Optional[int] = None,
    config: Optional[str] = None,
) -> Dict[str, Any]:
    """Runs every route of ``routes`` on the model in ``checkpoint`` (a model folder, a pipeline
    folder, whose denoiser is timed, or one ``.safetensors`` file whose model config is
    ``config`` or the ``config.json`` beside it) and returns the rows with what was run (a dict
    that JSON carries). ``dtype``, ``resolution`` and ``steps`` left out suit the device
    (:func:`device_defaults`). The reference output is the resident run's when it ran, else the
    first route's that did."""
    dev = _bench_device(device)
    dtype, resolution, steps, picked = device_defaults(dev, dtype, resolution, steps)
    if os.path.isfile(os.path.join(checkpoint, "model_index.json")):
        if config is not None:
            raise DynamicOffloadError(f"--config is for a checkpoint file; {checkpoint} is a pipeline folder: leave --config out")
        component, folder = denoiser_of(checkpoint)
        result = _run_bench(folder, routes, steps, str(dev), budget_gb, dtype, resolution)
        result["model"].update(pipeline=checkpoint, component=component)
        result["picked"] = picked
        return result
    with contextlib.ExitStack() as stack:
        folder = _model_source(checkpoint, config, stack)
        if folder == checkpoint:
            result = _run_bench(folder, routes, steps, str(dev), budget_gb, dtype, resolution)
            result["picked"] = picked
            return result
        config_path = os.path.realpath(os.path.join(folder, "config.json"))
        try:
            result = _run_bench(folder, routes, steps, str(dev), budget_gb, dtype, resolution)
        except DynamicOffloadError as e:
            # Name the files the user gave, not the temporary folder's links.
            text = str(e).replace(os.path.join(folder, "config.json"), config_path).replace(folder, checkpoint)
            raise DynamicOffloadError(text) from None
        result["model"].update(path=checkpoint, config=config_path)
        result["picked"] = picked
        return result


def _run_bench(
    folder: str,
    routes: Tuple[str, ...],
    steps: int,
    device: Optional[str],
    budget_gb: float,
    dtype: torch.dtype,
    resolution: int,
) -> Dict[str, Any]:
    from ..progress import bar

    unknown = [r for r in routes if r not in ROUTES]
    if unknown or not routes:
        raise DynamicOffloadError(f"unknown route(s) {', '.join(unknown) or '(none given)'}; choose among {', '.join(ROUTES)}")
    if steps < 1:
        raise DynamicOffloadError(f"--steps {steps}: time at least one forward")
    if not 16 <= resolution <= 16384 or resolution % 16:
        raise DynamicOffloadError(f"--resolution {resolution}: pass a multiple of 16 from 16 to 16384 pixels")
    if not math.isfinite(budget_gb) or budget_gb <= 0:
        raise DynamicOffloadError(f"--budget-gb {budget_gb}: pass a finite number of GiB above 0")
    loader, config = _model_folder(folder)
    dev = _bench_device(device)
    try:
        method, host_inputs = BUILDERS[loader.__name__](config, resolution, torch.Generator().manual_seed(0))
    except (KeyError, TypeError, ValueError, RuntimeError, ZeroDivisionError) as e:
        raise DynamicOffloadError(
            f"{folder}/config.json does not describe a {loader.__name__} ddo bench can build inputs for "
            f"({type(e).__name__}: {str(e)[:200]}): fix the config (it is the one Diffusers saves)"
        ) from None
    host_inputs = {
        k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and not k.endswith("_ids") else v
        for k, v in host_inputs.items()
    }
    stored = sum(int(t["len"]) for t in json.loads(_native.inspect_checkpoint(folder))["tensors"])
    rows: List[RouteRow] = []
    reference: Optional[torch.Tensor] = None
    for route in bar(list(routes), desc="ddo bench", unit="route", leave=False):
        row = RouteRow(route)
        rows.append(row)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        base, reset = _status("VmRSS"), _reset_peak_rss()
        module = offload = None
        try:
            t = time.perf_counter()
            module, offload, row.runtime = _load(route, folder, loader, dev, dtype, budget_gb)
            _synchronize(dev)
            row.setup_seconds = time.perf_counter() - t
            inputs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in host_inputs.items()}
            call = getattr(module, method)
            times, out = _timed(functools.partial(call, **inputs), steps, dev)
            row.seconds = statistics.median(times)
            output = _first_tensor(out).detach().cpu()
            if reference is None:
                reference, row.output = output, "reference"
            elif _same_bits(output, reference):
                row.output = "equal"
            else:
                row.output = "differs"
                if output.shape == reference.shape:
                    row.max_abs_difference = float((output.float() - reference.float()).abs().max())
            if dev.type == "cuda":
                row.peak_gpu_bytes = torch.cuda.max_memory_allocated(dev)
            if offload is not None and offload.runtime is not None:
                row.arena_peak_bytes = offload.metrics_snapshot().as_dict()["runtime"].get("peak_bytes")
                if row.peak_gpu_bytes is not None and row.arena_peak_bytes is not None and dev.type == "cuda":
                    row.peak_gpu_bytes += row.arena_peak_bytes
            peak = _status("VmHWM") if reset else _status("VmRSS")
            if peak is not None and base is not None:
                row.host_rss_bytes = max(peak - base, 0)
        except Exception as e:  # noqa: BLE001 - a route that fails is a row, the others still run
            row.fits = not (route == "resident" and _is_out_of_memory(e))
            row.error = f"{type(e).__name__}: {e}".splitlines()[0]
        finally:
            if offload is not None:
                offload.remove()
            del module, offload
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    resident = next((r for r in rows if r.route == "resident" and r.seconds), None)
    for r in rows:
        if resident is not None and resident.seconds and r.seconds is not None:
            r.ratio = r.seconds / resident.seconds
    return {
        "model": {"path": folder, "class": loader.__name__, "stored_bytes": stored},
        "device": str(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "resolution": resolution,
        "method": method,
        "steps": steps,
        "budget_gb": budget_gb,
        "rows": [dataclasses.asdict(r) for r in rows],
    }


def failed(result: Dict[str, Any]) -> bool:
    """Whether a route failed (a resident model that does not fit aside) or differs."""
    return any((r["error"] and r["fits"]) or r["output"] == "differs" for r in result["rows"])


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.2f} MiB"


def format_table(result: Dict[str, Any]) -> str:
    """The rows as a text table, then each failure's message."""
    m = result["model"]
    of = f" (the {m['component']} of the pipeline {m['pipeline']})" if m.get("pipeline") else ""
    lines = [
        f"ddo bench: {m['class']}.{result['method']} from {m['path']}{of} ({_size(m['stored_bytes'])} stored), "
        f"{result['dtype']} on {result['device']}, {result['resolution']} px, median of {result['steps']} forward(s) "
        "after one warm-up",
    ]
    if result.get("picked"):
        lines.append(f"  {result['picked']}")
    header = ("route", "runtime", "setup s", "s/forward", "x resident", "peak GPU GiB (arena)", "host RSS GiB", "output")
    table = [header]
    for r in result["rows"]:
        gpu = "-"
        if r["peak_gpu_bytes"] is not None:
            arena = f" ({r['arena_peak_bytes'] / GIB:.2f})" if r["arena_peak_bytes"] is not None else ""
            gpu = f"{r['peak_gpu_bytes'] / GIB:.2f}{arena}"
        output = r["output"] or ("does not fit" if not r["fits"] else "failed")
        if r["output"] == "differs" and r["max_abs_difference"] is not None:
            output += f" (max |diff| {r['max_abs_difference']:.3g})"
        table.append((
            r["route"],
            r["runtime"] or "-",
            f"{r['setup_seconds']:.2f}" if r["setup_seconds"] is not None else "-",
            f"{r['seconds']:.4f}" if r["seconds"] is not None else "-",
            f"{r['ratio']:.2f}" if r["ratio"] is not None else "-",
            gpu,
            f"{r['host_rss_bytes'] / GIB:.2f}" if r["host_rss_bytes"] is not None else "-",
            output,
        ))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        cells = (cell.ljust(w) if i < 2 or i == len(row) - 1 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        lines.append("  ".join(cells).rstrip())
    for r in result["rows"]:
        if r["error"]:
            lines.append(f"{r['route']}: {r['error']}")
    return "\n".join(lines) + "\n"
