"""Checks, on a CUDA GPU, that an offloaded module stays correct at its boundaries, as the CPU
tests check on the host backend: weights kept after the offload ends, parameters and
``state_dict()`` read between passes and after ``reclaim()``, training and casts refused, an
interrupted forward, concurrent forwards, and a checkpoint rewritten in place. Every forward is
compared with the resident model's output bit for bit. Prints one line per check and exits
non-zero if one fails."""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import threading

import torch

import ddo

# The shared fixtures (tiny_pipelines, host) are in examples/ in the repository, beside this file in
# the GPU bundle.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..", "examples")]
from tiny_pipelines import PIPELINES, flux_transformer_inputs, report  # noqa: E402

DEVICE = os.environ.get("DDO_FEATURES_DEVICE", "cuda:0")
# The resident rest and two slots of 2 MiB granules: every block streams.
BUDGET = 6 / 1024


class Case:
    """A tiny Flux transformer saved under ``work``, its resident run, and inputs."""

    def __init__(self, work: str) -> None:
        from diffusers import FluxTransformer2DModel

        torch.manual_seed(11)
        self.folder = os.path.join(work, "flux")
        if not os.path.exists(self.folder):
            PIPELINES["flux"]()[0].transformer.save_pretrained(self.folder)
        self.reference = FluxTransformer2DModel.from_pretrained(self.folder, torch_dtype=torch.bfloat16).to(DEVICE).eval()
        self.inputs = flux_transformer_inputs(4, DEVICE)
        self.want = self.run(self.reference)

    def run(self, module: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return module(**self.inputs)[0]

    def native(self, **extra):
        settings = dict(backend="vmm", execution_device=DEVICE, vmm_resident_weight_budget_gb=BUDGET, prefetch_depth=1)
        config = ddo.DynamicOffloadConfig(**{**settings, **extra})
        return ddo.from_pretrained_with_dynamic_offload(
            self.folder, torch_dtype=torch.bfloat16, apply_dynamic=True, dynamic_offload_config=config
        )

    def linear(self):
        model = copy.deepcopy(self.reference).cpu()
        result = ddo.enable_offload(
            model, route="dynamic_offload", execution_device=DEVICE, prefetch_depth=1, use_environment=False
        )
        return result, model


def raises(kind: type, fn) -> str:
    try:
        fn()
    except kind as e:
        return str(e)
    raise AssertionError(f"expected {kind.__name__}")


def check_kept_weights(case: Case) -> str:
    """A weight kept after remove() or unload() never faults the device: a resident one keeps
    its values, a streamed one (a placeholder between passes) raises a clear error."""
    for end in ("remove", "unload"):
        loaded = case.native()
        assert torch.equal(case.run(loaded.module), case.want)
        resident = loaded.module.get_parameter("x_embedder.weight")
        streamed = loaded.module.get_parameter("transformer_blocks.0.attn.to_q.weight")
        if end == "remove":
            loaded.offload.remove()
        else:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loaded.offload.unload()
        assert torch.equal(resident, case.reference.get_parameter("x_embedder.weight")), end
        raises(ddo.DynamicOffloadLifecycleError, lambda: streamed.float().sum().item())
        if DEVICE.startswith("cuda"):
            torch.cuda.synchronize()
        if end == "unload":
            loaded.offload.reload()
            assert torch.equal(case.run(loaded.module), case.want)
            loaded.offload.remove()
    return "resident weights readable, streamed ones a clear error; the device never faults"


def check_reads_between_passes(case: Case) -> str:
    """After forwards and after reclaim(), state_dict() and every parameter read the checkpoint's
    values (no other block's bytes)."""
    own = case.reference.state_dict()
    for route in ("native", "linear"):
        if route == "native":
            loaded = case.native()
            result, module = loaded.offload, loaded.module
        else:
            result, module = case.linear()
        for step in range(3):
            assert torch.equal(case.run(module), case.want), route
            state = module.state_dict()
            assert state.keys() == own.keys()
            for k, v in state.items():
                assert torch.equal(v.to(DEVICE), own[k]), f"{route}: state_dict()[{k}] after pass {step}"
            for k, p in module.named_parameters():
                assert torch.equal(p.detach().clone().to(DEVICE), own[k]), f"{route}: {k} after pass {step}"
        result.reclaim()
        for k, v in module.state_dict().items():
            assert torch.equal(v.to(DEVICE), own[k]), f"{route}: state_dict()[{k}] after reclaim()"
        assert torch.equal(case.run(module), case.want)
        result.remove()
    return "state_dict() and parameters equal the checkpoint after every pass and after reclaim()"


def check_reclaim_with_a_kept_view(case: Case) -> str:
    """A streamed weight kept from inside its block's forward views slot memory: reclaim()
    leaves the slots mapped (a read never faults the device) and frees them once it is dropped."""
    import warnings

    loaded = case.native()
    layer = loaded.module.single_transformer_blocks[0].proj_mlp
    kept = []
    h = layer.register_forward_hook(lambda m, _i, _o: kept.append(m.weight))
    assert torch.equal(case.run(loaded.module), case.want)
    h.remove()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert loaded.offload.reclaim() == (0, 0)
    assert any("kept the execution slots" in str(w.message) for w in seen), [str(w.message) for w in seen]
    # A re-plan the kept view refuses publishes new views of the same memory: still kept.
    assert loaded.offload.runtime.set_budget(64 << 20) is False
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert loaded.offload.reclaim() == (0, 0)
    assert any("re-plan refused" in str(w.message) for w in seen), [str(w.message) for w in seen]
    kept[0].float().sum().item()
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()
    kept.clear()
    slots, freed = loaded.offload.reclaim()
    assert slots > 0 and freed > 0
    assert torch.equal(case.run(loaded.module), case.want)
    loaded.offload.remove()
    return f"kept: slots stay mapped; dropped: {slots} slots, {freed >> 20} MiB reclaimed"


def check_replaced_block_weight(case: Case) -> str:
    """A block's weight replaced between passes is refused at that block, and restoring it
    recovers (each block's parameters are compared in its pre-hook)."""
    loaded = case.native()
    module = loaded.module
    assert torch.equal(case.run(module), case.want)
    owner = module.single_transformer_blocks[1].proj_out
    published = owner.weight
    owner.weight = torch.nn.Parameter(torch.zeros(published.shape, dtype=published.dtype, device=DEVICE), requires_grad=False)
    message = raises(ddo.DynamicOffloadLifecycleError, lambda: case.run(module))
    assert "single_transformer_blocks.1.proj_out.weight" in message, message
    owner.weight = published
    assert torch.equal(case.run(module), case.want)
    loaded.offload.remove()
    return f"refused: {message[:80]}"


def check_training_and_casts(case: Case) -> str:
    loaded = case.native()
    module = loaded.module
    case.run(module)
    raises(ddo.DynamicOffloadLifecycleError, lambda: module.train())
    raises(ddo.DynamicOffloadLifecycleError, lambda: module.requires_grad_(True))
    # Below the module itself: refused at the next forward.
    module.transformer_blocks[0].train()
    raises(ddo.DynamicOffloadLifecycleError, lambda: case.run(module))
    module.transformer_blocks[0].eval()
    # A parameter requiring grad matters only where autograd records: without it the output is
    # the resident one, with it the forward is refused.
    module.transformer_blocks[0].requires_grad_(True)
    assert torch.equal(case.run(module), case.want)
    raises(ddo.DynamicOffloadLifecycleError, lambda: module(**case.inputs))
    module.transformer_blocks[0].requires_grad_(False)
    moves = [lambda m: m.half(), lambda m: m.float(), lambda m: m.to("meta")]
    if DEVICE.startswith("cuda"):
        moves.append(lambda m: m.cpu())
    for move in moves:
        raises(ddo.DynamicOffloadLifecycleError, lambda: move(module))
    module.to(DEVICE)  # where it is: nothing changes
    with torch.no_grad():
        raises(ddo.DynamicOffloadLifecycleError, lambda: module.transformer_blocks[0].attn.to_q.weight.add_(1))
    assert torch.equal(case.run(module), case.want)
    loaded.offload.remove()
    return "train(), requires_grad_, casts, moves and writes refused; the next forward is correct"


def check_interrupts_and_threads(case: Case) -> str:
    loaded = case.native(vmm_resident_weight_budget_gb=8 / 1024)
    module = loaded.module

    def interrupt(_m, _args):
        raise KeyboardInterrupt

    handle = module.transformer_blocks[1].register_forward_pre_hook(interrupt)
    raises(KeyboardInterrupt, lambda: case.run(module))
    handle.remove()
    assert torch.equal(case.run(module), case.want), "after an interrupt"
    outcomes = []

    def worker():
        for _ in range(6):
            outcomes.append(torch.equal(case.run(module), case.want))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert outcomes == [True] * 24, outcomes
    loaded.offload.remove()
    return "an interrupted forward, then 24 forwards from 4 threads, all equal the resident run"


def check_rewritten_checkpoint(case: Case) -> str:
    """A checkpoint rewritten in place with its size and modification time restored is noticed
    before its bytes are used."""
    folder = case.folder + "-rewritten"
    import shutil

    shutil.copytree(case.folder, folder, dirs_exist_ok=True)
    path = os.path.join(folder, "diffusion_pytorch_model.safetensors")
    config = ddo.DynamicOffloadConfig(
        backend="vmm", execution_device=DEVICE, vmm_resident_weight_budget_gb=BUDGET, prefetch_depth=1,
        load_safetensors_backend="pread",
    )
    loaded = ddo.from_pretrained_with_dynamic_offload(
        folder, torch_dtype=torch.bfloat16, apply_dynamic=True, dynamic_offload_config=config
    )
    assert torch.equal(case.run(loaded.module), case.want)
    stat = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(stat.st_size - 64)
        f.write(bytes(64))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    message = raises(ddo.DynamicOffloadCheckpointError, lambda: case.run(loaded.module))
    loaded.offload.remove()
    return f"noticed: {message[:90]}"


def main() -> int:
    checks = [
        ("weights kept after the offload ends", check_kept_weights),
        ("reads between passes and after reclaim()", check_reads_between_passes),
        ("reclaim() beside a weight kept from a forward", check_reclaim_with_a_kept_view),
        ("a block's weight replaced between passes", check_replaced_block_weight),
        ("training, casts and writes refused", check_training_and_casts),
        ("an interrupt and concurrent forwards", check_interrupts_and_threads),
        ("a checkpoint rewritten in place", check_rewritten_checkpoint),
    ]
    with tempfile.TemporaryDirectory() as work:
        return report(checks, Case(work), DEVICE)


if __name__ == "__main__":
    sys.exit(main())
