"""ddo against the published library's surface (``peer_api.py``), mechanically: every public name
exists with the same parameters, kinds and defaults (ddo may add keyword-only parameters with
defaults), or refuses with an error that says what ddo does instead."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect

import pytest
import torch

import ddo
from ddo.errors import DynamicOffloadError

import peer_api

P = inspect.Parameter


def _same_signature(peer, mine, where: str, defaults: bool = True) -> None:
    theirs, ours = inspect.signature(peer), inspect.signature(mine)
    ours_params = ours.parameters
    for name, p in theirs.parameters.items():
        if p.kind is P.VAR_KEYWORD:
            assert any(q.kind is P.VAR_KEYWORD for q in ours_params.values()), f"{where}: no **{name}"
            continue
        assert name in ours_params, f"{where}: parameter {name} is missing"
        q = ours_params[name]
        assert q.kind == p.kind, f"{where}: {name} is {q.kind.description}, published {p.kind.description}"
        if not defaults:
            continue
        if p.default is P.empty:
            assert q.default is P.empty, f"{where}: {name} has a default ({q.default!r}); published has none"
        else:
            assert q.default is not P.empty and q.default == p.default, (
                f"{where}: {name} defaults to {q.default!r}, published {p.default!r}"
            )
    positional = [n for n, p in theirs.parameters.items() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    ours_positional = [n for n, p in ours_params.items() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    assert ours_positional[: len(positional)] == positional, f"{where}: positional order {ours_positional}"
    for name, q in ours_params.items():
        if name not in theirs.parameters and q.kind not in (P.VAR_KEYWORD, P.VAR_POSITIONAL):
            assert q.default is not P.empty, f"{where}: ddo's own parameter {name} must have a default"


@pytest.mark.parametrize("name", peer_api.FUNCTIONS)
def test_every_published_function_has_the_published_signature(name):
    assert hasattr(ddo, name), f"ddo.{name} is missing"
    _same_signature(getattr(peer_api, name), getattr(ddo, name), f"ddo.{name}")


@pytest.mark.parametrize("name", peer_api.CONSTANTS)
def test_every_published_constant_exists(name):
    assert hasattr(ddo, name), f"ddo.{name} is missing"


@pytest.mark.parametrize("cls", peer_api.CLASSES, ids=lambda c: c.__name__)
def test_every_published_type_has_its_attributes_and_methods(cls):
    mine = getattr(ddo, cls.__name__)
    fields = {f.name for f in dataclasses.fields(mine)} if dataclasses.is_dataclass(mine) else set()
    for attr in cls.ATTRIBUTES:
        assert attr in fields or hasattr(mine, attr), f"ddo.{cls.__name__}.{attr} is missing"
    for name, stub in vars(cls).items():
        if callable(stub) and not name.startswith("_"):
            assert hasattr(mine, name), f"ddo.{cls.__name__}.{name}() is missing"
            _same_signature(stub, getattr(mine, name), f"ddo.{cls.__name__}.{name}")


@pytest.mark.parametrize("name", peer_api.OTHER_TYPES)
def test_other_published_types_exist_or_say_what_instead(name):
    cls = getattr(ddo, name)
    try:
        cls()
    except DynamicOffloadError as e:
        assert "ddo" in str(e) and len(str(e)) > 40, f"{name}: {e}"
    except TypeError:
        pass  # constructible with arguments


def test_config_has_every_published_field():
    fields = set(ddo.DynamicOffloadConfig.field_names())
    missing = [f for f in peer_api.CONFIG_FIELDS if f not in fields]
    assert not missing, f"DynamicOffloadConfig lacks {missing}"


def _same_value(a, b) -> bool:
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("name", sorted(peer_api.CONFIG_DEFAULTS))
def test_config_fields_default_to_the_published_defaults(name):
    published = peer_api.CONFIG_DEFAULTS[name]
    value = getattr(ddo.DynamicOffloadConfig(), name)
    assert _same_value(value, published), f"DynamicOffloadConfig().{name} is {value!r}, published {published!r}"
    default = inspect.signature(ddo.DynamicOffloadConfig).parameters[name].default
    assert _same_value(default, published), f"DynamicOffloadConfig({name}=...) defaults to {default!r}"


def test_defaults_are_not_settings_so_variables_and_presets_still_decide_them():
    from ddo.settings import resolve_settings

    config = ddo.DynamicOffloadConfig()
    assert config.explicit_fields() == frozenset() and config.as_dict() == {}
    # The preset fills what was not set, though the field reads as the published default.
    s = resolve_settings("transformer", config=config, environ={"DDO_PRESET": "one_shot_fast"})
    assert (config.pin_cpu_memory, config.pin_cpu_workers) == (False, 1)
    assert (s.values["pin_cpu_memory"], s.values["pin_cpu_workers"]) == (True, 4)
    assert s.origins["pin_cpu_memory"] != "config"
    # An explicit value beats the preset and the variable, also when it equals the default.
    explicit = ddo.DynamicOffloadConfig(pin_cpu_memory=False, pin_cpu_workers=1)
    assert explicit.explicit_fields() == {"pin_cpu_memory", "pin_cpu_workers"}
    s = resolve_settings("transformer", config=explicit, environ={"DDO_PRESET": "one_shot_fast", "DDO_PIN_CPU_WORKERS": "3"})
    assert (s.values["pin_cpu_memory"], s.values["pin_cpu_workers"]) == (False, 1)
    assert s.origins["pin_cpu_memory"] == s.origins["pin_cpu_workers"] == "config"
    # Copies keep what was set: replace() sets what it names; dataclasses.replace (which passes
    # every field) keeps the set fields and sets the ones it changes from their default.
    again = explicit.replace(verbose=False)
    assert again.explicit_fields() == {"pin_cpu_memory", "pin_cpu_workers", "verbose"}
    copied = dataclasses.replace(explicit, vmm_source_cache_gb=2.0)
    assert copied.explicit_fields() == {"pin_cpu_memory", "pin_cpu_workers", "vmm_source_cache_gb"}
    assert copied.as_dict() == {"pin_cpu_memory": False, "pin_cpu_workers": 1, "vmm_source_cache_gb": 2.0}
    # Positional values are set too, and the published classes travel by name.
    assert ddo.DynamicOffloadConfig("auto").explicit_fields() == {"preset"}
    classes = ddo.DynamicOffloadConfig(target_module_classes=peer_api.LINEAR_EMBEDDING)
    assert classes.as_dict() == {"target_module_classes": ["Linear", "Embedding"]}
    classes.to_json()


def test_cli_flags_and_defaults_are_the_published_ones():
    parser = ddo.add_dynamic_offload_arguments(argparse.ArgumentParser())
    actions = {s: a for a in parser._actions for s in a.option_strings}
    for flag, default in peer_api.CLI_FLAGS.items():
        assert flag in actions, f"{flag} is missing"
        assert actions[flag].default == default, f"{flag} defaults to {actions[flag].default!r}, published {default!r}"
    # Defaults are shown, not applied: a host that passes no flag gets the variables' and presets' values.
    assert ddo.build_config_from_args(parser.parse_args([])).as_dict() == {}


def test_metrics_route_is_a_string_as_published():
    m = ddo.DynamicOffloadMetrics(route="x")
    assert m.as_dict()["route"] == "x"
    assert m.schema_version == 2


def test_bootstrap_module_is_importable_with_the_published_functions():
    boot = importlib.import_module("ddo_vmm_bootstrap")
    for name in ("vmm_fast_requested", "ensure_vmm_fast_process"):
        _same_signature(getattr(peer_api.ddo_vmm_bootstrap, name), getattr(boot, name), f"ddo_vmm_bootstrap.{name}")


def test_refused_names_say_what_ddo_does_instead():
    for name in ("VmmWeightStore", "VmmWeightLease", "VmmWeightStoreStats"):
        with pytest.raises(DynamicOffloadError, match=rf"{name} is not part of ddo: .*(enable_offload|metrics_snapshot)"):
            getattr(ddo, name)()
    with pytest.raises(DynamicOffloadError, match=r"DynamicOffloadHook\(config\) is not built by hosts in ddo: .*result\.hook"):
        ddo.DynamicOffloadHook(ddo.DynamicOffloadConfig())


def test_the_comparison_catches_each_kind_of_difference():
    def published(module, *, a=1, b=None, **kw): ...

    def renamed(mod, *, a=1, b=None, **kw): ...

    def other_default(module, *, a=2, b=None, **kw): ...

    def positional(module, a=1, *, b=None, **kw): ...

    def no_var_keyword(module, *, a=1, b=None): ...

    def required_extra(module, *, a=1, b=None, c, **kw): ...

    def extra_with_default(module, *, a=1, b=None, c=3, **kw): ...

    for wrong in (renamed, other_default, positional, no_var_keyword, required_extra):
        with pytest.raises(AssertionError):
            _same_signature(published, wrong, wrong.__name__)
    _same_signature(published, extra_with_default, "extra_with_default")


@pytest.mark.parametrize("name", sorted(peer_api.PARTLY_DESCRIBED))
def test_partly_described_functions_take_their_leading_parameters(name):
    params = list(inspect.signature(getattr(ddo, name)).parameters)
    lead = peer_api.PARTLY_DESCRIBED[name]
    assert tuple(params[: len(lead)]) == lead, f"ddo.{name}{tuple(params)}"


# Published names ddo does not match yet (listed in the README's difference table); the test
# fails once one is fixed, so the list stays true.
@pytest.mark.parametrize("name", peer_api.PROFILE_FUNCTIONS)
def test_the_profile_module_has_the_published_names(name):
    profiles = importlib.import_module("ddo.profiles")
    assert hasattr(profiles, name), f"ddo.profiles.{name} is missing"
    stub = getattr(peer_api.profile_functions, name, None)
    if stub is not None:
        _same_signature(stub, getattr(profiles, name), f"ddo.profiles.{name}")


def test_the_profile_session_has_the_published_methods(tmp_path):
    session = ddo.DynamicOffloadProfileSession({"name": "a"}, {"family": "b"}, tmp_path)
    for attribute in peer_api.DynamicOffloadProfileSession.ATTRIBUTES:
        assert hasattr(session, attribute), f"DynamicOffloadProfileSession.{attribute} is missing"
    for name in ("apply_settings", "recommend_resident_budget", "record_success"):
        stub = getattr(peer_api.DynamicOffloadProfileSession, name)
        mine = getattr(ddo.DynamicOffloadProfileSession, name)
        _same_signature(stub, mine, f"DynamicOffloadProfileSession.{name}")


@pytest.mark.parametrize("name", peer_api.CONSTRUCTORS)
def test_published_constructors_take_the_published_parameters(name):
    mine = getattr(ddo, name, None) or getattr(importlib.import_module("ddo.profiles"), name)
    _same_signature(getattr(peer_api.constructors, name), mine, f"ddo.{name}()", defaults=False)


@pytest.mark.parametrize("name", sorted(peer_api.CONSTRUCTOR_DEFAULTS))
def test_published_constructors_have_the_published_defaults(name):
    mine = getattr(ddo, name, None) or getattr(importlib.import_module("ddo.profiles"), name)
    params = inspect.signature(mine).parameters
    for param, published in peer_api.CONSTRUCTOR_DEFAULTS[name].items():
        assert param in params, f"ddo.{name}() has no parameter {param}"
        assert _same_value(params[param].default, published), (
            f"ddo.{name}({param}=...) defaults to {params[param].default!r}, published {published!r}"
        )


def test_diagnostics_are_null_when_disabled_and_say_what_instead_when_enabled(flux):
    model, _ = flux
    result = ddo.enable_offload(model, route="dynamic_offload", execution_device="cpu", use_environment=False)
    with result.allocation_diagnostics(), result.operator_diagnostics():
        pass
    with pytest.raises(DynamicOffloadError, match="installs none"):
        result.allocation_diagnostics(enabled=True)
    with pytest.raises(DynamicOffloadError, match="torch.profiler"):
        result.operator_diagnostics(enabled=True)
    result.remove()


def test_the_hook_has_the_published_attributes_from_ddo_s_runtime(flux):
    model, inputs = flux
    result = ddo.enable_offload(model, route="dynamic_offload", execution_device="cpu", use_environment=False)
    hook = result.hook
    assert isinstance(hook, ddo.DynamicOffloadHook) and hook is result.hook and hook.runtime is result.runtime
    assert isinstance(hook.config, ddo.DynamicOffloadConfig) and hook.config.execution_device == "cpu"
    assert hook.execution_mode == "linear_runtime" and str(hook.offload_device) == "cpu"
    state = hook.state
    assert isinstance(state, ddo.DynamicOffloadState)
    assert state.as_dict() == ddo.get_dynamic_offload_state(model).as_dict()
    before = hook.vmm_runtime_stats()
    with torch.no_grad():
        model(**inputs)
    after = hook.vmm_runtime_stats()
    runtime = result.metrics_snapshot().as_dict()["runtime"]
    # ddo's counters as measured, the published names where ddo measures the same thing, and
    # None where it measures nothing of the kind.
    assert (before["passes"], after["passes"]) == (0, 1) == (0, runtime["passes"])
    assert after["copied_bytes"] == runtime["upload_bytes"] and after["evictions"] == runtime["evictions"]
    assert after["reserved_bytes"] is None and after["materializations"] is None
    assert {k: v for k, v in after.items() if k in runtime} == runtime
    assert hook.collect_completed_runtime_resources() == {"status": "not_applicable", "blocking": False}
    result.remove()
    assert hook.state is None
    with pytest.raises(DynamicOffloadError, match="removed"):
        hook.vmm_runtime_stats()
    group = ddo.enable_offload(model, route="none", execution_device="cpu", use_environment=False)
    assert group.hook is None


def test_the_state_has_the_published_accounting(flux):
    model, inputs = flux
    result = ddo.enable_offload(model, route="dynamic_offload", execution_device="cpu", use_environment=False)
    with torch.no_grad():
        model(**inputs)
    state = ddo.get_dynamic_offload_state(model)
    setup = result.metrics_snapshot().as_dict()["setup"]
    runtime = result.metrics_snapshot().as_dict()["runtime"]
    assert state.setup_seconds_by_action == {"attach": setup["setup_seconds"]}
    assert state.copy_bytes_by_name == {"unit_upload": runtime["upload_bytes"]}
    assert state.copy_calls_by_name == {"unit_upload": runtime["uploads"]}
    assert state.planner_decisions["unit_count"] == setup["unit_count"]
    linear = {f"{p}.weight" for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert state.selected_resident_linear_weights and set(state.selected_resident_linear_weights) <= linear
    assert state.selected_pinned_linear_weights is None
    assert state.sdnq_pinned_parameter_count == 0
    clone = state.clone_for_runtime()
    clone.add_copy("forward_input", 0.5, 1 << 20)
    clone.add_setup("host_step", 0.25, 0)
    assert clone.copy_calls_by_name["forward_input"] == 1 and "forward_input" not in state.copy_calls_by_name
    data = clone.as_dict()
    assert data["copy_runtime"]["forward_input"] == {"calls": 1, "seconds": 0.5, "gb": 0.001}
    assert data["setup_runtime"]["host_step"] == {"seconds": 0.25, "gb": 0.0}
    result.remove()


def test_the_timer_marks_steps_on_the_host_clock():
    timer = ddo.DynamicOffloadExecutionTimer(enabled=True, device="cpu")
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="mark_step"):
        timer.mark_step()
    with timer:
        for _ in range(3):
            timer.mark_step()
    snap = timer.snapshot()
    assert snap["status"] == "complete" and snap["step_count"] == 3 and len(snap["step_seconds"]) == 3
    assert snap["phase_seconds"] >= sum(snap["step_seconds"]) + snap["tail_seconds"] - 1e-9
    assert snap["steady_state_seconds_per_step"] == pytest.approx(sum(snap["step_seconds"][1:]) / 2)
    off = ddo.DynamicOffloadExecutionTimer()
    off.mark_step()
    assert off.snapshot()["status"] == "disabled"
