"""Settings act from Python as documented: the execution device from DDO_EXECUTION_DEVICE,
misspelt variables reported, verbose and show_profile print, refused peer names."""

from __future__ import annotations

import pytest
import torch

import ddo


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def test_the_execution_device_comes_from_the_environment(flux):
    model, inputs = flux
    result = ddo.enable_offload(model, route="dynamic_offload", environ={"DDO_EXECUTION_DEVICE": "cpu"})
    assert result.execution_device == torch.device("cpu")
    setup = result.metrics_snapshot().as_dict()["setup"]
    assert setup["execution_device"] == "cpu"
    assert result.metrics_snapshot().as_dict()["configuration"]["dynamic_offload_execution_device"] == "cpu"
    result.remove()


@pytest.mark.skipif(ddo._native.cuda_driver_present(), reason="needs a machine without a CUDA driver")
def test_an_explicit_cuda_device_without_a_driver_is_an_error_even_from_the_environment(flux):
    model, _ = flux
    with pytest.raises(ddo.DynamicOffloadError, match="needs a CUDA driver and none was found"):
        ddo.enable_offload(model, route="dynamic_offload", environ={"DDO_EXECUTION_DEVICE": "cuda:0"})


def test_an_invalid_device_names_the_setting(flux):
    model, _ = flux
    with pytest.raises(ddo.DynamicOffloadConfigError, match='execution_device = "abc"'):
        ddo.enable_offload(model, route="dynamic_offload", environ={"DDO_EXECUTION_DEVICE": "abc"})


def test_a_misspelt_variable_is_reported(flux):
    model, inputs = flux
    with pytest.warns(UserWarning, match="DDO_PREFETCH_DEPT is not a ddo variable; did you mean DDO_PREFETCH_DEPTH"):
        result = ddo.enable_offload(model, route="dynamic_offload", environ={"DDO_PREFETCH_DEPT": "3"})
    run(model, inputs)
    snapshot = result.metrics_snapshot()
    assert any("DDO_PREFETCH_DEPT" in w for w in snapshot.as_dict()["setup"]["warnings"])
    assert "warning: DDO_PREFETCH_DEPT" in snapshot.format_profile()
    result.remove()


def test_verbose_prints_at_attach_and_show_profile_at_remove(flux, capsys):
    model, inputs = flux
    result = ddo.enable_offload(model, route="dynamic_offload", use_environment=False, verbose=True)
    err = capsys.readouterr().err
    assert "route linear_runtime on cpu" in err and "DDO profile" in err
    result.remove()
    assert "DDO profile" not in capsys.readouterr().err
    result = ddo.enable_offload(model, route="dynamic_offload", use_environment=False, show_profile=True)
    assert capsys.readouterr().err == ""
    run(model, inputs)
    result.remove()
    err = capsys.readouterr().err
    assert "DDO profile" in err and "passes=1" in err


def test_packing_and_pinning_settings_show_in_the_profile(flux):
    model, inputs = flux
    packed = ddo.enable_offload(model, route="dynamic_offload", use_environment=False, small_tensor_threshold_kb=1024)
    assert packed.metrics_snapshot().as_dict()["setup"]["packed_bytes"] > 0
    packed.remove()
    unpacked = ddo.enable_offload(model, route="dynamic_offload", use_environment=False, small_tensor_threshold_kb=0)
    assert unpacked.metrics_snapshot().as_dict()["setup"]["packed_bytes"] == 0
    run(model, inputs)
    unpacked.remove()
    unpinned = ddo.enable_offload(
        model, route="dynamic_offload", use_environment=False, pin_cpu_memory=False, small_tensor_threshold_kb=0
    )
    setup = unpinned.metrics_snapshot().as_dict()["setup"]
    assert setup["registered_bytes"] == 0 and setup["unregistered_reason"] == "pin_cpu_memory is off"
    unpinned.remove()


def test_peer_settings_ddo_does_not_implement_are_refused(flux):
    model, _ = flux
    with pytest.raises(ddo.DynamicOffloadConfigError, match="max_resident_module_budget_gb = 8 .* is not supported by ddo"):
        ddo.enable_offload(model, route="dynamic_offload", use_environment=False, max_resident_module_budget_gb=8)
    with pytest.raises(ddo.DynamicOffloadConfigError, match="offload_device"):
        ddo.enable_offload(model, route="dynamic_offload", environ={"DDO_OFFLOAD_DEVICE": "cuda:1"})
    # At their defaults they are accepted.
    ddo.enable_offload(model, route="dynamic_offload", use_environment=False, offload_device="cpu").remove()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(resident_module_budget_gb=float("nan")), r"resident_module_budget_gb = NaN \(from argument\) must be a finite number"),
        (dict(auto_vram_headroom_gb=float("inf")), r"auto_vram_headroom_gb = inf \(from argument\) must be a finite number"),
        (dict(prefetch_depth=1.5), r'prefetch_depth = "1.5" \(from argument\) is not valid; allowed: a whole number'),
        (dict(prefetch_depth=-1), r'prefetch_depth = "-1" \(from argument\) is not valid'),
        (dict(pin_cpu_memory="maybe"), r'pin_cpu_memory = "maybe" \(from argument\) is not valid; allowed: a boolean'),
    ],
)
def test_bad_keyword_values_name_the_setting_and_change_nothing(flux, kwargs, message):
    model, _ = flux
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    with pytest.raises(ddo.DynamicOffloadConfigError, match=message):
        ddo.enable_offload(model, route="dynamic_offload", use_environment=False, **kwargs)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before


def test_bad_config_values_name_the_setting():
    with pytest.raises(ddo.DynamicOffloadConfigError, match=r"vmm_source_cache_gb = NaN \(from config\)"):
        ddo.resolve_dynamic_offload_backend  # noqa: B018 - the API exists
        from ddo.settings import resolve_settings

        resolve_settings("transformer", config=ddo.DynamicOffloadConfig(vmm_source_cache_gb=float("nan")), environ={})
