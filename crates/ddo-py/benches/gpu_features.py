"""Checks, on a CUDA GPU, what loads through ddo beyond a single Diffusers model: whole pipelines
(Flux-, SD3- and Wan-shaped, every model component streamed), transformers text encoders, LoRA
adapters, checkpoints converted from fp32 at load, and a VAE streamed layer by layer. Each result
must equal the same thing run resident on the GPU, bit for bit. Prints one line per check and
exits non-zero if one fails."""

from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch

import ddo

# The shared fixtures (tiny_pipelines, host) are in examples/ in the repository, beside this file in
# the GPU bundle.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..", "examples")]
from tiny_pipelines import PIPELINES, clip, flux_transformer_inputs, generate, own_memory, report, t5  # noqa: E402

DEVICE = os.environ.get("DDO_FEATURES_DEVICE", "cuda:0")
# Three 2 MiB granules: the resident rest and two slots, so the blocks of tiny models stream.
BUDGET = 6 / 1024


def streamed(**extra):
    policies = {n: ddo.ComponentPolicy(route="dynamic") for n in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae")}
    return ddo.DynamicOffloadConfig(
        backend="vmm", execution_device=DEVICE, vmm_resident_weight_budget_gb=BUDGET, components=policies, **extra
    )


def check_pipeline(work: str, family: str) -> str:
    from diffusers import DiffusionPipeline

    torch.manual_seed(0)
    pipe, extra = PIPELINES[family]()
    folder = os.path.join(work, family)
    pipe.save_pretrained(folder)
    want = generate(own_memory(DiffusionPipeline.from_pretrained(folder).to(DEVICE)), extra)
    result = ddo.from_pretrained_pipeline_with_dynamic_offload(folder, dynamic_offload_config=streamed())
    try:
        snapshots = result.metrics_snapshots()
        streams = sum(s.as_dict()["setup"]["streamed_units"] for s in snapshots.values())
        got = [generate(result.pipeline, extra) for _ in range(2)]
        assert all((g == want).all() for g in got), "generated image differs from the resident pipeline's"
        return f"{len(snapshots)} components, {streams} streamed units"
    finally:
        result.remove()


def check_text_encoder(work: str, name: str, build, stored, loaded) -> str:
    torch.manual_seed(3)
    model = build().eval()
    folder = os.path.join(work, f"{name}-{stored}-{loaded}".replace("torch.", ""))
    model.to(stored).save_pretrained(folder)
    ids = torch.tensor([[1, 5, 9, 3, 2, 7]], device=DEVICE)
    reference = type(model).from_pretrained(folder, dtype=loaded).to(DEVICE).eval()
    with torch.no_grad():
        want = reference(input_ids=ids, return_dict=False)[0]
    config = ddo.DynamicOffloadConfig(route="dynamic", backend="vmm", execution_device=DEVICE, vmm_resident_weight_budget_gb=BUDGET)
    got = ddo.from_pretrained_with_dynamic_offload(folder, dtype=loaded, apply_dynamic=True, component="text_encoder", dynamic_offload_config=config)
    try:
        with torch.no_grad():
            out = got.module(input_ids=ids, return_dict=False)[0]
        assert torch.equal(out, want), f"max difference {(out.float() - want.float()).abs().max().item()}"
        setup = got.offload.metrics_snapshot().as_dict()["setup"]
        return f"{setup['streamed_units']} streamed units, {setup.get('converted_tensors', 0)} tensors converted"
    finally:
        got.offload.remove()


def check_lora(work: str) -> str:
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    torch.manual_seed(1)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6],
    ).eval()
    folder = os.path.join(work, "flux-lora")
    model.save_pretrained(folder)
    g = torch.Generator().manual_seed(2)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 4, generator=g), encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]), img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(8, 3), return_dict=False,
    )
    inputs = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in inputs.items()}
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False)
    reference = copy.deepcopy(model).to(DEVICE)
    torch.manual_seed(5)
    reference.add_adapter(config, adapter_name="style")
    got = ddo.from_pretrained_with_dynamic_offload(
        folder, apply_dynamic=True, component="transformer",
        dynamic_offload_config=ddo.DynamicOffloadConfig(backend="vmm", execution_device=DEVICE, vmm_resident_weight_budget_gb=BUDGET),
    )
    try:
        torch.manual_seed(5)
        got.module.add_adapter(config, adapter_name="style")
        mine = dict(got.module.named_parameters())
        with torch.no_grad():
            for n, p in reference.named_parameters():
                if "lora_" in n:
                    mine[n].copy_(p)
            want = reference(**inputs)[0]
            outs = [got.module(**inputs)[0] for _ in range(2)]
        assert all(torch.equal(o, want) for o in outs), "output with the adapter differs from the resident model's"
        try:
            got.module.fuse_lora()
            raise AssertionError("fuse_lora was not refused")
        except ddo.DynamicOffloadLifecycleError:
            pass
        return f"{got.offload.metrics_snapshot().as_dict()['setup']['streamed_units']} streamed units, adapter resident"
    finally:
        got.offload.remove()


def check_fp8_on_device(work: str) -> str:
    """A Wan transformer saved in fp8 loads as bf16: its tensors stream as fp8 and widen on the GPU
    (keep-in-fp32 modules to fp32), as Diffusers' own loading converts them on the host."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(4)
    model = PIPELINES["wan"]()[0].transformer.eval()
    folder = os.path.join(work, "wan-fp8")
    model.to(torch.float8_e4m3fn).save_pretrained(folder)
    reference = WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).to(DEVICE).eval()
    g = torch.Generator().manual_seed(6)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 3, 8, 8, generator=g), encoder_hidden_states=torch.randn(1, 12, 32, generator=g),
        timestep=torch.tensor([500]), return_dict=False,
    )
    inputs = {k: v.to(DEVICE, torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    inputs["timestep"] = inputs["timestep"].to(DEVICE)
    with torch.no_grad():
        want = reference(**inputs)[0]
    # A granule more than BUDGET: the staging buffer of the stored fp8 bytes.
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device=DEVICE, vmm_resident_weight_budget_gb=BUDGET + 2 / 1024)
    got = ddo.from_pretrained_with_dynamic_offload(
        folder, torch_dtype=torch.bfloat16, apply_dynamic=True, component="transformer", dynamic_offload_config=config
    )
    try:
        with torch.no_grad():
            outs = [got.module(**inputs)[0] for _ in range(2)]
        assert all(torch.equal(o, want) for o in outs), "output differs from the model Diffusers loads"
        setup = got.offload.metrics_snapshot().as_dict()["setup"]
        assert setup["conversion"] == "device", setup
        runtime = got.offload.metrics_snapshot().as_dict()["runtime"]
        return f"{setup['device_converted_tensors']} tensors widened on the GPU, {runtime['device_conversions']} conversions run"
    finally:
        got.offload.remove()


def check_gguf(work: str) -> str:
    """A Q8_0 GGUF Flux transformer streams its quantized bytes into Diffusers' GGUF modules and
    equals the same file loaded resident by Diffusers' from_single_file."""
    import gguf
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    from flux_workload import q8_0

    torch.manual_seed(7)
    model = PIPELINES["flux"]()[0].transformer.eval()
    folder = os.path.join(work, "flux-gguf")
    model.save_config(folder)
    path = os.path.join(folder, "model-Q8_0.gguf")
    writer = gguf.GGUFWriter(path, arch="flux")
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, p in model.state_dict().items():
        if name in linear and p.shape[-1] % 32 == 0:
            writer.add_tensor(name, q8_0(p), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, p.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    quant = GGUFQuantizationConfig(compute_dtype=torch.bfloat16)
    reference = FluxTransformer2DModel.from_single_file(
        path, config=folder, torch_dtype=torch.bfloat16, quantization_config=quant
    ).to(DEVICE).eval()
    inputs = flux_transformer_inputs(2, DEVICE)
    with torch.no_grad():
        want = reference(**inputs)[0]
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device=DEVICE, vmm_resident_weight_budget_gb=BUDGET)
    got = ddo.from_pretrained_with_dynamic_offload(
        folder, gguf_file="model-Q8_0.gguf", torch_dtype=torch.bfloat16, apply_dynamic=True, component="transformer",
        dynamic_offload_config=config,
    )
    try:
        with torch.no_grad():
            outs = [got.module(**inputs)[0] for _ in range(2)]
        assert all(torch.equal(o, want) for o in outs), "output differs from Diffusers' GGUF model run resident"
        setup = got.offload.metrics_snapshot().as_dict()["setup"]
        return f"{setup['streamed_units']} streamed units of Q8_0 bytes"
    finally:
        got.offload.remove()


def check_side_stream(work: str) -> str:
    """The hooks read PyTorch's current stream as it changes: a streamed model run inside
    ``torch.cuda.stream(side)`` orders its uploads against that stream and equals the resident
    model run there."""
    from diffusers import FluxTransformer2DModel

    from ddo.runtime.hooks import stream_reader

    side = torch.cuda.Stream(DEVICE)
    current = stream_reader(torch.device(DEVICE))
    assert current() == torch.cuda.current_stream(DEVICE).cuda_stream
    with torch.cuda.stream(side):
        assert current() == side.cuda_stream, "the stream handle does not follow torch.cuda.stream()"
    torch.manual_seed(5)
    folder = os.path.join(work, "flux-side-stream")
    PIPELINES["flux"]()[0].transformer.save_pretrained(folder)
    reference = FluxTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).to(DEVICE).eval()
    inputs = flux_transformer_inputs(3, DEVICE)
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device=DEVICE, vmm_resident_weight_budget_gb=BUDGET)
    got = ddo.from_pretrained_with_dynamic_offload(
        folder, torch_dtype=torch.bfloat16, apply_dynamic=True, dynamic_offload_config=config
    )
    try:
        with torch.no_grad(), torch.cuda.stream(side):
            want = reference(**inputs)[0]
            outs = [got.module(**inputs)[0] for _ in range(3)]
        side.synchronize()
        assert all(torch.equal(o, want) for o in outs), "output on a side stream differs from the resident model's"
        # Between passes every parameter reads the checkpoint's values on the GPU (a streamed
        # block's memory holds other blocks then), and writes are refused.
        own = dict(reference.named_parameters())
        placeholders = 0
        for name, p in got.module.named_parameters():
            placeholders += isinstance(p, ddo.StreamedWeight)
            assert p.device == own[name].device and torch.equal(p.detach().clone(), own[name].detach()), name
        assert placeholders > 0, "no streamed parameter between passes"
        try:
            with torch.no_grad():
                got.module.transformer_blocks[0].attn.to_q.weight.add_(1)
            raise AssertionError("a write into a streamed weight was accepted")
        except ddo.DynamicOffloadLifecycleError:
            pass
        with torch.no_grad():
            assert torch.equal(got.module(**inputs)[0], want)
        return (
            f"{got.offload.metrics_snapshot().as_dict()['setup']['streamed_units']} streamed units on a side stream; "
            f"{placeholders} parameters read from the checkpoint between passes"
        )
    finally:
        got.offload.remove()


def check_vae_layers(_work: str) -> str:
    """Route linear_convolution: an SD-shaped bf16 VAE decodes with each convolution streamed on
    its own through the arena, equal to the resident decode bit for bit (one pass with the latent
    left on the host, which ddo moves), at the arena's peak instead of the whole VAE."""
    from diffusers import AutoencoderKL

    cuda = DEVICE.startswith("cuda")
    channels, groups, side = ((128, 256, 512, 512), 32, 32) if cuda else ((32, 64), 8, 8)
    torch.manual_seed(8)
    vae = AutoencoderKL(
        block_out_channels=channels, down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels), layers_per_block=2, latent_channels=4,
        norm_num_groups=groups,
    ).eval()
    # AutoencoderKL keeps no module in fp32: a plain cast (Diffusers' .to() warns about one).
    torch.nn.Module.to(vae, torch.bfloat16)
    latent = torch.randn(1, 4, side, side, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in vae.parameters())

    def peak() -> int:
        return torch.cuda.max_memory_allocated(DEVICE) if cuda else 0

    def reset() -> None:
        if cuda:
            torch.cuda.synchronize(DEVICE)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(DEVICE)

    reset()
    reference = copy.deepcopy(vae).to(DEVICE)
    with torch.no_grad():
        want = reference.decode(latent.to(DEVICE)).sample
    resident = peak()
    del reference
    assert torch.isfinite(want.float()).all(), "the resident decode is not finite"
    reset()
    result = ddo.enable_offload(vae, component="vae", route="linear_convolution", execution_device=DEVICE, use_environment=False)
    try:
        with torch.no_grad():
            outs = [vae.decode(latent.to(DEVICE)).sample, vae.decode(latent).sample]
        assert all(torch.equal(o, want) for o in outs), (
            f"decode differs from the resident one (max difference {max((o.float() - want.float()).abs().max().item() for o in outs)})"
        )
        m = result.metrics_snapshot().as_dict()
        arena = m["runtime"]["peak_bytes"]
        mib = 1 << 20
        memory = (
            f"peak GPU {(peak() + arena) / mib:.0f} MiB (PyTorch {peak() / mib:.0f} + arena {arena / mib:.0f}) vs resident "
            f"{resident / mib:.0f} MiB"
            if cuda
            else f"arena peak {arena / mib:.1f} MiB"
        )
        return (
            f"{m['setup']['streamed_units']} layers streamed of a {weights / mib:.0f} MiB VAE, budget "
            f"{m['setup']['gpu_budget_bytes'] / mib:.0f} MiB; {memory}"
        )
    finally:
        result.remove()


def main() -> int:
    checks = [(f"pipeline {f}", lambda w, f=f: check_pipeline(w, f)) for f in sorted(PIPELINES)]
    checks += [
        ("text encoder T5 fp32 -> bf16", lambda w: check_text_encoder(w, "t5", t5, torch.float32, torch.bfloat16)),
        ("text encoder T5 fp32 -> fp16", lambda w: check_text_encoder(w, "t5", t5, torch.float32, torch.float16)),
        ("text encoder CLIP bf16", lambda w: check_text_encoder(w, "clip", clip, torch.bfloat16, torch.bfloat16)),
        ("LoRA on a streamed transformer", check_lora),
        ("fp8 checkpoint widened on the GPU", check_fp8_on_device),
        ("GGUF Q8_0 into Diffusers' GGUF modules", check_gguf),
        ("a forward on a side stream; parameters read between passes", check_side_stream),
        ("VAE decode streamed layer by layer (route linear_convolution)", check_vae_layers),
    ]
    with tempfile.TemporaryDirectory() as work:
        return report(checks, work, DEVICE)


if __name__ == "__main__":
    sys.exit(main())
