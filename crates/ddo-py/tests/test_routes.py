"""Every route gives exactly the resident outputs on several architectures."""

from __future__ import annotations

import copy

import pytest
import torch

import ddo

MODELS = ["flux", "sd3", "vae", "clip"]


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    "route,kwargs",
    [
        ("linear_runtime", dict(route="dynamic_offload")),
        ("diffusers_group_offload", dict(route="diffusers_group_offload")),
        ("none", dict(route="none")),
    ],
)
def test_route_outputs_equal_resident(request, name, route, kwargs):
    model, inputs = request.getfixturevalue(name)
    if name == "clip" and route == "diffusers_group_offload":
        pytest.skip("Diffusers group offload targets Diffusers models")
    reference = run(copy.deepcopy(model), inputs)
    result = ddo.enable_offload(model, component="transformer", use_environment=False, **kwargs)
    assert result.runtime_route == route
    assert result.route == ("dynamic_offload" if route == "linear_runtime" else route)
    for _ in range(2):
        got = run(model, inputs)
        assert torch.equal(got, reference), f"{name} {route}: outputs differ"
    snapshot = result.metrics_snapshot()
    data = snapshot.as_dict()
    assert data["execution"]["route"] == route
    assert "DDO profile" in snapshot.format_profile()
    if route == "linear_runtime":
        units = ddo.find_execution_units(model)
        assert len(units) >= 2
        assert data["runtime"]["passes"] == 2
        assert data["runtime"]["uploads"] >= len(units)
        assert data["setup"]["host_source"] == "host_tensors"
        assert data["setup"]["unit_count"] == len(units) + 1  # the blocks and the resident rest
    result.remove()
    assert torch.equal(run(model, inputs), reference)


def test_linear_serves_the_modules_own_host_tensors_and_remove_gives_them_back(flux):
    model, inputs = flux
    originals = dict(model.named_parameters())
    host = {n: p.data_ptr() for n, p in originals.items()}
    result = ddo.enable_offload(model, route="dynamic_offload", use_environment=False)
    # Parameters now view arena memory; the host tensors are the session's source, not copies.
    assert all(p.data_ptr() != host[n] for n, p in model.named_parameters())
    setup = result.metrics_snapshot().as_dict()["setup"]
    total = sum(p.numel() * p.element_size() for p in originals.values())
    assert setup["total_bytes"] == total
    run(model, inputs)
    result.remove()
    assert all(model.get_parameter(n) is p for n, p in originals.items())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == host


def test_unload_then_reload_from_the_checkpoint(tmp_path, flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    model.save_pretrained(tmp_path / "transformer")
    loaded = ddo.from_pretrained_with_dynamic_offload(
        tmp_path / "transformer",
        apply_dynamic=True,
        dynamic_offload_config=ddo.DynamicOffloadConfig(route="dynamic_offload"),
    )
    assert loaded.bound == len(loaded.source["tensors"]) > 0
    result = loaded.offload
    assert torch.equal(run(loaded.module, inputs), reference)
    result.unload()
    assert all(p.is_meta for p in loaded.module.parameters())
    result.reload()
    assert torch.equal(run(loaded.module, inputs), reference)


def test_pipeline_components_get_their_own_routes(flux, vae, clip):
    class Pipe:
        def __init__(self):
            self.components = {"transformer": flux[0], "vae": vae[0], "text_encoder": clip[0], "scheduler": object()}

    results = ddo.enable_pipeline_offload(Pipe(), use_environment=False)
    assert set(results) == {"transformer", "vae", "text_encoder"}
    assert results["transformer"].runtime_route == "linear_runtime"
    assert results["vae"].route == "diffusers_group_offload"
    assert results["vae"].setup["group_offload"]["use_stream"] is False
    assert results["text_encoder"].route == "diffusers_group_offload"
    assert torch.equal(run(vae[0], vae[1]), run(vae[0], vae[1]))
    for r in results.values():
        r.remove()


def test_shared_parameters_stay_resident_and_outputs_match():
    class Block(torch.nn.Module):
        def __init__(self, shared):
            super().__init__()
            self.shared = shared
            self.own = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.own(self.shared(x)).relu()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            shared = torch.nn.Linear(8, 8)
            self.blocks = torch.nn.ModuleList([Block(shared) for _ in range(3)])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(2, 8)
    reference = net(x).detach().clone()
    # Two slots for three blocks: the blocks stream (with three slots they would all fit).
    result = ddo.enable_offload(net, route="dynamic_offload", prefetch_depth=1, use_environment=False)
    setup = result.metrics_snapshot().as_dict()["setup"]
    # The shared Linear is one resident unit's; each block streams its own Linear.
    assert setup["unit_count"] == 4 and setup["streamed_units"] == 3, setup
    assert setup["tensor_count"] == 8
    with torch.no_grad():
        assert torch.equal(net(x), reference)
        assert torch.equal(net(x), reference)
    result.remove()


def test_a_vae_s_encode_and_decode_are_passes_on_the_arena_route(vae):
    model, inputs = vae
    x = inputs["sample"]
    with torch.no_grad():
        want_latent = copy.deepcopy(model).encode(x).latent_dist.mode()
        want = copy.deepcopy(model).decode(want_latent).sample
    result = ddo.enable_offload(model, component="vae", route="dynamic_offload", execution_device="cpu", use_environment=False)
    with torch.no_grad():
        assert torch.equal(model.encode(x).latent_dist.mode(), want_latent)
        assert torch.equal(model.decode(want_latent).sample, want)
    assert result.metrics_snapshot().as_dict()["runtime"]["passes"] == 2
    # Each entry point gets the pass's guards: an input that requires grad is refused.
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="an input requires grad"):
        model.decode(want_latent.clone().requires_grad_())
    result.remove()
