"""Every bad input is a clear Python exception and leaves the module as it was."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import ddo


def state(model):
    return {k: (v.device, v.data_ptr()) for k, v in model.state_dict(keep_vars=True).items()}


def test_unknown_preset_and_route(flux):
    model, _ = flux
    before = state(model)
    with pytest.raises(ddo.DynamicOffloadConfigError, match='unknown preset "turbo" \\(from argument\\); valid presets: auto'):
        ddo.enable_offload(model, preset="turbo", use_environment=False)
    with pytest.raises(ValueError, match='route = "sideways" \\(from argument\\) is not valid'):
        ddo.enable_offload(model, route="sideways", use_environment=False)
    assert state(model) == before


def test_training_mode_is_refused(flux):
    model, _ = flux
    model.train()
    before = state(model)
    with pytest.raises(ddo.DynamicOffloadError, match="training mode.*call module.eval\\(\\) first"):
        ddo.enable_offload(model, route="dynamic_offload", use_environment=False)
    assert state(model) == before
    assert not hasattr(model, "_ddo_offload")


def test_an_offloaded_module_is_refused(flux):
    model, _ = flux
    r = ddo.enable_offload(model, route="dynamic_offload", use_environment=False)
    with pytest.raises(ddo.DynamicOffloadError, match="already offloaded by ddo"):
        ddo.enable_offload(model, route="dynamic_offload", use_environment=False)
    r.remove()
    ddo.enable_offload(model, route="none", use_environment=False).remove()


@pytest.mark.skipif(ddo._native.cuda_driver_present(), reason="needs a machine without a CUDA driver")
def test_vmm_without_a_cuda_driver(flux):
    model, _ = flux
    before = state(model)
    with pytest.raises(ddo.DynamicOffloadError, match="route vmm_fast_runtime on cuda:0 needs a CUDA driver and none was found"):
        ddo.enable_offload(model, backend="vmm", execution_device="cuda:0", use_environment=False)
    assert state(model) == before


def test_corrupt_checkpoint(tmp_path, flux):
    model, _ = flux
    model.save_pretrained(tmp_path)
    f = next(tmp_path.glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    f.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(ddo.DynamicOffloadError, match="invalid checkpoint .*goes beyond the data section"):
        ddo.from_pretrained_with_dynamic_offload(tmp_path)
    cli = subprocess.run([sys.executable, "-m", "ddo", "inspect", str(f)], capture_output=True, text=True)
    assert cli.returncode == 1
    assert cli.stderr.startswith("error: invalid checkpoint")


def test_cli(tmp_path, flux):
    model, _ = flux
    model.save_pretrained(tmp_path)
    out = subprocess.run([sys.executable, "-m", "ddo", "inspect", str(tmp_path)], capture_output=True, text=True, check=True)
    assert "transformer_blocks.0." in out.stdout and " tensors in 1 file(s)" in out.stdout
    presets = subprocess.run([sys.executable, "-m", "ddo", "presets"], capture_output=True, text=True, check=True)
    assert presets.stdout.startswith("DDO presets")


def test_cleanup_on_error_reraises_the_original(flux):
    model, inputs = flux
    result = ddo.enable_offload(model, route="dynamic_offload", use_environment=False)

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with result.cleanup_on_error():
            raise Boom("original")
    assert not hasattr(model, "_ddo_offload")
    # A cleanup failure is attached, never raised in place of the original.
    result2 = ddo.enable_offload(model, route="none", use_environment=False)

    def broken():
        raise RuntimeError("cleanup failed")

    result2.remove = broken
    with pytest.raises(Boom) as info:
        with result2.cleanup_on_error():
            raise Boom("original")
    assert isinstance(info.value.ddo_cleanup_error, RuntimeError)
    # The success path does nothing.
    result3 = ddo.DynamicOffloadApplyResult(module=model, route="none", settings=result2.settings, execution_device=torch.device("cpu"))
    with result3.cleanup_on_error():
        pass


def test_a_failed_attach_leaves_the_module_as_it_was(flux):
    model, inputs = flux
    before = state(model)
    with pytest.raises(ddo.DynamicOffloadConfigError, match="vmm_module_pattern"):
        ddo.enable_offload(model, route="dynamic_offload", vmm_module_pattern="(", use_environment=False)
    assert state(model) == before
    assert getattr(model, "_ddo_offload", None) is None


def test_inspect_escapes_names_a_hostile_file_chose(tmp_path, capsys):
    import struct

    from ddo.__main__ import main

    name = "evil\x1b[2J\x07name"
    header = json.dumps({name: {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\0\0")
    assert main(["inspect", str(tmp_path / "x.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "evil\\x1b[2J\\x07name" in out


def test_every_error_is_a_dynamic_offload_error():
    assert issubclass(ddo.DynamicOffloadConfigError, ddo.DynamicOffloadError)
    assert issubclass(ddo.DynamicOffloadConfigError, ValueError)
    assert issubclass(ddo.DynamicOffloadCapacityError, ddo.DynamicOffloadConfigError)
    assert issubclass(ddo.DynamicOffloadCheckpointError, ddo.DynamicOffloadError)
    assert issubclass(ddo.DynamicOffloadLifecycleError, ddo.DynamicOffloadError)
    assert issubclass(ddo.DynamicOffloadSourceChangedError, ddo.DynamicOffloadCheckpointError)
    assert not issubclass(ddo.DynamicOffloadSourceChangedError, ValueError)
    assert ddo.DynamicOffloadConfigError.__module__ == "ddo._native"
    assert ddo.DynamicOffloadSourceChangedError.__module__ == "ddo._native"
    with pytest.raises(ddo.DynamicOffloadError, match='unknown preset "turbo"'):
        ddo.resolve_dynamic_offload_backend("linear", "turbo")


def test_a_checkpoint_folder_whose_name_is_not_utf8_opens(tmp_path, flux):
    import os

    model, inputs = flux
    folder = os.path.join(os.fsencode(tmp_path), b"model-\xff")
    os.makedirs(folder)
    path = os.fsdecode(folder)  # surrogate-escaped, as Python lists such names
    model.save_pretrained(path)
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=0.02)
    loaded = ddo.from_pretrained_with_dynamic_offload(path, apply_dynamic=True, dynamic_offload_config=config)
    with torch.no_grad():
        assert torch.equal(loaded.module(**inputs)[0], model(**inputs)[0])
    loaded.offload.remove()


def test_releases_that_failed_at_drop_are_warned_about(monkeypatch, flux):
    """A release that failed when ddo's memory was dropped is noted natively (nothing freed by
    force); the package shows each note as a warning at the next unload, remove or attach."""
    model, _ = flux
    assert ddo._native.take_drop_failures() == ([], 0), "a release failed in an earlier test"
    result = ddo.enable_offload(model, route="dynamic_offload", use_environment=False)
    kept = "releasing the arena when it was dropped failed: close refused (2.00 MiB kept, never freed by force)"
    notes = [([kept], 2)]
    monkeypatch.setattr(ddo._native, "take_drop_failures", lambda: notes.pop() if notes else ([], 0))
    with pytest.warns(RuntimeWarning) as seen:
        result.remove()
    assert [str(w.message) for w in seen] == [f"ddo: {kept}; 2 more releases failed when dropped"]


def test_a_release_that_failed_at_drop_is_a_real_note_warned_once():
    """A component collected while a lease is still held (a forward abandoned in a way no hook
    saw) cannot close: the native note reaches the next attach as one warning, and only once."""
    import gc

    from conftest import tiny_flux

    assert ddo._native.take_drop_failures() == ([], 0)
    model, _ = tiny_flux()
    result = ddo.enable_offload(model, route="dynamic_offload", prefetch_depth=1, use_environment=False)
    session = result.runtime.session
    session.begin_pass(0)
    session.acquire(1, 0)  # never released
    # The module's views hold the arena's memory: it closes when the last of them goes.
    del session, result, model
    gc.collect()
    other, _ = tiny_flux()
    with pytest.warns(RuntimeWarning, match=r"ddo: releasing the arena when it was dropped failed: .*lease"):
        again = ddo.enable_offload(other, route="dynamic_offload", use_environment=False)
    assert ddo._native.take_drop_failures() == ([], 0)
    again.remove()


@pytest.mark.parametrize("value", [2e10, 1e300])
def test_a_size_past_64_bits_names_the_setting_and_its_origin(flux, value):
    model, _ = flux
    before = state(model)
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=value)
    with pytest.raises(ddo.DynamicOffloadConfigError, match=r"vmm_resident_weight_budget_gb = .* \(from config\) is out of range"):
        ddo.enable_offload(model, config=config, use_environment=False)
    assert state(model) == before
