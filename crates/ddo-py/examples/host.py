"""A Diffusers host as the published library's users write one: the standard ``--ddo-*`` flags,
the backend they select, the pipeline offloaded, a timed generation, the profile or metrics on
request. With no ``--model`` it builds a tiny random Flux pipeline here (no download).

    python examples/host.py --ddo-backend linear --show-profile
    python examples/host.py --ddo-backend vmm --ddo-vmm-resident-weight-budget-gb 0.01 --check
    python examples/host.py --model /path/to/FLUX.1-dev --ddo-backend vmm --ddo-vmm-resident-weight-budget-gb 6

``--check`` also generates without ddo and exits 1 unless the images are identical.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

import ddo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build_tiny_flux(folder: str) -> dict:
    """Saves a tiny random Flux pipeline to ``folder``; returns the call's extra arguments."""
    from tiny_pipelines import flux_pipeline

    torch.manual_seed(0)
    pipe, extra = flux_pipeline()
    pipe.save_pretrained(folder)
    return extra


def generate(pipe, prompt: str, steps: int, extra: dict, timer=None) -> np.ndarray:
    def step_end(_pipe, _i, _t, kwargs):
        timer.mark_step()
        return kwargs

    hooks = {"callback_on_step_end": step_end} if timer is not None else {}
    out = pipe(prompt=prompt, num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="np",
               **extra, **hooks)
    return np.asarray(out[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a saved Diffusers pipeline folder (default: a tiny random Flux pipeline)")
    parser.add_argument("--prompt", default="a red cat on the mat")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--check", action="store_true", help="also generate without ddo; exit 1 unless identical")
    ddo.add_dynamic_offload_arguments(parser)
    ddo.add_dynamic_offload_lifecycle_arguments(parser)
    args = parser.parse_args(argv)

    backend = ddo.resolve_dynamic_offload_backend(args.ddo_backend, args.ddo_preset)
    config = backend.build_config_from_args(args).replace(execution_device=args.device)
    with tempfile.TemporaryDirectory() as tmp:
        folder, extra = args.model, {}
        if folder is None:
            folder = os.path.join(tmp, "flux")
            extra = build_tiny_flux(folder)
        from diffusers import DiffusionPipeline

        reference = None
        if args.check:
            plain = DiffusionPipeline.from_pretrained(folder).to(args.device)
            for component in plain.components.values():
                if isinstance(component, torch.nn.Module):
                    for p in component.parameters():
                        p.data = p.data.clone()  # own, aligned memory, as a resident GPU copy has
            reference = generate(plain, args.prompt, args.steps, extra)
            del plain

        ddo.maybe_purge_windows_standby_cache("before_run", enabled=args.purge_before_run)
        if backend.backend == "vmm":
            # The native route streams from the checkpoint: the loader binds each weight to it.
            loaded = ddo.from_pretrained_pipeline_with_dynamic_offload(folder, dynamic_offload_config=config)
            pipe, results = loaded.pipeline, loaded.offload
        else:
            pipe = DiffusionPipeline.from_pretrained(folder)
            results = ddo.enable_pipeline_offload(pipe, config=config, execution_device=args.device)
        for name, r in results.items():
            print(f"{name}: route {r.route} ({r.runtime_route}) on {r.execution_device}")

        transformer = results.get("transformer")
        timer = transformer.execution_timer(enabled=True) if transformer is not None else None
        start = time.perf_counter()
        with contextlib.nullcontext() if timer is None else timer:
            image = generate(pipe, args.prompt, args.steps, extra, timer)
        seconds = time.perf_counter() - start
        print(f"generated {image.shape} in {seconds:.3f} s")
        ddo.maybe_purge_windows_standby_cache("after_run", enabled=args.purge_after_run)

        if args.show_profile or args.show_metrics:
            for name, r in results.items():
                snapshot = r.metrics_snapshot(collect_completed=True, execution_timing=timer if r is transformer else None)
                print(snapshot.format_profile() if args.show_profile else json.dumps(snapshot.as_dict(), indent=1))
        status = 0
        if reference is not None:
            same = bool(np.array_equal(image, reference))
            print(f"identical to the run without ddo: {same}")
            status = 0 if same else 1
        for r in results.values():
            r.remove()
        return status


if __name__ == "__main__":
    sys.exit(main())
