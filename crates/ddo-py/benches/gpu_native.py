"""GPU check of the native route (vmm_fast_runtime) against the resident model, in one run:
a Flux-style FluxTransformer2DModel with random bf16 weights (5.0 B parameters by default) saved
as safetensors, loaded once resident on the GPU and once through
ddo.from_pretrained_with_dynamic_offload with backend vmm; at each resolution both run and their
outputs are compared bit for bit, with step times against the floor
max(resident step, streamed bytes / pinned copy speed measured in the same run). Tiny SD3 and
AutoencoderKL models are checked the same way.

    python crates/ddo-py/benches/gpu_native.py [--resolutions 512,1024,2048] [--budget-gb 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time

import torch

import ddo
from flux_workload import flux_inputs, link_speed, random_model, saved_flux, timed


def native(path, budget_gb, cls):
    return ddo.from_pretrained_with_dynamic_offload(
        path,
        model_loader=cls,
        torch_dtype=torch.bfloat16,
        apply_dynamic=True,
        component="transformer",
        dynamic_offload_config=ddo.DynamicOffloadConfig(backend="vmm", vmm_resident_weight_budget_gb=budget_gb),
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--resolutions", default="512,1024,2048")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--double", type=int, default=8)
    ap.add_argument("--single", type=int, default=16)
    ap.add_argument("--budget-gb", type=float, default=3.0)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    from diffusers import AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel

    dev = torch.device("cuda:0")
    work = a.dir or tempfile.mkdtemp(prefix="ddo-native-")
    ok = True

    # Small models of two other families: bit-identical outputs through the native route.
    for name, cls, config, inputs in [
        (
            "SD3Transformer2DModel",
            SD3Transformer2DModel,
            dict(sample_size=32, patch_size=2, in_channels=16, num_layers=4, attention_head_dim=64, num_attention_heads=4,
                 joint_attention_dim=256, caption_projection_dim=256, pooled_projection_dim=128, out_channels=16),
            dict(hidden_states=torch.randn(1, 16, 32, 32), encoder_hidden_states=torch.randn(1, 77, 256),
                 pooled_projections=torch.randn(1, 128), timestep=torch.tensor([3.0]), return_dict=False),
        ),
        (
            "AutoencoderKL",
            AutoencoderKL,
            dict(block_out_channels=(64, 128, 128), down_block_types=("DownEncoderBlock2D",) * 3,
                 up_block_types=("UpDecoderBlock2D",) * 3, latent_channels=4, layers_per_block=2),
            dict(sample=torch.randn(1, 3, 128, 128), return_dict=False),
        ),
    ]:
        model = random_model(cls, **config)
        path = os.path.join(work, name)
        model.save_pretrained(path)
        resident = model.to(dev)
        x = {k: (v.to(dev, torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}
        with torch.no_grad():
            ref = resident(**x)[0]
        # A budget of the resident rest plus three of the largest units: most units stream.
        units = ddo.find_execution_units(resident)
        largest = max(sum(p.numel() * p.element_size() for p in m.parameters()) for _, m in units)
        in_units = {id(p) for _, m in units for p in m.parameters()}
        rest = sum(p.numel() * p.element_size() for p in resident.parameters() if id(p) not in in_units)
        granule = 2 << 20
        budget = ((rest + granule - 1) // granule + 3 * ((largest + granule - 1) // granule)) * granule
        del resident, model
        loaded = native(path, budget / 2**30, cls)
        with torch.no_grad():
            got = loaded.module(**x)[0]
        same = torch.equal(got, ref)
        ok &= same
        stats = loaded.offload.metrics_snapshot().as_dict()["setup"]
        print(f"{name}: vmm_fast_runtime output equals resident bit for bit: {same} "
              f"({stats['streamed_units']} streamed units, {stats['execution_slots']} slots)")
        loaded.offload.remove()

    path, nbytes = saved_flux(work, a.double, a.single)
    print(f"Flux-style model: {nbytes / 2**30:.2f} GiB at {path}")

    link = link_speed(dev)

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t = time.perf_counter()
    loaded = native(path, a.budget_gb, FluxTransformer2DModel)
    setup = time.perf_counter() - t
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = loaded.offload
    stats = result.metrics_snapshot().as_dict()["setup"]
    streamed = stats["streamed_bytes_per_pass"]
    print(f"native attach (load + arena + registration): {setup:.1f} s; plan: {stats['resident_units']} resident / "
          f"{stats['streamed_units']} streamed units, {stats['execution_slots']} slots of {stats['slot_bytes'] / 2**20:.0f} MiB, "
          f"budget {stats['gpu_budget_bytes'] / 2**30:.2f} GiB, registered {stats['registered_bytes'] / 2**30:.2f} GiB")
    print(f"peak host RSS after the native load: {rss_after / 2**30:.2f} GiB ({rss_after / nbytes:.2f} x model; "
          f"{rss_before / 2**30:.2f} GiB before it)")
    resident = FluxTransformer2DModel.from_pretrained(path, torch_dtype=torch.bfloat16).to(dev).eval()

    print("\n| resolution | resident step | floor | vmm_fast first | vmm_fast steady | ratio to floor | bit-identical |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(1)
    for res in [int(r) for r in a.resolutions.split(",")]:
        x = flux_inputs(res, dev, g)
        rt, ref = timed(lambda: resident(**x)[0], a.steps)
        vt, out = timed(lambda: loaded.module(**x)[0], a.steps)
        r_step = statistics.median(rt[1:])
        v_step = statistics.median(vt[1:])
        floor = max(r_step, streamed / link)
        same = torch.equal(out, ref)
        ok &= same
        print(f"| {res}x{res} | {r_step:.4f} s | {floor:.4f} s | {vt[0]:.4f} s ({vt[0] / v_step:.2f}x) | {v_step:.4f} s | {v_step / floor:.3f} | {same} |")
    print(f"\npinned copy speed {link / 1e9:.1f} GB/s; arena device bytes {stats['execution_slots'] * stats['slot_bytes'] / 2**30 + 0:.2f} GiB in slots")
    print(result.metrics_snapshot(collect_completed=True).format_profile(), end="")
    slots, freed = result.reclaim()
    print(f"reclaim: {slots} idle slots, {freed / 2**20:.0f} MiB released")
    with torch.no_grad():
        again = loaded.module(**x)[0]
    print(f"after reclaim, output still bit-identical: {torch.equal(again, ref)}")
    result.unload()
    print(f"unload: parameters on meta: {all(p.is_meta for p in loaded.module.parameters())}")
    result.reload()
    with torch.no_grad():
        back = loaded.module(**x)[0]
    print(f"reload: output bit-identical: {torch.equal(back, ref)}")
    ok &= torch.equal(back, ref)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
