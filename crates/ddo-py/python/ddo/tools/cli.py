"""The command line of ``python -m ddo``: ``presets`` lists the presets; ``inspect PATH`` lists a
checkpoint's tensors, or says why it is invalid (exit 1); ``doctor`` measures this machine and
recommends settings; ``bench FOLDER`` times a model on several routes side by side; ``plan
FOLDER`` prints the plan :func:`ddo.load` would follow on this machine."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from .. import _native
from .bench import ROUTES

# The help's description: what each command does.
_DESCRIPTION = """``python -m ddo presets`` lists the presets; ``python -m ddo inspect PATH`` lists a
checkpoint's tensors, or says why it is invalid (exit 1); ``python -m ddo doctor`` measures this
machine and recommends settings; ``python -m ddo bench FOLDER`` times a model on several routes
side by side; ``python -m ddo plan FOLDER`` prints the plan ``ddo.load`` would follow on this
machine, before anything loads."""


def _printable(text: str) -> str:
    """``text`` with control and other unprintable characters escaped: names come from the file
    and must not drive the terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddo", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("presets", help="list the presets and their values")
    plan = sub.add_parser("plan", help="print the plan ddo.load would follow for a pipeline folder on this machine")
    plan.add_argument("folder", help="a Diffusers pipeline folder (model_index.json), or a hub id in the local cache")
    plan.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="the dtype the components load in")
    plan.add_argument("--gpu-budget-gb", type=float, help="bound what the plan shares of the card, GiB")
    plan.add_argument("--device", help="the execution device (default cuda:0 when CUDA is available, else cpu)")
    plan.add_argument("--refresh", action="store_true", help="measure the machine again instead of its cached profile")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    inspect = sub.add_parser("inspect", help="list a checkpoint's tensors")
    inspect.add_argument("path", help="a .safetensors file, an index .json, or a model folder")
    doctor = sub.add_parser("doctor", help="measure this machine and recommend settings")
    doctor.add_argument(
        "--checkpoint",
        help="a safetensors file, index .json, model folder, or pipeline folder (model_index.json) to recommend settings for",
    )
    doctor.add_argument("--device", default="cuda:0", help="the CUDA device to measure (default cuda:0)")
    doctor.add_argument("--dir", help="measure disk reads of a temp file in DIR (default: the checkpoint's files, else the temp folder)")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    bench = sub.add_parser("bench", help="time a model's forward on several routes side by side")
    bench.add_argument(
        "checkpoint",
        help="a Diffusers model folder (config.json and safetensors), a pipeline folder (model_index.json: its "
        "transformer or unet is timed), or one .safetensors checkpoint file",
    )
    bench.add_argument(
        "--config",
        help="for a checkpoint file: the model's config.json, or a folder holding it (default: the config.json beside the file)",
    )
    bench.add_argument("--routes", default=",".join(ROUTES), help=f"comma-separated, among {','.join(ROUTES)} (default all)")
    bench.add_argument("--steps", type=int, help="timed forwards per route, after one warm-up (default 5 on a GPU, 2 on the CPU)")
    bench.add_argument("--device", help="execution device (default cuda:0 when CUDA is available, else cpu)")
    bench.add_argument("--budget-gb", type=float, default=3.0, help="GPU weight budget of the vmm route in GiB (default 3)")
    bench.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32"), help="load dtype (default bfloat16 on a GPU, float32 on the CPU)"
    )
    bench.add_argument(
        "--resolution", type=int, help="image side in pixels the inputs stand for (default 1024 on a GPU, 256 on the CPU)"
    )
    bench.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    if args.command == "presets":
        print(_native.format_presets(), end="")
        return 0
    if args.command == "plan":
        return _plan(args)
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "bench":
        return _bench(args)
    try:
        info = json.loads(_native.inspect_checkpoint(args.path))
    except _native.DynamicOffloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tensors = [dict(t, name=_printable(t["name"]), file=_printable(t["file"])) for t in info["tensors"]]
    width = max([len(t["name"]) for t in tensors] + [4])
    print(f"{'name':<{width}}  {'dtype':<7}  {'shape':<20}  {'bytes':>12}  file")
    for t in tensors:
        shape = str(list(t["shape"]))
        print(f"{t['name']:<{width}}  {t['dtype']:<7}  {shape:<20}  {t['len']:>12}  {t['file'].rsplit('/', 1)[-1]}")
    total = sum(t["len"] for t in tensors)
    print(f"{len(tensors)} tensors in {len(info['files'])} file(s), {total} bytes")
    return 0


def _plan(args: argparse.Namespace) -> int:
    import torch

    from ..config import DynamicOffloadConfig
    from ..errors import DynamicOffloadError
    from ..generation import plan

    kwargs = {"dtype": getattr(torch, args.dtype)} if args.dtype else {}
    config = DynamicOffloadConfig(execution_device=args.device) if args.device else None
    try:
        p = plan(args.folder, config=config, gpu_budget_gb=args.gpu_budget_gb, refresh=args.refresh, **kwargs)
    except DynamicOffloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"machine": p.machine, **{k: v for k, v in p.data.items() if k != "table"}}, indent=2))
    else:
        print(_printable(p.table()).replace("\\n", "\n"), end="")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import diagnose, format_report

    try:
        report = diagnose(args.checkpoint, args.device, args.dir)
    except (_native.DynamicOffloadError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_report(report), end="\n" if args.json else "")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .bench import failed, format_table, run_bench

    try:
        result = run_bench(
            args.checkpoint,
            routes=tuple(r.strip() for r in args.routes.split(",") if r.strip()),
            steps=args.steps,
            device=args.device,
            budget_gb=args.budget_gb,
            dtype=getattr(torch, args.dtype) if args.dtype else None,
            resolution=args.resolution,
            config=args.config,
        )
    except (_native.DynamicOffloadError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else format_table(result), end="\n" if args.json else "")
    return 1 if failed(result) else 0
