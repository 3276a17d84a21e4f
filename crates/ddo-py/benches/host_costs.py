"""What ddo's host work costs per step and per block, on a model too small for its kernels to
matter: an SD3-shaped transformer of tiny width, so each step is as host-bound as it gets.

Rows (median over rounds, microseconds): the step of the plain module and of ddo with every unit
resident and with every block streamed (the difference is ddo's host cost per step), then the
parts: the per-forward check at the pass's start, one block's parameters compared in its
pre-hook, one resident block's pre and post hooks inside a pass (the unit is
leased for the pass: a native `reached`) and outside one (its own lease: a native acquire and
release), the tracer check, and on CUDA an event record for scale. The
parts are timed alone, thousands of times, and are the steadier figures: on a shared host the
step rows move by more than their difference.

    python host_costs.py [--device cpu|cuda] [--blocks 38] [--rounds 15] [--dir DIR]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import threading
import time
import timeit

import torch


def sd3(blocks: int):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=blocks, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
    ).eval()
    inputs = dict(
        hidden_states=torch.randn(1, 4, 8, 8), encoder_hidden_states=torch.randn(1, 6, 16),
        pooled_projections=torch.randn(1, 16), timestep=torch.tensor([3]), return_dict=False,
    )
    return model, inputs


def load(path: str, device: str, budget_gb: float):
    import ddo
    from diffusers import SD3Transformer2DModel

    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device=device, vmm_resident_weight_budget_gb=budget_gb)
    return ddo.from_pretrained_with_dynamic_offload(
        path, model_loader=SD3Transformer2DModel, apply_dynamic=True, component="transformer", dynamic_offload_config=config
    )


def per_call(f, number: int, rounds: int) -> float:
    """The best of `rounds` timings of `number` calls, per call, in microseconds."""
    return min(timeit.repeat(f, number=number, repeat=rounds)) / number * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--blocks", type=int, default=38)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args(argv)
    import ddo
    from ddo.runtime.guards import refuse_traced

    dev = torch.device(a.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    model, inputs = sd3(a.blocks)
    folder = tempfile.mkdtemp(dir=a.dir)
    model.save_pretrained(folder)
    plain = copy.deepcopy(model).to(dev)
    x = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    resident = load(folder, a.device, 1.0)
    # Every block streams through three slots: the largest block's granules three times over.
    block = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.transformer_blocks)
    granule = 2 << 20
    rest = sum(p.numel() * p.element_size() for p in model.parameters()) - a.blocks * block
    streamed = load(folder, a.device, (-(-rest // granule) + 3 * -(-block // granule)) * granule / 2**30)
    setups = {n: r.offload.metrics_snapshot().as_dict()["setup"] for n, r in [("resident", resident), ("streamed", streamed)]}
    if setups["resident"]["streamed_units"] or setups["streamed"]["streamed_units"] != a.blocks:
        raise SystemExit(f"unexpected plans: {setups['resident']['streamed_units']} / {setups['streamed']['streamed_units']} streamed")

    def step(m) -> float:
        sync()
        t = time.perf_counter()
        m(**x)
        sync()
        return time.perf_counter() - t

    rows = {"plain": plain, "ddo, all resident": resident.module, "ddo, every block streamed": streamed.module}
    times: dict = {n: [] for n in rows}
    with torch.no_grad():
        for m in rows.values():
            for _ in range(5):
                step(m)
        for r in range(a.rounds):
            for n, m in list(rows.items())[r % 3:] + list(rows.items())[: r % 3]:
                times[n].append(statistics.median(step(m) for _ in range(20)))
        run = resident.offload.runtime
        units = [u for u, _, pinned in run.session.units() if not pinned]
        unit, blk = units[len(units) // 2], resident.module.transformer_blocks[len(units) // 2]
        pre, post = run._pre(unit), run._post(unit)
        stream = run.stream()
        check = per_call(lambda: run._check_module((), x), 100, a.rounds)
        # A block's own places, compared in its pre-hook the first time the pass reaches it.
        unit_check = per_call(lambda: (run.pass_unchecked.add(unit), run._check_unit(unit)), 1000, a.rounds)
        ident = threading.get_ident()
        leased = frozenset(run.session.begin_pass(stream))
        if unit not in leased:
            raise SystemExit(f"unit {unit} was not leased for the pass: {sorted(leased)}")
        try:
            # As inside the module's forward: the block's unit is leased for the pass.
            run.pass_units, run.pass_stream, run.pass_thread = leased, stream, ident
            run.in_forward[ident] = True
            try:
                hooks = per_call(lambda: (pre(blk, ()), post(blk, (), None)), 1000, a.rounds)
                reached = per_call(lambda: run.session.reached(unit), 1000, a.rounds)
            finally:
                run.in_forward.pop(ident, None)
                run.pass_units = frozenset()
            # Outside a pass (or on another stream or thread) a block takes its own lease.
            own = per_call(lambda: (pre(blk, ()), post(blk, (), None)), 1000, a.rounds)
            native = per_call(lambda: run.session.release(run.session.acquire(unit, stream), stream), 1000, a.rounds)
        finally:
            run.session.end_pass(stream)
        # A streamed block: its own lease, its views swapped in and out, its output checked.
        srun = streamed.offload.runtime
        sunit = sorted(srun.streamed)[len(srun.streamed) // 2]
        sblk = streamed.module.get_submodule(next(n for u, n, _ in srun.session.units() if u == sunit))
        spre, spost = srun._pre(sunit), srun._post(sunit)
        streamed_check = per_call(lambda: srun._check_module((), x), 100, a.rounds)
        outputs = (torch.zeros(1, 16, 32, device=dev), torch.zeros(1, 6, 32, device=dev))
        srun.session.begin_pass(stream)
        try:
            streamed_hooks = per_call(lambda: (spre(sblk, ()), spost(sblk, (), outputs)), 1000, a.rounds)
        finally:
            srun.session.end_pass(stream)
        traced = per_call(lambda: refuse_traced("a block"), 1000, a.rounds)
        event = per_call(lambda: torch.cuda.Event().record(), 1000, a.rounds) if dev.type == "cuda" else None
    base = statistics.median(times["plain"])
    params = len(run.watched)
    print(f"\nhost costs on {dev} ({a.blocks} blocks, {params} parameters, {a.rounds} rounds; ddo {ddo.__version__})\n")
    print("| what | us | per block us |")
    print("|---|---|---|")
    for n in rows:
        s = statistics.median(times[n])
        extra = "" if n == "plain" else f"{(s - base) / a.blocks * 1e6:.2f} (over plain)"
        print(f"| step, {n} | {s * 1e6:.1f} | {extra} |")
    print(f"| per-forward check at the pass's start ({params} parameters, the blocks' compared in their pre-hooks) | {check:.1f} | {check / a.blocks:.2f} |")
    print(f"| the same, every block streamed | {streamed_check:.1f} | {streamed_check / a.blocks:.2f} |")
    print(f"| one block's parameters, compared in its pre-hook | {unit_check:.2f} | {unit_check:.2f} |")
    print(f"| pre + post hooks of a resident block, in a pass | {hooks:.2f} | {hooks:.2f} |")
    print(f"| of which native reached | {reached:.2f} | {reached:.2f} |")
    print(f"| pre + post hooks of a block taking its own lease | {own:.2f} | {own:.2f} |")
    print(f"| of which native acquire + release | {native:.2f} | {native:.2f} |")
    print(f"| pre + post hooks of a streamed block, in a pass | {streamed_hooks:.2f} | {streamed_hooks:.2f} |")
    print(f"| of which tracer check | {traced:.2f} | {traced:.2f} |")
    if event is not None:
        print(f"| torch.cuda.Event().record() (for scale) | {event:.2f} | |")
    for r in (resident, streamed):
        r.offload.remove()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
