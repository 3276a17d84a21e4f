"""Whole generations side by side (encode the prompt, N denoising steps, decode): ddo's one call
against Diffusers' offloads and a resident run, on simulated smaller cards and under host memory
ceilings. Models (random weights, saved once as a Diffusers pipeline folder under --dir): ``flux``,
the Flux-12B-shaped pipeline of gpu_pipeline.py (T5-XXL-sized + CLIP, Flux VAE) at 1024x1024;
``wan``, a Wan-2.1-14B-shaped WanPipeline (UMT5-XXL-sized encoder, 40 blocks of 5120, Wan VAE) at
480x832, --frames frames, with guidance. ``--scale`` shrinks layer counts and widths (and the
default size) for a CPU smoke test: ``--device cpu --scale 0.05 --steps 2``.

Rows (--rows), each in its own process: ``resident`` (on the whole card: the reference output and
step), ``ddo`` (``ddo.load(folder, torch_dtype=bf16)``), ``ddo-sweep`` (a process per --sweep entry
passed as ``config=``: ``linear``, ``vmm``, ``vmm@GIB`` / ``vmm@xF`` (F of the card) as the
transformer's resident weight budget, ``~enc`` for encoded weights), ``model-cpu``, ``sequential``
(--sequential-steps runs fewer steps, extrapolated to --steps), ``group-leaf`` (leaf level with a
stream) and ``published`` (diffusers-dynamic-offloader, where installed).

--card-gb 12,16,24 runs each other row per card: the child first allocates the GPU's total memory
minus the card (GPU peaks are reported without it). --host-gb 32,64 runs each per ceiling, in a
cgroup v2 with that memory.max (swap 0) where one can be made, else the row says it was not
enforced. ``encode_prompt`` and ``vae.decode`` are timed and every step ends at
``callback_on_step_end`` (all synchronized); the first step includes preparing the latents, the
steady step is the mean of the others. Outputs (fixed seed) are compared with the resident row's
bit for bit. Rows accumulate in DIR/generation/MODEL/rows.jsonl (one measured again replaces the
old), so a table can be filled over several commands, each under --timeout seconds.

    python gpu_generation.py --model flux|wan [--rows resident,ddo,...] [--card-gb 12,16,24]
        [--host-gb 32,64] [--steps 28] [--frames 5] [--sweep ...] [--dir DIR] [--table]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..", "examples")]
from gpu_lowram import Child, cgroup_events, make_cgroup, read, remove_cgroup  # noqa: E402

GIB = 2**30
ROWS = ["resident", "ddo", "ddo-sweep", "model-cpu", "sequential", "group-leaf", "published"]
SWEEP = "linear,vmm,vmm@x0.25,vmm@x0.5,vmm@x0.5~enc"
# The children's environment: no progress bars or library warnings between the rows.
QUIET = dict(os.environ, HF_HUB_DISABLE_PROGRESS_BARS="1", DIFFUSERS_VERBOSITY="error", TRANSFORMERS_VERBOSITY="error",
             TRANSFORMERS_NO_ADVISORY_WARNINGS="1", PYTHONWARNINGS="ignore")
SWEEP_SPEC = re.compile(r"^(linear|vmm)(?:@(x?[0-9.]+))?(~enc)?$")
SIZES = {"flux": (1024, 1024), "wan": (480, 832)}
# The default size below scale 1: the CPU decodes bf16 slowly (a 256x256 Flux image takes 40 s).
SMALL_SIZES = {"flux": (128, 128), "wan": (64, 112)}


# --- the models ----------------------------------------------------------------------------


def build_wan(folder: str, scale: float) -> None:
    """The Wan-2.1-14B-shaped pipeline: UMT5-XXL-sized encoder, the 14 B transformer (40 blocks
    of 40 x 128), AutoencoderKLWan's default config; ``scale`` < 1 shrinks it."""
    import transformers
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from flux_workload import WAN_14B, random_model
    from gpu_pipeline import save, scaled
    from tiny_pipelines import tokenizer

    t = time.perf_counter()
    heads = scaled(64, scale)
    umt5 = transformers.UMT5Config(
        vocab_size=256384 if scale >= 1 else 4096, d_model=heads * 64, d_kv=64, d_ff=scaled(10240, scale),
        num_layers=scaled(24, scale), num_heads=heads, feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=32, relative_attention_max_distance=128, is_encoder_decoder=False,
    )
    transformer = random_model(WanTransformer3DModel, **dict(
        WAN_14B, num_layers=scaled(40, scale), num_attention_heads=scaled(40, scale),
        ffn_dim=scaled(13824, scale), text_dim=heads * 64,
    ))
    vae = random_model(AutoencoderKLWan, base_dim=scaled(96, scale, 8, 16))
    pipe = WanPipeline(
        tokenizer=tokenizer(512), text_encoder=random_model(transformers.UMT5EncoderModel, config=umt5), vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=transformer,
    )
    save(pipe, folder, t)


def folder_of(a: argparse.Namespace) -> str:
    name = {"flux": "flux-pipeline", "wan": "wan-pipeline"}[a.model]
    return os.path.join(a.dir, name if a.scale >= 1 else f"{name}-s{a.scale:g}")


def size_of(a: argparse.Namespace) -> tuple[int, int]:
    return a.size or (SIZES if a.scale >= 1 else SMALL_SIZES)[a.model]


def generation_kwargs(a: argparse.Namespace, steps: int) -> dict:
    import torch

    height, width = size_of(a)
    kw = dict(prompt="a red cat sitting on the mat photo", height=height, width=width, num_inference_steps=steps,
              max_sequence_length=512, generator=torch.Generator().manual_seed(0), output_type="np")
    if a.model == "wan":
        return dict(kw, negative_prompt="", num_frames=a.frames, guidance_scale=5.0)
    return dict(kw, guidance_scale=3.5)


# --- the child -----------------------------------------------------------------------------


class Skip(Exception):
    pass


def sweep_config(spec: str, card_gb: float) -> dict:
    """The transformer's own settings of a sweep entry (the other components follow the plan)."""
    backend, budget, enc = SWEEP_SPEC.match(spec).groups()
    config: dict = {"backend": backend}
    if budget:
        gib = float(budget[1:]) * card_gb if budget.startswith("x") else float(budget)
        config["vmm_resident_weight_budget_gb"] = round(gib, 2)
    if enc:
        config["vmm_weight_encoding"] = "on"
    return config


def setup(a: argparse.Namespace, r: dict, folder: str, card_gb: float):
    """The row's pipeline, and ddo's result where there is one."""
    import torch
    from diffusers import DiffusionPipeline

    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    dev, dtype = torch.device(a.device), torch.bfloat16
    if r["row"] in ("ddo", "ddo-sweep"):
        import ddo

        if not hasattr(ddo, "load"):
            raise Skip("this ddo has no ddo.load(path, *, config=None, **diffusers_kwargs) yet")
        if r["row"] == "ddo":
            result = ddo.load(folder, torch_dtype=dtype)
        else:
            config = sweep_config(r["sweep"], card_gb)
            r["config"] = config
            own = {"transformer": ddo.DynamicOffloadConfig(**config)}
            result = ddo.load(folder, component_configs=own, torch_dtype=dtype)
        return result.pipeline, result
    if r["row"] == "published":
        try:
            import diffusers_dynamic_offloader as published
        except ImportError:
            raise Skip("not installed") from None
        pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=dtype)
        published.enable_pipeline_offload(pipe, execution_device=str(dev))
        return pipe, None
    if r["row"] == "sequential" and dev.type == "cpu":
        raise Skip("needs CUDA")
    pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=dtype)
    if r["row"] == "resident":
        pipe.to(dev)
    elif r["row"] == "model-cpu":
        pipe.enable_model_cpu_offload(device=dev)
    elif r["row"] == "sequential":
        pipe.enable_sequential_cpu_offload(device=dev)
    elif r["row"] == "group-leaf":
        stream = dev.type == "cuda"
        if hasattr(pipe, "enable_group_offload"):
            pipe.enable_group_offload(dev, offload_type="leaf_level", use_stream=stream)
        else:
            from diffusers.hooks import apply_group_offloading

            for m in pipe.components.values():
                if isinstance(m, torch.nn.Module):
                    apply_group_offloading(m, onload_device=dev, offload_type="leaf_level", use_stream=stream)
    return pipe, None


def timed_method(obj, name: str, spans: list, sync) -> None:
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        sync()
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sync()
            spans.append((start, time.perf_counter()))

    setattr(obj, name, wrapper)


def generate(a: argparse.Namespace, pipe, call, steps: int, sync) -> tuple[dict, object]:
    """One generation by ``call`` (the pipeline, or ddo's result, which checks the decode fits
    first), timed through ``pipe``'s methods."""
    import numpy as np

    encode, decode, ends = [], [], []
    timed_method(pipe, "encode_prompt", encode, sync)
    timed_method(pipe.vae, "decode", decode, sync)

    def on_step_end(_pipe, _i, _t, kwargs):
        sync()
        ends.append(time.perf_counter())
        return kwargs

    sync()
    start = time.perf_counter()
    out = call(**generation_kwargs(a, steps), callback_on_step_end=on_step_end)
    sync()
    total = time.perf_counter() - start
    steps_at = [encode[-1][1]] + ends
    durations = [b - t for t, b in zip(steps_at, steps_at[1:])]
    m = dict(total=total, encode=sum(b - t for t, b in encode), denoise=ends[-1] - encode[-1][1],
             first=durations[0], steady=statistics.mean(durations[1:]) if len(durations) > 1 else None,
             decode=decode[-1][1] - decode[-1][0], steps_run=len(durations))  # the last: ddo's check decodes too
    if steps < a.steps and m["steady"] is not None:
        # Extrapolated to --steps: the first step, then the steady step for each of the others.
        denoise = m["first"] + m["steady"] * (a.steps - 1)
        m.update(total=total - m["denoise"] + denoise, denoise=denoise, extrapolated=True)
    return m, np.asarray(out[0])


def child(a: argparse.Namespace) -> int:
    import torch

    r = json.loads(a.spec)
    cuda = a.device.startswith("cuda")
    sampler, filler, held = None, None, 0
    if cuda:
        try:
            from bench_gpu import GpuSampler

            sampler = GpuSampler()
        except Exception as e:  # noqa: BLE001 - no NVML: torch's numbers only
            print(f"no NVML sampler ({e})", flush=True)
        free, total = torch.cuda.mem_get_info()
        card_gb = r["card"] or total / GIB
        if r["card"]:
            held = total - int(r["card"] * GIB)
            if held > free:
                r["error"] = f"{free / GIB:.1f} GiB free: a {r['card']:g} GiB card cannot be simulated"
                print("RESULT " + json.dumps(r), flush=True)
                return 0
            filler = torch.empty(held, dtype=torch.uint8, device=a.device)
        r["gpu_total"] = total
    else:
        card_gb = 0.0
    from bench_gpu import peak_rss

    def sync():
        if cuda:
            torch.cuda.synchronize()

    result = None
    try:
        t = time.perf_counter()
        pipe, result = setup(a, r, a.folder, card_gb)
        pipe.set_progress_bar_config(disable=True)
        sync()
        r["setup"] = time.perf_counter() - t
        steps = a.sequential_steps if r["row"] == "sequential" and a.sequential_steps else a.steps
        m, output = generate(a, pipe, pipe if result is None else result, steps, sync)
        r.update(m)
        import numpy as np

        os.makedirs(os.path.dirname(r["output"]), exist_ok=True)
        np.save(r["output"], output)
        if result is not None:
            for name in ("plan", "report"):
                try:
                    r[name] = result.plan.table() if name == "plan" else result.report()
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    r[name] = f"{name} failed: {type(e).__name__}: {e}"
            try:
                result.remove()
            except Exception as e:  # noqa: BLE001 - the generation stands; the row says it
                r["note"] = f"remove() failed: {type(e).__name__}: {e}"[:160]
    except Skip as e:
        r["skipped"] = str(e)
    except torch.OutOfMemoryError as e:
        r["oom"], r["error"] = "GPU", str(e).splitlines()[0][:160]
    except Exception as e:  # noqa: BLE001 - the row says what failed
        import traceback

        traceback.print_exc()
        oom = "out of memory" in str(e).lower() or type(e).__name__ == "DynamicOffloadCapacityError"
        r["oom"] = "GPU" if oom else None
        r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    r["rss"] = peak_rss()
    if cuda:
        r["torch_peak"] = torch.cuda.max_memory_reserved() - held
        if sampler is not None:
            sampler.stop = True
            r["nvml_peak"] = sampler.peak - sampler.base - held
    del filler
    print("RESULT " + json.dumps(r), flush=True)
    return 0


# --- the parent ----------------------------------------------------------------------------


def run_row(a: argparse.Namespace, r: dict, folder: str, seconds: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(r), "--folder", folder] + a.passthrough
    cgroup, why = (None, "no host ceiling") if not r["host"] else make_cgroup(int(r["host"] * GIB))
    if r["host"] and cgroup is None:
        r["note"] = f"host ceiling not enforced ({why})"
    elif cgroup:
        procs = os.path.join(cgroup, "cgroup.procs")
        cmd = ["sh", "-c", 'echo $$ > "$0" || { echo "cannot join $0" >&2; exit 97; }; exec "$@"', procs] + cmd
    print(f"-- {r['label']}: card {r['card'] or 'whole'}, host {r['host'] or 'unlimited'}", flush=True)
    try:
        c = Child(cmd, r["label"], env=QUIET)
        rc = c.wait(seconds)
        out = c.result or dict(r, error=f"exit {rc}: {(c.tail or ['?'])[-1][:160]}")
        if r.get("note"):
            over = out.get("rss", 0) > r["host"] * GIB
            out["note"] = "; ".join(x for x in (out.get("note"), r["note"] + (": the peak RSS was over it" if over else "")) if x)
        if cgroup:
            peak = (read(os.path.join(cgroup, "memory.peak")) or "").strip()
            out["cgroup_peak"] = int(peak) if peak.isdigit() else None
            if cgroup_events(cgroup).get("oom_kill"):
                out["oom"] = "host"
    finally:
        if cgroup:
            remove_cgroup(cgroup)
    return out


def expand(a: argparse.Namespace, tag: str) -> list[dict]:
    cards = [float(x) for x in a.card_gb.split(",")] if a.card_gb and a.device.startswith("cuda") else [None]
    hosts = [float(x) for x in a.host_gb.split(",")] if a.host_gb else [None]
    out = []
    for row in a.rows.split(","):
        if row not in ROWS:
            raise SystemExit(f"unknown row {row!r}: rows are {', '.join(ROWS)}")
        sweeps = a.sweep.split(",") if row == "ddo-sweep" else [None]
        for s in sweeps:
            if s is not None and not SWEEP_SPEC.match(s):
                raise SystemExit(f"unknown sweep configuration {s!r} (linear, vmm, vmm@GIB, vmm@xF, ~enc)")
        for card in ([None] if row == "resident" else cards):
            for host in ([None] if row == "resident" else hosts):
                for s in sweeps:
                    label = f"{row} {s}" if s else row
                    name = re.sub(r"[^A-Za-z0-9.@_-]+", "_", f"{tag}-{label}-c{card}-h{host}-s{a.steps}")
                    out.append(dict(row=row, sweep=s, label=label, card=card, host=host, steps=a.steps,
                                    output=os.path.join(a.dir, "out", name + ".npy")))
    return out


def gib(v) -> str:
    return "" if v is None else f"{v / GIB:.1f}"


def sec(r: dict, k: str) -> str:
    v = r.get(k)
    return "" if v is None else f"{v:.2f}" + ("*" if r.get("extrapolated") and k in ("total", "denoise") else "")


def table(rows: list[dict], a: argparse.Namespace) -> None:
    import numpy as np

    ref = next((r for r in rows if r["row"] == "resident" and "total" in r), None)
    reference = np.load(ref["output"]) if ref and os.path.exists(ref["output"]) else None
    print(f"\n{a.model}, scale {a.scale:g}, {a.steps} steps, {'x'.join(map(str, size_of(a)))}"
          + (f", {a.frames} frames" if a.model == "wan" else "") + f", device {a.device}")
    print("| row | card GiB | host GiB | total s | encode s | denoise s | first step s | steady step s | decode s | "
          "peak GPU GiB (torch / NVML) | peak host RSS GiB | OOM | = resident | note |")
    print("|" + "---|" * 14)
    for r in rows:
        same = ""
        if "total" in r:
            if r.get("extrapolated"):
                same = f"n/a ({r['steps_run']} steps)"
            elif reference is not None and os.path.exists(r["output"]):
                out = np.load(r["output"])
                same = "yes" if out.shape == reference.shape and np.array_equal(out, reference, equal_nan=True) else "NO"
        notes = [r.get("skipped"), r.get("error"), r.get("note")]
        notes.append(r.get("extrapolated") and f"* extrapolated from {r['steps_run']} steps")
        notes.append(r["card"] and max(r.get("nvml_peak") or 0, r.get("torch_peak") or 0) > r["card"] * GIB and "GPU peak over the card")
        notes.append(r.get("cgroup_peak") and f"cgroup peak {gib(r['cgroup_peak'])} GiB")
        note = "; ".join(x for x in notes if x)
        oom = "" if r.get("skipped") else (f"yes ({r['oom']})" if r.get("oom") else "no")
        card = gib(r.get("gpu_total")) + " (whole)" if r["card"] is None and r.get("gpu_total") else (r["card"] or "")
        gpu = f"{gib(r.get('torch_peak'))} / {gib(r.get('nvml_peak'))}" if "torch_peak" in r else ""
        print(f"| {r['label']} | {card} | {r['host'] or ''} | {sec(r, 'total')} | {sec(r, 'encode')} | {sec(r, 'denoise')} | "
              f"{sec(r, 'first')} | {sec(r, 'steady')} | {sec(r, 'decode')} | {gpu} | {gib(r.get('rss'))} | {oom} | {same} | {note} |")
    ratios(rows, ref)
    for r in rows:
        if r["row"] == "ddo" and (r.get("report") or r.get("plan")):
            print(f"\n-- ddo's plan against what ran (card {r['card'] or 'whole'}, host {r['host'] or 'unlimited'}):\n"
                  + (r.get("report") or r["plan"]).rstrip())


def ratios(rows: list[dict], ref: dict | None) -> None:
    done = [r for r in rows if "total" in r and not r.get("oom")]
    print("\nratios (rows that finished without OOM; lower is better for ddo):")
    if not any(r["row"] == "ddo" for r in done):
        print("- no ddo row has finished")
    for d in (r for r in done if r["row"] == "ddo"):
        where = f"card {d['card'] or 'whole'}, host {d['host'] or 'unlimited'}"
        same = [r for r in done if (r["card"], r["host"]) == (d["card"], d["host"])]
        best = min((r for r in same if r["row"] == "ddo-sweep"), key=lambda r: r["total"], default=None)
        peer = min((r for r in same if r["row"] not in ("ddo", "ddo-sweep", "resident")), key=lambda r: r["total"], default=None)
        parts = []
        if best:
            parts.append(f"ddo / best sweep ({best['label']}) total {d['total'] / best['total']:.2f}x")
        if ref and ref.get("steady") and d.get("steady"):
            parts.append(f"ddo steady step / resident steady step {d['steady'] / ref['steady']:.2f}x")
        if peer:
            parts.append(f"ddo total / fastest peer ({peer['label']}) {d['total'] / peer['total']:.2f}x")
        print(f"- {where}: " + ("; ".join(parts) or "nothing to compare with"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["flux", "wan"], default="flux")
    ap.add_argument("--rows", default="resident,ddo,ddo-sweep,model-cpu,sequential,group-leaf,published")
    ap.add_argument("--card-gb", default="", help="simulated cards, e.g. 12,16,24 (CUDA only)")
    ap.add_argument("--host-gb", default="", help="host memory ceilings, e.g. 32,64 (cgroup v2 where possible)")
    ap.add_argument("--sweep", default=SWEEP, help=f"ddo-sweep's configurations (default {SWEEP})")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--sequential-steps", type=int, default=0, help="steps sequential runs, extrapolated to --steps")
    ap.add_argument("--frames", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0, help="shrink layer counts and widths (smoke tests)")
    ap.add_argument("--size", type=lambda s: tuple(int(x) for x in s.split("x")), help="HxW instead of the model's own")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ddo-generation"))
    ap.add_argument("--timeout", type=float, default=570, help="seconds for the whole call (rows not reached are left)")
    ap.add_argument("--table", action="store_true", help="print the rows measured so far and exit")
    ap.add_argument("--child")
    ap.add_argument("--folder")
    ap.add_argument("--build", action="store_true")
    a = ap.parse_args()
    # A stopped parent stops its running child (Child.wait's cleanup) instead of leaving it behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    a.dir = os.path.abspath(a.dir)
    a.passthrough = ["--model", a.model, "--steps", str(a.steps), "--frames", str(a.frames), "--scale", str(a.scale),
                     "--device", a.device, "--dir", a.dir, "--sequential-steps", str(a.sequential_steps)]
    a.passthrough += ["--size", "x".join(map(str, a.size))] if a.size else []
    if a.child:
        a.spec = a.child
        return child(a)
    folder = folder_of(a)
    if a.build:
        from gpu_pipeline import build

        (build if a.model == "flux" else build_wan)(folder, a.scale)
        return 0
    tag = os.path.basename(folder) + (f"-{a.frames}f" if a.model == "wan" else "") + (f"-{a.size[0]}x{a.size[1]}" if a.size else "")
    store = os.path.join(a.dir, "generation", tag, "rows.jsonl")
    os.makedirs(os.path.dirname(store), exist_ok=True)
    kept = []
    if os.path.exists(store):
        with open(store) as f:
            kept = [json.loads(line) for line in f if line.strip()]
    deadline = time.monotonic() + a.timeout
    if not a.table:
        if not os.path.exists(os.path.join(folder, "ddo-built.json")):
            c = Child([sys.executable, os.path.abspath(__file__), "--build"] + a.passthrough, "build", env=QUIET)
            if c.wait(deadline - time.monotonic() - 10) != 0:
                print("building the pipeline failed", flush=True)
                return 1
        if a.card_gb and not a.device.startswith("cuda"):
            print("simulated cards need CUDA: --card-gb ignored", flush=True)
        todo = expand(a, tag)
        for i, r in enumerate(todo):
            if deadline - time.monotonic() < 60:
                print(f"out of time (--timeout {a.timeout:g}): not run: {', '.join(x['label'] for x in todo[i:])}", flush=True)
                break
            got = run_row(a, r, folder, deadline - time.monotonic() - 15)
            kept = [k for k in kept if (k["label"], k["card"], k["host"], k["steps"]) != (r["label"], r["card"], r["host"], r["steps"])]
            kept.append(got)
            with open(store, "w") as f:
                f.writelines(json.dumps(k) + "\n" for k in kept)
    order = {name: i for i, name in enumerate(ROWS)}
    rows = sorted((k for k in kept if k["steps"] == a.steps), key=lambda r: (r["card"] or 0, r["host"] or 0, order[r["row"]], r["label"]))
    table(rows, a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
