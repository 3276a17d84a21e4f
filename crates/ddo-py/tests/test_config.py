"""Configuration, environment and argparse behaviour, resolved by the native extension."""

from __future__ import annotations

import argparse

import pytest
import torch

import ddo
from ddo import _native

# The published library's required keywords of load_dynamic_offload_settings_from_env.
HOST = dict(
    execution_device="cpu",
    offload_device="cpu",
    target_module_classes=(torch.nn.Linear, torch.nn.Embedding),
    skip_modules_pattern=(),
)


def test_config_fields_match_the_native_settings():
    native = {field for field, _ in _native.setting_keys()}
    python = set(ddo.DynamicOffloadConfig.field_names()) - {
        "preset", "backend", "route", "execution_mode", "components", "small_tensor_threshold_bytes"
    }
    assert python == native


def test_presets_and_backends():
    presets = ddo.get_dynamic_offload_presets()
    assert presets["one_shot_fast"]["DDO_PIN_CPU_MEMORY"] == "1"
    assert presets["vmm_fast"]["DDO_EXECUTION_MODE"] == "vmm_fast_runtime"
    text = ddo.format_dynamic_offload_presets()
    assert text.startswith("DDO presets\n  auto -> one_shot_fast (backend linear), vmm_fast (backend vmm)")
    b = ddo.resolve_dynamic_offload_backend("vmm", "nvme_baseline")
    assert (b.effective_preset, b.execution_mode) == ("nvme_baseline", "vmm_runtime")
    with pytest.raises(ddo.DynamicOffloadConfigError, match="backend vmm does not accept preset \"low_ram_safe\""):
        ddo.resolve_dynamic_offload_backend("vmm", "low_ram_safe")


def test_environment_precedence():
    env = {"DDO_PRESET": "low_ram_safe", "DDO_PREFETCH_DEPTH": "5", "DDO_TRANSFORMER_PREFETCH_DEPTH": "7"}
    s = ddo.load_dynamic_offload_settings_from_env(**HOST, component="transformer", environ=env)
    assert s.effective_preset == "low_ram_safe"
    assert s.values["prefetch_depth"] == 7
    assert s.origins["prefetch_depth"] == "DDO_TRANSFORMER_PREFETCH_DEPTH"
    assert s.values["resident_module_budget_gb"] == 3.0
    s = ddo.load_dynamic_offload_settings_from_env(**HOST, environ={}, default_preset="warm_process")
    assert s.effective_preset == "warm_process"


def test_unknown_variable_values_name_the_variable():
    with pytest.raises(ddo.DynamicOffloadConfigError, match=r'environment variable DDO_PIN_CPU_MEMORY="maybe" is not a boolean'):
        ddo.load_dynamic_offload_settings_from_env(**HOST, environ={"DDO_PIN_CPU_MEMORY": "maybe"})


def test_argparse_flags_build_a_config():
    parser = ddo.add_dynamic_offload_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--ddo-backend", "vmm", "--ddo-preset", "auto", "--ddo-vmm-source-cache-gb", "8", "--ddo-vmm-source-registered-gb", "2"])
    config = ddo.build_config_from_args(args)
    assert (config.backend, config.preset, config.vmm_source_cache_gb, config.vmm_source_registered_gb) == ("vmm", "auto", 8.0, 2.0)
    assert config.prefetch_depth is None
    bad = parser.parse_args(["--ddo-vmm-source-cache-gb", "4", "--ddo-vmm-source-registered-gb", "1.1"])
    with pytest.raises(ddo.DynamicOffloadConfigError, match="not a whole number of 64 MiB segments"):
        ddo.load_dynamic_offload_settings_from_env(**HOST, environ={})  # fine
        from ddo.settings import resolve_settings

        resolve_settings("transformer", config=ddo.build_config_from_args(bad), environ={})
    with pytest.raises(ddo.DynamicOffloadConfigError, match="backend vmm does not accept preset"):
        ddo.build_config_from_args(parser.parse_args(["--ddo-backend", "vmm", "--ddo-preset", "low_ram_safe"]))


def test_unknown_config_fields_are_refused():
    with pytest.raises(TypeError, match="unknown DynamicOffloadConfig field"):
        ddo.DynamicOffloadConfig().replace(prefetch_dept=2)


def test_metrics_never_report_counters_a_route_lacks():
    m = ddo.DynamicOffloadMetrics(route="diffusers_group_offload", runtime={"passes": 1, "prefetch_hits": 0})
    with pytest.raises(ValueError, match="has no counter"):
        m.validate()
    ok = ddo.DynamicOffloadMetrics(route="none", setup={"placement": "resident"})
    ok.validate()
    assert ok.as_dict()["runtime"] == {}
    assert "placement=module=resident" in ok.format_profile()


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_flag_values_out_of_range_are_refused_when_the_config_is_built(value):
    parser = ddo.add_dynamic_offload_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--ddo-backend", "vmm", "--ddo-vmm-resident-weight-budget-gb", value])
    with pytest.raises(ddo.DynamicOffloadConfigError, match=r"vmm_resident_weight_budget_gb = .* \(set by the flags .*--ddo-vmm-resident-weight-budget-gb"):
        ddo.build_config_from_args(args)
