"""The everyday tools a host expects: the ``ddo`` logger, progress bars, ``python -m ddo doctor``
and ``python -m ddo bench``, on the CPU with tiny random models."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import sys

import pytest
import torch

import ddo
from ddo import progress
from ddo.tools import doctor
from ddo.__main__ import main

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from tiny_pipelines import flux_pipeline  # noqa: E402

from conftest import tiny_flux  # noqa: E402

GIB = 1 << 30
TINY_BUDGET_GB = 6 / 1024  # three 2 MiB granules: the tiny models' blocks stream


@pytest.fixture
def flux_folder(tmp_path):
    model, _ = tiny_flux()
    model.save_pretrained(tmp_path / "flux")
    return tmp_path / "flux"


@pytest.fixture
def vae_folder(tmp_path, vae):
    model, _ = vae
    model.save_pretrained(tmp_path / "vae")
    return tmp_path / "vae"


def stored_bytes(folder) -> int:
    from safetensors.torch import load_file

    return sum(
        t.numel() * t.element_size()
        for name in os.listdir(folder)
        if name.endswith(".safetensors")
        for t in load_file(os.path.join(folder, name)).values()
    )


# ---- logger ----------------------------------------------------------------------------------


def test_the_ddo_logger_is_silent_until_the_host_configures_it(flux, caplog, capsys):
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("ddo").handlers)
    model, _ = flux
    caplog.set_level(logging.INFO, logger="ddo")
    result = ddo.enable_offload(model, route="dynamic_offload", use_environment=False)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("ddo")]
    assert any("route linear_runtime on cpu" in line for line in lines), lines
    assert capsys.readouterr().err == ""
    result.remove()


def test_verbose_lines_go_to_the_hosts_handlers_when_it_asked_for_them(flux, caplog, capsys):
    model, _ = flux
    caplog.set_level(logging.INFO, logger="ddo")
    result = ddo.enable_offload(model, route="dynamic_offload", use_environment=False, verbose=True)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("ddo")]
    assert any("route linear_runtime" in line for line in lines) and any("DDO profile" in line for line in lines)
    assert "DDO profile" not in capsys.readouterr().err  # delivered once, by the host's logging
    result.remove()


# ---- progress bars ---------------------------------------------------------------------------


def load_tiny_flux_pipeline(tmp_path):
    pipe, _ = flux_pipeline()
    pipe.save_pretrained(tmp_path / "pipe")
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=TINY_BUDGET_GB)
    return ddo.from_pretrained_pipeline_with_dynamic_offload(tmp_path / "pipe", dynamic_offload_config=config)


def test_forced_bars_show_a_pipeline_load_component_by_component(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DDO_PROGRESS", "1")
    result = load_tiny_flux_pipeline(tmp_path)
    err = capsys.readouterr().err
    done = re.findall(r"ddo pipeline: 100%.*?(\d+)/(\d+)", err)
    assert done and done[-1][0] == done[-1][1] and int(done[-1][0]) >= 5, err[-2000:]
    assert "ddo transformer" in err  # the transformer's load stages (validate, load, attach)
    assert not result.metrics_snapshots()["transformer"].as_dict()["setup"].get("warnings")  # DDO_PROGRESS is known
    result.remove()


def test_no_bars_with_ddo_progress_0(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DDO_PROGRESS", "0")
    result = load_tiny_flux_pipeline(tmp_path)
    err = capsys.readouterr().err
    # (transformers draws its own bars, "Loading weights", by its own switches)
    assert "ddo pipeline" not in err and "ddo transformer" not in err and "ddo text_encoder" not in err, err[-2000:]
    result.remove()


def test_bars_follow_the_terminal_and_diffusers_switch(monkeypatch):
    from diffusers.utils import logging as diffusers_logging

    class Terminal:
        def isatty(self) -> bool:
            return True

        def write(self, text: str) -> int:
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.delenv("DDO_PROGRESS", raising=False)
    assert not progress.progress_enabled()  # pytest's stderr is not a terminal
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert progress.progress_enabled()
    diffusers_logging.disable_progress_bar()
    try:
        assert not progress.progress_enabled()
        monkeypatch.setenv("DDO_PROGRESS", "1")
        assert progress.progress_enabled()  # forced over Diffusers' switch
    finally:
        diffusers_logging.enable_progress_bar()
    monkeypatch.setenv("DDO_PROGRESS", "sometimes")
    with pytest.raises(ddo.DynamicOffloadConfigError, match="DDO_PROGRESS = 'sometimes'.*use 1"):
        progress.progress_enabled()


# ---- doctor ----------------------------------------------------------------------------------


def test_doctor_measures_this_machine_and_recommends_for_a_checkpoint(flux_folder, capsys):
    assert main(["doctor", "--checkpoint", str(flux_folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["bytes"] == stored_bytes(flux_folder)
    assert report["model"]["blocks"] == 4  # two double and two single blocks
    assert report["host"]["mem_available_bytes"] > 0 and report["host"]["mem_total_bytes"] > 0
    disk = report["disk"]
    files = sum(os.path.getsize(flux_folder / n) for n in os.listdir(flux_folder) if n.endswith(".safetensors"))
    assert disk["buffered_gbps"] > 0 and disk["bytes_read"] == files  # the whole file, header included
    assert disk["direct_gbps"] or "O_DIRECT refused" in disk["direct_note"]
    if not torch.cuda.is_available():
        assert report["gpu"] == {"note": "no CUDA device: PyTorch sees none"}
    settings = {r["setting"]: r for r in report["recommendations"]}
    assert "vmm_source_cache_gb" in settings and all(r["why"] for r in report["recommendations"])
    ddo.DynamicOffloadConfig(**report["config"]).to_json()  # the recommended configuration is valid
    assert main(["doctor", "--checkpoint", str(flux_folder)]) == 0
    text = capsys.readouterr().out
    assert "recommend" in text and "ddo.DynamicOffloadConfig(" in text and "MemAvailable" in text


def test_doctor_falls_back_to_buffered_reads_when_o_direct_is_refused(tmp_path, monkeypatch, capsys):
    def refused(_path, _limit):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(doctor, "_read_direct", refused)
    monkeypatch.setattr(doctor, "DISK_SAMPLE_BYTES", 16 << 20)
    assert main(["doctor", "--dir", str(tmp_path), "--json"]) == 0
    disk = json.loads(capsys.readouterr().out)["disk"]
    assert disk["direct_gbps"] is None and "O_DIRECT refused (Invalid argument)" in disk["direct_note"]
    assert disk["buffered_gbps"] > 0 and disk["bytes_read"] == 16 << 20
    assert os.listdir(tmp_path) == []  # the temp file is gone


def test_doctor_refuses_a_missing_checkpoint(tmp_path, capsys):
    assert main(["doctor", "--checkpoint", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "pass a .safetensors file" in err


def measured(free_gib: float, available_gib: float, *, memlock=None, cap_ipc_lock=True):
    gpu = {"free_bytes": int(free_gib * GIB), "total_bytes": 24 * GIB, "pinned_gbps": 25.0, "pageable_gbps": 8.0}
    host = {
        "mem_available_bytes": int(available_gib * GIB), "mem_total_bytes": 64 * GIB, "rlimits_observed": True,
        "rlimit_memlock_bytes": memlock, "cap_ipc_lock": cap_ipc_lock, "rlimit_memlock_hard_bytes": memlock,
    }
    return gpu, host, {"direct_gbps": 2.0, "buffered_gbps": 1.5}


def test_doctor_recommendations_follow_the_measurements(monkeypatch):
    monkeypatch.delenv("DDO_SYSTEM_RAM_HEADROOM_GB", raising=False)
    monkeypatch.delenv("DDO_PREFETCH_DEPTH", raising=False)
    model = {"bytes": int(23.8 * GIB), "largest_block_bytes": int(0.4 * GIB), "outside_blocks_bytes": int(0.5 * GIB)}
    recs, config = doctor.recommend(model, *measured(free_gib=10.1, available_gib=60))
    by = {r["setting"]: r for r in recs}
    assert config == {"backend": "vmm", "vmm_resident_weight_budget_gb": 8.0, "vmm_source_cache_gb": 0}
    assert "> free VRAM 10.10 GiB - 2 GiB headroom -> backend vmm, vmm_resident_weight_budget_gb=8" in by["vmm_resident_weight_budget_gb"]["why"]
    assert "map the checkpoint" in by["vmm_source_cache_gb"]["why"]
    # Resident when it fits; retained host bytes when the host cannot hold it all; a refusal when
    # the GPU cannot hold the working set (4 slots of the largest block and what is outside blocks).
    assert doctor.recommend(model, *measured(free_gib=30, available_gib=60))[1] == {"route": "none"}
    recs, config = doctor.recommend(model, *measured(free_gib=10.1, available_gib=20))
    assert config["vmm_source_cache_gb"] == 14.0  # 20 GiB available - 6 GiB system_ram_headroom_gb
    assert "read the other 9.80 GiB from disk on each forward" in {r["setting"]: r for r in recs}["vmm_source_cache_gb"]["why"]
    recs, config = doctor.recommend(model, *measured(free_gib=3.5, available_gib=60))
    assert "vmm_resident_weight_budget_gb" not in config
    assert "below the working set 2.10 GiB" in {r["setting"]: r for r in recs}["vmm_resident_weight_budget_gb"]["why"]
    recs, _ = doctor.recommend(model, *measured(free_gib=10.1, available_gib=60, memlock=8 << 20, cap_ipc_lock=False))
    assert "RLIMIT_MEMLOCK 8.00 MiB < 23.80 GiB" in {r["setting"]: r for r in recs}["ulimit -l"]["why"]


# ---- bench -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["flux", "vae"])
def test_bench_runs_every_route_side_by_side_with_equal_outputs(model, flux_folder, vae_folder, capsys):
    folder = {"flux": flux_folder, "vae": vae_folder}[model]
    args = ["bench", str(folder), "--device", "cpu", "--steps", "2", "--resolution", "32", "--budget-gb", str(TINY_BUDGET_GB)]
    assert main(args) == 0
    table = capsys.readouterr().out
    for route in ("resident", "linear", "vmm", "diffusers_leaf"):
        assert re.search(rf"^{route} ", table, re.M), table
    assert "linear_runtime" in table and "vmm_fast_runtime" in table and "differs" not in table, table
    assert main([*args, "--json", "--routes", "resident,vmm"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {r["route"]: r for r in result["rows"]}
    assert [r["output"] for r in result["rows"]] == ["reference", "equal"], rows
    assert rows["vmm"]["seconds"] > 0 and rows["resident"]["ratio"] == 1.0 and rows["vmm"]["error"] is None
    assert result["model"]["stored_bytes"] == stored_bytes(folder)


def test_bench_refuses_a_class_it_has_no_inputs_for(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    assert main(["bench", str(tmp_path), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "names UNet2DModel" in err and "AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel" in err
    assert main(["bench", str(tmp_path), "--routes", "resident,fast"]) == 1
    assert "unknown route(s) fast; choose among resident, linear, vmm, diffusers_leaf" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--device", "bogus"], "is not a device"),
        (["--device", "meta"], "runs on cuda, cuda:N or cpu"),
        (["--resolution", "-5"], "multiple of 16"),
        (["--resolution", "1000"], "multiple of 16"),
        (["--budget-gb", "nan"], "finite number"),
        (["--budget-gb", "0"], "above 0"),
        (["--device", ""], "--device is empty"),
    ],
)
def test_bench_refuses_bad_arguments_with_what_to_pass(flux_folder, capsys, extra, says):
    assert main(["bench", str(flux_folder), *extra]) == 1
    assert says in capsys.readouterr().err


def test_bench_refuses_a_config_that_is_not_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"_class_name": "FluxTransformer2DModel", ')
    assert main(["bench", str(tmp_path), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err



@pytest.mark.parametrize("edit", [{"in_channels": None}, {"in_channels": "4"}, {"in_channels": -1}, {"_class_name": "__version__"}])
def test_bench_refuses_a_config_it_cannot_build_inputs_for(flux_folder, tmp_path, capsys, edit):
    import shutil

    folder = tmp_path / "edited"
    shutil.copytree(flux_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    for k, v in edit.items():
        if v is None:
            del config[k]
        else:
            config[k] = v
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["bench", str(folder), "--device", "cpu", "--resolution", "16"]) == 1
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err, err


def test_bench_takes_one_checkpoint_file_with_the_config_beside_it_or_given(flux_folder, tmp_path, capsys):
    import shutil

    (file,) = [flux_folder / n for n in os.listdir(flux_folder) if n.endswith(".safetensors")]
    args = ["--device", "cpu", "--steps", "1", "--resolution", "32", "--budget-gb", str(TINY_BUDGET_GB), "--json",
            "--routes", "resident,linear,vmm"]
    # The config.json beside the file.
    assert main(["bench", str(file), *args]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["output"] for r in result["rows"]] == ["reference", "equal", "equal"], result["rows"]
    assert result["model"]["path"] == str(file) and result["model"]["class"] == "FluxTransformer2DModel"
    assert result["model"]["config"] == os.path.realpath(flux_folder / "config.json")
    assert result["model"]["stored_bytes"] == stored_bytes(flux_folder)
    # A file alone, under another name, with --config naming the config.json or its folder.
    alone = tmp_path / "weights" / "flux-tiny.safetensors"
    alone.parent.mkdir()
    shutil.copy(file, alone)
    assert main(["bench", str(alone), *args]) == 1
    err = capsys.readouterr().err
    assert "no config.json beside it: pass --config with the model's config.json" in err, err
    for config in (flux_folder / "config.json", flux_folder):
        assert main(["bench", str(alone), "--config", str(config), *args]) == 0
        rows = json.loads(capsys.readouterr().out)["rows"]
        assert [r["output"] for r in rows] == ["reference", "equal", "equal"], rows
    # What else is refused, saying what to pass.
    assert main(["bench", str(alone), "--config", str(tmp_path / "missing.json"), *args]) == 1
    assert "--config" in capsys.readouterr().err
    assert main(["bench", str(flux_folder), "--config", str(flux_folder), *args]) == 1
    assert "--config is for a checkpoint file" in capsys.readouterr().err
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert main(["bench", str(tmp_path / "model.gguf"), *args]) == 1
    assert "is not a .safetensors file" in capsys.readouterr().err
    assert main(["bench", str(tmp_path / "nothing"), *args]) == 1
    assert "no such file or folder" in capsys.readouterr().err


def test_host_costs_measures_each_part_of_ddos_host_work(tmp_path, capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benches"))
    import host_costs

    assert host_costs.main(["--device", "cpu", "--blocks", "4", "--rounds", "2", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([0-9.]+) \|", out, re.M))
    for what in [
        "step, plain", "step, ddo, all resident", "step, ddo, every block streamed",
        "pre + post hooks of a resident block, in a pass", "of which native reached",
        "pre + post hooks of a block taking its own lease", "of which native acquire + release",
        "one block's parameters, compared in its pre-hook",
    ]:
        assert float(rows[what]) > 0, (what, out)
    assert re.search(r"per-forward check at the pass's start \((\d+) parameters", out), out


# ---- pipeline folders ------------------------------------------------------------------------


@pytest.fixture
def pipeline_folder(tmp_path):
    torch.manual_seed(0)
    pipe, _ = flux_pipeline()
    pipe.save_pretrained(tmp_path / "pipe")
    return tmp_path / "pipe"


def test_doctor_reports_each_model_component_of_a_pipeline_folder(pipeline_folder, capsys):
    assert main(["doctor", "--checkpoint", str(pipeline_folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    pipeline = report["pipeline"]
    components = {c["name"]: c for c in pipeline["components"]}
    assert set(components) == {"transformer", "text_encoder", "text_encoder_2", "vae"}, components.keys()
    assert pipeline["class"] == "FluxPipeline" and pipeline["denoiser"] == "transformer"
    for name, c in components.items():
        assert c["bytes"] == stored_bytes(pipeline_folder / name) and c["fits_device"] is True
        assert c["dtypes"] == {"F32": c["bytes"]}, c["dtypes"]
    assert components["transformer"]["cls"] == "diffusers.FluxTransformer2DModel"
    assert components["text_encoder"]["cls"] == "transformers.CLIPTextModel"
    assert report["model"]["blocks"] == 4 and report["recommendations"]  # the denoiser's recommendations
    assert main(["doctor", "--checkpoint", str(pipeline_folder)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^  transformer +diffusers.FluxTransformer2DModel: .* fits whole in .*<- denoiser", text, re.M), text
    assert re.search(r"^  vae +diffusers.AutoencoderKL: ", text, re.M), text


def test_bench_times_the_denoiser_of_a_pipeline_folder_at_a_size_that_suits_the_cpu(pipeline_folder, capsys):
    args = ["bench", str(pipeline_folder), "--device", "cpu", "--routes", "resident,vmm", "--budget-gb", str(TINY_BUDGET_GB)]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"]["component"] == "transformer" and result["model"]["class"] == "FluxTransformer2DModel"
    assert (result["dtype"], result["resolution"], result["steps"]) == ("float32", 256, 2)
    assert "picked for the CPU" in result["picked"]
    assert [r["output"] for r in result["rows"]] == ["reference", "equal"], result["rows"]
    assert main([*args, "--resolution", "32", "--dtype", "bfloat16", "--steps", "1"]) == 0
    table = capsys.readouterr().out
    assert "(the transformer of the pipeline" in table and "bfloat16 on cpu, 32 px" in table and "as given" in table, table
