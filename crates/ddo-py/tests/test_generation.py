"""ddo's one call: a whole generation planned for the machine. On the host backend a
``gpu_budget_gb`` makes the host device a card of that size, so the plan streams, the phases
share it, and every output stays equal to Diffusers' own run."""

from __future__ import annotations

import json
import os
import sys
import warnings

import numpy as np
import pytest
import torch

import ddo
from ddo import _native

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from tiny_pipelines import flux_pipeline, generate, own_memory  # noqa: E402

# A budget that streams the transformer's blocks and keeps T5 in an arena of its own.
BUDGET_GB = 0.045


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from diffusers import DiffusionPipeline

    path = tmp_path_factory.mktemp("flux")
    torch.manual_seed(0)
    pipe, extra = flux_pipeline(heads=16, t5_width=256)
    pipe.save_pretrained(path)
    want = generate(own_memory(DiffusionPipeline.from_pretrained(path)), extra)
    return path, extra, want


def test_the_plan_is_shown_before_anything_loads(folder):
    path, _, _ = folder
    plan = ddo.plan(path, gpu_budget_gb=BUDGET_GB)
    assert set(plan.components) == {"text_encoder", "text_encoder_2", "transformer", "vae"}
    t = plan.components["transformer"]
    assert t["route"] == "vmm_fast_runtime" and t["streamed_bytes_per_pass"] > 0, plan.table()
    assert plan.components["text_encoder_2"]["route"] == "vmm_fast_runtime", plan.table()
    assert plan.components["vae"]["route"] == "none"
    table = plan.table()
    for name, c in plan.components.items():
        assert f"| {name} | {c['phase']} | {c['route']} |" in table, table
        assert c["reasons"] and all(f"{name}: {r}" in table for r in c["reasons"])
    # Without a budget the host backend keeps every component where its weights are.
    assert {c["route"] for c in ddo.plan(path).components.values()} == {"none"}


def test_one_call_loads_by_the_plan_and_generates_what_diffusers_generates(folder):
    path, extra, want = folder
    result = ddo.load(path, gpu_budget_gb=BUDGET_GB)
    try:
        routes = {n: r.metrics_snapshot().as_dict()["execution"]["route"] for n, r in result.components.items()}
        assert routes["transformer"] == "vmm_fast_runtime" and routes["text_encoder_2"] == "vmm_fast_runtime", routes
        assert routes["vae"] == "none", routes
        for _ in range(2):
            np.testing.assert_array_equal(generate(result.pipeline, extra), want)
        m = result.measured()
        assert m["encode"] > 0 and m["denoise"] > 0 and m["step_seconds"] > 0, m
        report = result.report()
        assert "measured:" in report and "transformer: streamed" in report, report
    finally:
        result.remove()


def test_phases_that_need_the_card_evict_idle_arenas_and_outputs_stay_equal(folder):
    path, extra, want = folder
    result = ddo.load(path, gpu_budget_gb=BUDGET_GB)
    try:
        generate(result.pipeline, extra)
        assert result.share.evictions == 0
        # The encoder's phase now needs the whole card: the transformer gives its budget back
        # while the encoders run and takes it again for the steps.
        result.share.set_activation("encode", 40 << 20)
        budgets = []
        real = result._runtime("transformer").set_budget

        def recording(total):
            budgets.append(total)
            return real(total)

        result._runtime("transformer").set_budget = recording
        for _ in range(2):
            np.testing.assert_array_equal(generate(result.pipeline, extra), want)
        assert result.share.evictions >= 2, result.share.evictions
        planned = result.plan.components["transformer"]["budget_bytes"]
        assert budgets and budgets[-1] == planned and min(budgets) < planned, budgets
    finally:
        result.remove()


def test_a_pipeline_object_streams_its_own_tensors(folder):
    path, extra, want = folder
    from diffusers import DiffusionPipeline

    pipe = own_memory(DiffusionPipeline.from_pretrained(path))
    result = ddo.offload(pipe, gpu_budget_gb=BUDGET_GB)
    try:
        assert result.plan.components["transformer"]["route"] == "linear_runtime", result.plan.table()
        np.testing.assert_array_equal(generate(pipe, extra), want)
    finally:
        result.remove()
    np.testing.assert_array_equal(generate(pipe, extra), want)


def test_the_users_settings_win_over_the_plan(folder):
    path, extra, want = folder
    config = ddo.DynamicOffloadConfig(
        components={"text_encoder_2": ddo.ComponentPolicy(route="none")}, vmm_resident_weight_budget_gb=0.04
    )
    result = ddo.load(path, gpu_budget_gb=BUDGET_GB, config=config)
    try:
        assert "text_encoder_2" not in result.components or result.components["text_encoder_2"].route == "none"
        t = result.plan.components["transformer"]
        assert t["budget_bytes"] == int(0.04 * 2**30), t
        assert any("your configuration" in r for r in t["reasons"]), t["reasons"]
        assert "text_encoder_2" not in {n for n, c in result.plan.components.items() if c["route"] != "none"}
        np.testing.assert_array_equal(generate(result.pipeline, extra), want)
    finally:
        result.remove()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p: ddo.load(p, vae_decode="fast"), "vae_decode"),
        (lambda p: ddo.load(p, gpu_budget_gb=-1), "gpu_budget_gb"),
        (lambda p: ddo.load(p, gpu_budget_gb=float("nan")), "gpu_budget_gb"),
        (lambda p: ddo.plan(p, gpu_budget_gb=True), "gpu_budget_gb"),
        (lambda p: ddo.load(os.path.join(p, "transformer")), "model_index.json"),
        (lambda p: ddo.offload(object()), "components"),
        (lambda p: ddo.plan(p, config={"route": "none"}), "config must be a ddo.DynamicOffloadConfig"),
        (lambda p: ddo.load(p, config=ddo.ComponentPolicy(route="none")), "components=\\{name: policy\\}"),
        (lambda p: ddo.plan(p, dtype="bfloat16"), "dtype must be a torch.dtype"),
        (lambda p: ddo.plan(p, gpu_budget_gb=1e-30), "from 1 MiB"),
        (lambda p: ddo.plan(p, gpu_budget_gb=1e300), "to 1 PiB"),
    ],
)
def test_bad_input_says_what_to_change(folder, call, message):
    path, _, _ = folder
    with pytest.raises(ddo.DynamicOffloadError, match=message):
        call(str(path))


def test_numpy_budgets_plan_and_unknown_keywords_are_refused(folder):
    path, _, _ = folder
    assert ddo.plan(path, gpu_budget_gb=np.float32(BUDGET_GB)).components["transformer"]["route"] == "vmm_fast_runtime"
    with pytest.raises(TypeError, match="frobnicate"):
        ddo.plan(path, frobnicate=3)


def test_a_component_whose_weights_cannot_be_read_is_named_before_anything_loads(folder, tmp_path):
    import shutil

    path, _, _ = folder
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    for f in (broken / "transformer").glob("*.safetensors"):
        f.write_bytes(b"not a checkpoint")
    with pytest.raises(ddo.DynamicOffloadCheckpointError, match="transformer: the plan reads"):
        ddo.plan(broken)


def test_the_decode_rule_refuses_or_reduces_before_the_steps():
    fits = json.loads(_native.decode_fit(1 << 30, 2 << 30, "exact", "1024x1024"))
    assert fits["decision"] == "fits"
    refused = json.loads(_native.decode_fit(3 << 30, 2 << 30, "exact", "1024x1024"))
    assert refused["decision"] == "refused" and 'vae_decode="tiled"' in refused["message"], refused
    reduced = json.loads(_native.decode_fit(3 << 30, 2 << 30, "tiled", "1024x1024"))
    assert reduced["decision"] == "reduced" and reduced["mode"] == "tiled"
    with pytest.raises(ddo.DynamicOffloadConfigError, match="vae_decode"):
        _native.decode_fit(1, 1, "fast", "8x8")
    # Two measured decodes extrapolate to the size asked.
    need = _native.decode_need_bytes((1000, 2000), (4000, 5000), 16000)  # one frame
    assert 17000 <= need <= 17000 * 9 // 8 + 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode check measures the VAE on a CUDA device")
def test_a_decode_that_cannot_fit_is_refused_before_any_step(folder):
    path, extra, _ = folder
    result = ddo.load(path)
    try:
        decision = result.check_decode(height=8, width=8)
        assert decision["decision"] == "fits", decision
        big = result.check_decode(height=1 << 17, width=1 << 17)
        assert big["decision"] == "refused", big
        with pytest.raises(ddo.DynamicOffloadCapacityError, match="vae_decode"):
            result(prompt="a cat", height=1 << 17, width=1 << 17, num_inference_steps=1)
        assert result.measured().get("denoise") is None, "no step ran"
    finally:
        result.remove()


def test_the_command_line_prints_the_plan_before_anything_loads(folder, capsys):
    from ddo.tools.cli import main

    path, _, _ = folder
    assert main(["plan", str(path), "--gpu-budget-gb", str(BUDGET_GB)]) == 0
    out = capsys.readouterr().out
    assert "| transformer | denoise | vmm_fast_runtime |" in out and "why:" in out, out
    assert main(["plan", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {c["name"] for c in data["components"]} == {"text_encoder", "text_encoder_2", "transformer", "vae"}
    assert main(["plan", str(path / "transformer")]) == 1
    assert "model_index.json" in capsys.readouterr().err


def test_threads_generating_while_phases_evict_each_other_get_the_right_images(folder):
    import copy
    import threading

    from diffusers import FluxPipeline

    path, extra, want = folder
    result = ddo.load(path, gpu_budget_gb=BUDGET_GB)
    try:
        # Encoding and decoding each need the whole card: every phase change evicts.
        result.share.set_activation("encode", 40 << 20)
        result.share.set_activation("decode", 40 << 20)
        base = result.pipeline
        pipes = [FluxPipeline(**{**base.components, "scheduler": copy.deepcopy(base.scheduler)}) for _ in range(4)]
        outcomes: dict = {}

        def work(i):
            try:
                outcomes[i] = [np.array_equal(generate(pipes[i], extra), want) for _ in range(4)]
            except ddo.DynamicOffloadError as e:  # a clear refusal is allowed, a wrong image is not
                outcomes[i] = [str(e)]

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        with warnings.catch_warnings():  # resizes of a component another thread runs are put off, with a warning
            warnings.simplefilter("ignore")
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
        assert not any(t.is_alive() for t in threads)
        assert all(ok is True or isinstance(ok, str) for v in outcomes.values() for ok in v), outcomes
        assert sum(ok is True for v in outcomes.values() for ok in v) >= 6, outcomes
        np.testing.assert_array_equal(generate(base, extra), want)
    finally:
        result.remove()


def test_one_components_own_settings_win_over_the_plan_for_it(folder):
    path, extra, want = folder
    own = {"transformer": ddo.DynamicOffloadConfig(vmm_resident_weight_budget_gb=0.035)}
    result = ddo.load(path, gpu_budget_gb=BUDGET_GB, component_configs=own)
    try:
        assert result.plan.components["transformer"]["budget_bytes"] == int(0.035 * 2**30)
        assert result.plan.components["text_encoder_2"]["route"] == "vmm_fast_runtime"
        np.testing.assert_array_equal(generate(result.pipeline, extra), want)
    finally:
        result.remove()
    with pytest.raises(ddo.DynamicOffloadConfigError, match="unet"):
        ddo.load(path, component_configs={"unet": ddo.DynamicOffloadConfig()})

