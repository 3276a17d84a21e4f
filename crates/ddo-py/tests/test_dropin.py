"""A host of the published library switched to ddo by its import: the published keywords,
settings, results and metrics behave as that host expects, on ddo's runtime."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch

import ddo

HOST = dict(
    execution_device="cpu",
    offload_device="cpu",
    target_module_classes=(torch.nn.Linear, torch.nn.Embedding),
    skip_modules_pattern=(),
)


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def test_settings_read_as_published():
    s = ddo.load_dynamic_offload_settings_from_env(**HOST, environ={"DDO_PRESET": "warm_process"})
    assert s.enabled and not s.plan
    assert s.requested_pin_cpu_memory and s.effective_pin_cpu_memory
    assert s.preset_value("DDO_RESIDENT_MODULE_BUDGET_GB") == "6"
    assert s.preset_bool("DDO_PIN_CPU_MEMORY") is True
    assert s.preset_bool("DDO_NOT_A_KEY", True) is True
    assert s.preset_value("DDO_PIN_CPU_WORKERS", environ={"DDO_PIN_CPU_WORKERS": "2"}) == "2"
    assert s.config.resident_module_budget_gb == 6.0 and s.config.preset == "warm_process"
    off = ddo.DynamicOffloadSettings.from_env(**HOST, environ={"DDO_PRESET": "off"})
    assert not off.enabled
    # The published defaults: cuda:0 from the host's memory, every Linear and Embedding weight.
    defaults = ddo.load_dynamic_offload_settings_from_env(environ={})
    assert defaults.values["execution_device"] == "cuda:0" and defaults.values["offload_device"] == "cpu"
    explicit = dict(HOST, execution_device="cuda:0")
    assert defaults.values == ddo.load_dynamic_offload_settings_from_env(**explicit, environ={}).values


def test_refused_host_keywords_say_what_instead():
    with pytest.raises(ddo.DynamicOffloadConfigError, match="target_module_classes .* is not supported by ddo: ddo streams every parameter"):
        ddo.load_dynamic_offload_settings_from_env(**{**HOST, "target_module_classes": (torch.nn.Conv2d,)}, environ={})
    with pytest.raises(ddo.DynamicOffloadConfigError, match="offload_device .* is not supported"):
        ddo.load_dynamic_offload_settings_from_env(**{**HOST, "offload_device": "disk"}, environ={})


def test_preset_helpers():
    assert ddo.resolve_dynamic_offload_preset(" AUTO ") == "one_shot_fast"
    assert ddo.resolve_dynamic_offload_preset("") == ""
    with pytest.raises(ValueError, match="turbo"):
        ddo.resolve_dynamic_offload_preset("turbo")
    assert ddo.DDO_PRESETS["one_shot_fast"]["DDO_PIN_CPU_MEMORY"] == "1"
    assert ddo.dynamic_offload_preset_env_value("DDO_PIN_CPU_MEMORY", "x", requested_preset="auto", environ={}) == "1"
    assert ddo.dynamic_offload_preset_env_value("DDO_PIN_CPU_MEMORY", "x", requested_preset="auto", environ={"DDO_PIN_CPU_MEMORY": "0"}) == "0"
    # Native presets inherit no linear values.
    assert ddo.dynamic_offload_preset_env_value("DDO_PIN_CPU_MEMORY", "x", effective_preset="vmm_fast", environ={}) == "x"
    assert ddo.dynamic_offload_env_value("DDO_X", "d", environ={}) == "d"
    assert ddo.get_available_system_ram_gb() > 0
    text = ddo.format_dynamic_offload_presets(default_preset="low_ram_safe")
    assert "default -> low_ram_safe" in text.splitlines()[1]


def test_execution_mode_picks_the_route(flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    config = ddo.DynamicOffloadConfig(execution_mode="linear_runtime", execution_device="cpu")
    result = ddo.enable_offload(model, component="transformer", config=config, use_environment=False)
    assert (result.route, result.runtime_route) == ("dynamic_offload", "linear_runtime")
    assert torch.equal(run(model, inputs), reference)
    result.remove()
    plan = ddo.enable_offload(model, component="transformer", execution_mode="plan", execution_device="cpu", use_environment=False)
    assert plan.route == "none"


def test_apply_hook_false_resolves_without_touching_the_module(flux):
    model, _ = flux
    before = {n: p for n, p in model.named_parameters()}
    events = []
    result = ddo.enable_offload(
        model, component="transformer", route="dynamic_offload", execution_device="cpu", use_environment=False,
        apply_hook=False, record_event=lambda name, payload: events.append((name, payload)),
    )
    assert result.hook is None and not result.applied
    assert all(p is before[n] for n, p in model.named_parameters())
    assert events and events[0][0] == "setup_dynamic_offload" and events[0][1]["applied"] is False
    # Not applied, so the module can be offloaded now.
    ddo.enable_offload(model, component="transformer", route="dynamic_offload", execution_device="cpu", use_environment=False).remove()


def test_record_event_names_and_payload(flux):
    model, _ = flux
    events = []
    result = ddo.enable_offload(
        model, component="transformer", route="dynamic_offload", execution_device="cpu", use_environment=False,
        record_event=lambda name, payload: events.append((name, payload)), dynamic_event_name="attach",
    )
    assert [n for n, _ in events] == ["attach"]
    payload = events[0][1]
    assert payload["route"] == "dynamic_offload" and payload["runtime_route"] == "linear_runtime"
    assert payload == result.event_payload
    assert result.hook.runtime is result.runtime is not None
    result.remove()


def test_settings_keyword_resolves_once_and_serves_components(vae):
    model, inputs = vae
    reference = run(copy.deepcopy(model), inputs)
    settings = ddo.load_dynamic_offload_settings_from_env(**HOST, environ={}, component="transformer")
    result = ddo.enable_offload(model, component="vae", settings=settings)
    # The VAE default of the preset applies: re-resolved for this component.
    assert result.route == "diffusers_group_offload"
    assert torch.equal(run(model, inputs), reference)
    result.remove()
    # Keywords apply on top of the settings, as published.
    on_top = ddo.enable_offload(model, component="vae", settings=settings, route="dynamic_offload", prefetch_depth=0)
    assert on_top.runtime_route == "linear_runtime" and on_top.settings.values["prefetch_depth"] == 0
    assert torch.equal(run(model, inputs), reference)
    on_top.remove()
    with pytest.raises(TypeError, match="settings must be ddo.DynamicOffloadSettings"):
        ddo.enable_offload(model, settings="transformer")


def test_enable_dynamic_offload_ignores_component_defaults(vae):
    model, inputs = vae
    reference = run(copy.deepcopy(model), inputs)
    result = ddo.enable_dynamic_offload(model, component="vae", execution_device="cpu", use_environment=False)
    assert (result.route, result.runtime_route) == ("dynamic_offload", "linear_runtime")
    assert torch.equal(run(model, inputs), reference)
    ddo.remove_dynamic_offload(model)
    with pytest.raises(ddo.DynamicOffloadConfigError, match="skip_modules_pattern"):
        ddo.enable_dynamic_offload(model, skip_modules_pattern=("norm",), execution_device="cpu", use_environment=False)
    hook = ddo.apply_dynamic_offload(model, ddo.DynamicOffloadConfig(execution_device="cpu"))
    assert hook is not None and torch.equal(run(model, inputs), reference)
    ddo.remove_dynamic_offload(model)


def test_remove_recurses_into_offloaded_submodules(flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    inner = model.transformer_blocks
    ddo.enable_offload(inner, component="blocks", route="none", execution_device="cpu", use_environment=False)
    assert getattr(inner, "_ddo_offload", None) is not None
    ddo.remove_dynamic_offload(model, recurse=False)
    assert getattr(inner, "_ddo_offload", None) is not None
    ddo.remove_dynamic_offload(model)
    assert getattr(inner, "_ddo_offload", None) is None
    assert torch.equal(run(model, inputs), reference)


def test_pipeline_components_as_a_mapping_and_unmanaged_ones_moved(flux, vae):
    transformer, _ = flux
    autoencoder, _ = vae

    class Pipe:
        pass

    pipe = Pipe()
    results = ddo.enable_pipeline_offload(
        pipe, components={"transformer": transformer, "vae": autoencoder, "scheduler": object()},
        execution_device="cpu", use_environment=False, environ={}, preset="off",
    )
    assert set(results) == {"transformer", "vae"}
    for r in results.values():
        assert r.setup.get("unmanaged_module_moved_to_execution_device") is True
        r.remove()
    with pytest.raises(ddo.DynamicOffloadError, match="pass components="):
        ddo.enable_pipeline_offload(pipe, execution_device="cpu")
    pipe.transformer = transformer
    results = ddo.enable_pipeline_offload(pipe, execution_device="cpu", use_environment=False)
    assert list(results) == ["transformer"]
    results["transformer"].remove()


def test_group_offload_result_and_event(vae):
    model, inputs = vae
    reference = run(copy.deepcopy(model), inputs)
    events = []
    r = ddo.enable_diffusers_group_offload(
        model, onload_device="cpu", record_event=lambda n, p: events.append(n), apply_hook=False
    )
    assert isinstance(r, ddo.DiffusersGroupOffloadResult) and r.event_payload["offload_type"] == "leaf_level"
    assert events == ["setup_diffusers_group_offload"]
    assert torch.equal(run(model, inputs), reference)


def test_metrics_read_as_published_and_version_1_still_reads(flux):
    model, _ = flux
    result = ddo.enable_offload(model, component="transformer", route="dynamic_offload", execution_device="cpu", use_environment=False)
    d = result.metrics_snapshot().as_dict()
    assert d["schema_version"] == 2 and d["route"] == "dynamic_offload"
    assert {"schema_version", "route", "configuration", "setup", "runtime"} <= set(d)
    assert d["execution"]["route"] == "linear_runtime" and d["execution"]["component"] == "transformer"
    result.metrics_snapshot().validate()
    assert "route=dynamic_offload runtime=linear_runtime" in result.metrics_snapshot().format_profile()
    result.remove()
    old = ddo.DynamicOffloadMetrics(route={"name": "vmm_fast_runtime", "component": "transformer"})
    assert (old.route, old.runtime_route) == ("dynamic_offload", "vmm_fast_runtime")
    with pytest.raises(TypeError, match="route is a string"):
        ddo.DynamicOffloadMetrics(route=3)


def test_inspection_needs_no_cuda_and_reads_no_weights(flux):
    model, _ = flux
    m = ddo.inspect_vmm_component(model, component="transformer")
    s = m.as_dict()["setup"]
    total = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    assert m.route == "vmm_capacity_inspection" and s["total_bytes"] == total
    assert s["unit_count"] == len(ddo.find_execution_units(model)) > 0
    assert 0 < s["streamed_bytes_per_pass"] < total
    only = ddo.inspect_vmm_component(model, module_pattern=r"^single_transformer_blocks").as_dict()["setup"]
    assert only["unit_count"] < s["unit_count"]
    with pytest.raises(ddo.DynamicOffloadError, match="not a regex"):
        ddo.inspect_vmm_component(model, module_pattern="(")
    census = ddo.inspect_host_memory(model, phase="before_run", max_storage_samples=2).as_dict()
    assert census["route"] == "host_memory_observation" and census["host_memory"]["phase"] == "before_run"
    assert census["setup"]["host_storage_bytes"] == sum(p.untyped_storage().nbytes() for p in {id(p): p for p in list(model.parameters()) + list(model.buffers())}.values())
    assert len(census["setup"]["host_storage_samples"]) == 2


def test_cli_flags_set_only_what_was_given():
    parser = ddo.add_dynamic_offload_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--ddo-backend", "vmm", "--ddo-vmm-native-transport", "--ddo-vmm-resident-weight-budget-gb", "4"])
    config = ddo.build_config_from_args(args)
    assert config.as_dict() == {"backend": "vmm", "vmm_native_transport": True, "vmm_resident_weight_budget_gb": 4.0}
    with pytest.raises(ddo.DynamicOffloadConfigError, match="vmm_page_mb|component_buffer"):
        ddo.build_config_from_args(parser.parse_args(["--ddo-vmm-component-buffer-limit-mb", "8"]))
    b = ddo.resolve_dynamic_offload_backend("vmm", "auto")
    assert b.requires_native_bootstrap is False
    assert b.build_config_from_args(parser.parse_args([])).backend == "vmm"
    with pytest.raises(TypeError, match="execution_mode is decided by the backend"):
        b.build_config(execution_mode="linear_runtime")


def test_an_offload_is_all_or_nothing(flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)

    def boom(_name, _payload):
        raise RuntimeError("recorder down")

    with pytest.raises(RuntimeError, match="recorder down"):
        ddo.enable_offload(model, route="dynamic_offload", execution_device="cpu", use_environment=False, record_event=boom)
    assert getattr(model, "_ddo_offload", None) is None
    assert torch.equal(run(model, inputs), reference)
    # An interrupt half way through attaching leaves the module as it was.
    from ddo import runtime as rt

    real = rt.SessionRuntime._guard_moves

    def interrupted(self):
        real(self)
        raise KeyboardInterrupt

    rt.SessionRuntime._guard_moves = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            ddo.enable_offload(model, route="dynamic_offload", execution_device="cpu", use_environment=False)
    finally:
        rt.SessionRuntime._guard_moves = real
    assert "forward" not in model.__dict__ and "_apply" not in model.__dict__
    assert torch.equal(run(model, inputs), reference)
    model.to(torch.float32)  # not guarded any more
    again = ddo.enable_offload(model, route="dynamic_offload", execution_device="cpu", use_environment=False)
    assert torch.equal(run(model, inputs), reference)
    again.remove()


def test_one_offload_per_module_tree_also_between_threads(flux):
    import threading

    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    results, errors = [], []

    def offload():
        try:
            results.append(ddo.enable_offload(model, route="dynamic_offload", execution_device="cpu", use_environment=False))
        except ddo.DynamicOffloadError as e:
            errors.append(e)

    threads = [threading.Thread(target=offload) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 1 and len(errors) == 3
    assert torch.equal(run(model, inputs), reference)
    with pytest.raises(ddo.DynamicOffloadError, match="inside FluxTransformer2DModel, which is already offloaded"):
        ddo.enable_offload(model.transformer_blocks[0], execution_device="cpu", use_environment=False)
    results[0].remove()
    child = ddo.enable_offload(model.transformer_blocks[0], route="none", execution_device="cpu", use_environment=False)
    with pytest.raises(ddo.DynamicOffloadError, match="submodule transformer_blocks.0 .* is already offloaded"):
        ddo.enable_offload(model, execution_device="cpu", use_environment=False)
    child.remove()
    assert torch.equal(run(model, inputs), reference)


def test_reclaim_and_reload_inside_a_forward_are_refused_not_hung(flux):
    model, inputs = flux
    result = ddo.enable_offload(model, route="dynamic_offload", execution_device="cpu", use_environment=False, prefetch_depth=0)
    seen = []

    def inside(*_args):
        for call in (result.reclaim, result.runtime.reload):
            try:
                call()
            except ddo.DynamicOffloadLifecycleError as e:
                seen.append(str(e))

    handle = model.transformer_blocks[0].register_forward_hook(inside)
    run(model, inputs)
    handle.remove()
    assert len(seen) == 2 and all("inside the module's forward" in m for m in seen)
    result.remove()


def test_bad_argument_kinds_say_what_is_expected(flux):
    model, _ = flux
    for kwargs, match in (
        (dict(config={"prefetch_depth": 1}), "config must be a ddo.DynamicOffloadConfig"),
        (dict(environ=["DDO_PRESET=auto"]), "environ must be a mapping"),
    ):
        with pytest.raises(TypeError, match=match):
            ddo.enable_offload(model, execution_device="cpu", **kwargs)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        ddo.enable_offload(None)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        ddo.remove_dynamic_offload(None)
    with pytest.raises(TypeError, match="components is a list of names"):
        ddo.enable_pipeline_offload(object(), components="transformer")
    assert getattr(model, "_ddo_offload", None) is None


def test_published_key_forms_of_component_policies():
    s = ddo.load_dynamic_offload_settings_from_env(
        **HOST, environ={}, component="vae", component_policies={"VAE": {"ROUTE": "none", "offload-type": "leaf_level"}}
    )
    assert s.route_name == "none"


def test_native_presets_give_the_default_and_both_name_forms_read_the_variable():
    assert ddo.dynamic_offload_preset_env_value("DDO_PIN_CPU_MEMORY", "d", requested_preset="vmm_fast", environ={}) == "d"
    assert ddo.dynamic_offload_preset_env_value("PIN_CPU_MEMORY", "d", requested_preset="auto", environ={"DDO_PIN_CPU_MEMORY": "0"}) == "0"


def test_stored_snapshots_read_back(flux):
    model, _ = flux
    result = ddo.enable_offload(model, route="dynamic_offload", execution_device="cpu", use_environment=False)
    d = result.metrics_snapshot().as_dict()
    assert ddo.DynamicOffloadMetrics.from_dict(d).as_dict() == d
    old = {"schema_version": 1, "route": {"name": "linear_runtime", "component": "transformer"}, "setup": {}, "runtime": {}}
    assert ddo.DynamicOffloadMetrics.from_dict(old).runtime_route == "linear_runtime"
    with pytest.raises(ValueError, match="schema_version 7"):
        ddo.DynamicOffloadMetrics.from_dict({**d, "schema_version": 7})
    result.remove()


def test_the_metrics_json_schema_covers_both_layouts(flux):
    """The schema hosts validate against: ddo's version 2 beside the published version 1; a live
    snapshot's top-level keys are all described by the version-2 branch."""
    model, _ = flux
    schema = ddo.DynamicOffloadMetrics.json_schema()
    branches = [schema["$defs"][ref["$ref"].rsplit("/", 1)[1]] for ref in schema["oneOf"]]
    assert sorted(b["properties"]["schema_version"]["const"] for b in branches) == [1, 2]
    v2 = next(b for b in branches if b["properties"]["schema_version"]["const"] == 2)
    result = ddo.enable_offload(model, route="dynamic_offload", execution_device="cpu", use_environment=False)
    d = result.metrics_snapshot().as_dict()
    assert d["schema_version"] == 2
    assert set(d) <= set(v2["properties"]), set(d) - set(v2["properties"])
    assert set(v2["required"]) <= set(d)
    result.remove()


def test_the_hook_lifecycle_acts_on_the_attached_offload(flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result = ddo.enable_offload(model, route="dynamic_offload", execution_device="cpu", use_environment=False)
    hook = result.hook
    other = torch.nn.Linear(2, 2)
    # ddo initialized the hook when it attached: on its own module it returns the module.
    assert hook.initialize_hook(model) is model
    with pytest.raises(ddo.DynamicOffloadUnsupportedError, match=r"initialize_hook\(\) on another module .*enable_offload"):
        hook.initialize_hook(other)
    out = run(model, inputs)
    assert hook.post_forward(model, out) is out
    assert hook.reset_state(model) is model and hook._is_stateful is False
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match=r"reset_state\(\) was given a Linear"):
        hook.reset_state(other)
    assert torch.equal(run(model, inputs), reference)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match=r"detach_hook\(\) was given a Linear"):
        hook.detach_hook(other)
    assert getattr(model, "_ddo_offload", None) is result
    # Detaching removes the offload: the module has its own tensors and forward back.
    assert hook.detach_hook(model) is model
    assert getattr(model, "_ddo_offload", None) is None and hook.state is None
    assert "forward" not in model.__dict__
    assert torch.equal(run(model, inputs), reference)
    assert hook.deinitalize_hook(model) is model  # already removed: nothing left to detach
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="removed.*enable_offload"):
        hook.initialize_hook(model)
    again = ddo.enable_offload(model, route="dynamic_offload", execution_device="cpu", use_environment=False)
    assert again.hook.deinitalize_hook(model) is model and getattr(model, "_ddo_offload", None) is None
    assert torch.equal(run(model, inputs), reference)


def test_pre_forward_moves_inputs_to_the_execution_device_and_counts_them(flux):
    model, inputs = flux
    result = ddo.enable_offload(model, route="dynamic_offload", execution_device="cpu", use_environment=False)
    hook = result.hook
    x, y = torch.randn(2, 3), torch.randn(4, dtype=torch.float16)
    here, meta = torch.randn(3), torch.empty(5, device="meta")
    # On the execution device already (and meta tensors): the same objects, nothing counted.
    args, kwargs = hook.pre_forward(model, here, meta, scale=2.0)
    assert args[0] is here and args[1] is meta and kwargs == {"scale": 2.0}
    assert "forward_input" not in hook.state.copy_calls_by_name
    # The meta device stands in for an execution device the inputs are not on.
    result.execution_device = torch.device("meta")
    try:
        args, kwargs = hook.pre_forward(model, x, [y, 1], (here,), scale=2.0, cond={"a": y})
    finally:
        result.execution_device = torch.device("cpu")
    assert args[0].is_meta and args[0].shape == x.shape and args[0].dtype == x.dtype
    assert isinstance(args[1], list) and args[1][0].is_meta and args[1][1] == 1
    assert isinstance(args[2], tuple) and args[2][0].is_meta
    assert kwargs["scale"] == 2.0 and kwargs["cond"]["a"].is_meta and kwargs["cond"]["a"].dtype == torch.float16
    state = hook.state
    assert state.copy_calls_by_name["forward_input"] == 3
    assert state.copy_bytes_by_name["forward_input"] == x.nbytes + y.nbytes + here.nbytes
    assert state.copy_calls_by_name["forward_input:cond:a"] == 1 and state.copy_bytes_by_name["forward_input:cond:a"] == y.nbytes
    assert "forward_input:scale" not in state.copy_calls_by_name
    assert state.copy_seconds_by_name["forward_input"] > 0
    assert ddo.get_dynamic_offload_state(model).copy_calls_by_name == state.copy_calls_by_name
    assert state.as_dict()["copy_runtime"]["forward_input"]["calls"] == 3
    result.remove()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pre_forward_moves_host_inputs_to_the_gpu(flux):
    model, inputs = flux
    result = ddo.enable_offload(model, route="dynamic_offload", execution_device="cuda", use_environment=False)
    args, kwargs = result.hook.pre_forward(model, inputs["hidden_states"], timestep=inputs["timestep"])
    assert args[0].device == result.execution_device and kwargs["timestep"].device == result.execution_device
    assert torch.equal(args[0].cpu(), inputs["hidden_states"])
    calls = result.hook.state.copy_calls_by_name
    assert (calls["forward_input"], calls["forward_input:timestep"]) == (1, 1)
    result.remove()


def test_the_legacy_weight_store_refuses_each_member_with_the_ddo_call():
    store, stats = ddo.VmmWeightStore, ddo.VmmWeightStoreStats
    for call, match in (
        (lambda: store(0, 1 << 30), r"VmmWeightStore is not part of ddo: .*enable_offload"),
        (lambda: store.reserve(None, "w", 1024), r"reserve\(\) is not part of ddo: .*when it attaches"),
        (lambda: store.acquire(None, "w", torch.zeros(4), stream=None), r"acquire\(\) .*arbitrary CPU tensor.*enable_offload"),
        (lambda: store.release(None, "w"), r"release\(\) .*lease back when the block's forward ends"),
        (lambda: store.evict(None, "w"), r"evict\(\) .*result\.unload\(\)"),
        (lambda: store.close(None), r"close\(\) .*remove_dynamic_offload\(module\)"),
        (lambda: store.stats.fget(None), r"stats .*vmm_runtime_stats\(\)"),
        (lambda: ddo.VmmWeightLease(None, None, None), r"VmmWeightLease is not part of ddo: .*enable_offload"),
        (lambda: stats(copied_bytes=1), r"VmmWeightStoreStats is not part of ddo: .*vmm_runtime_stats\(\)"),
        (lambda: stats.copied_bytes.fget(None), r"copied_bytes .*vmm_runtime_stats\(\)"),
        (lambda: ddo.DynamicOffloadHook(ddo.DynamicOffloadConfig()), r"not built by hosts in ddo: .*result\.hook"),
    ):
        with pytest.raises(ddo.DynamicOffloadUnsupportedError, match=match):
            call()
    assert issubclass(ddo.DynamicOffloadUnsupportedError, ddo.DynamicOffloadError)
    assert not issubclass(ddo.DynamicOffloadUnsupportedError, ValueError)


def test_published_keywords_and_defaults_of_the_helpers():
    s = ddo.load_dynamic_offload_settings_from_env(**HOST, environ={"DDO_PRESET": "warm_process"})
    # preset_bool's default is text read like a value (published "0"); a boolean still works.
    assert s.preset_bool("DDO_NOT_A_KEY") is False
    assert s.preset_bool("DDO_NOT_A_KEY", "1") is True and s.preset_bool("DDO_NOT_A_KEY", " On ") is True
    assert s.preset_bool("DDO_NOT_A_KEY", "0") is False and s.preset_bool("DDO_NOT_A_KEY", True) is True
    assert s.preset_bool("DDO_PIN_CPU_MEMORY", "0") is True  # the preset's value beats the default
    assert ddo.resolve_dynamic_offload_preset(requested_preset="Warm_Process") == "warm_process"
    state = ddo.DynamicOffloadState("model", "none", "cpu", 1, 0, 0, 0, {})
    state.add_copy("host", 0.5, byte_count=1 << 20)
    state.add_setup("load", 0.25, byte_count=1 << 30)
    state.add_setup("plan", 0.125)
    assert (state.copy_bytes_by_name, state.copy_calls_by_name) == ({"host": 1 << 20}, {"host": 1})
    assert state.setup_bytes_by_action == {"load": 1 << 30, "plan": 0}
    with pytest.raises(TypeError):
        state.add_copy("host", 0.5)  # byte_count is required, as published
    timer = ddo.DynamicOffloadExecutionTimer()
    assert timer.device == torch.device("cuda") and timer.snapshot()["status"] == "disabled"
    if not torch.cuda.is_available():
        with pytest.raises(ddo.DynamicOffloadConfigError, match="device='cpu'"):
            ddo.DynamicOffloadExecutionTimer(enabled=True)


def test_the_standby_purge_reads_the_phase_switch_as_published():
    disabled = {"purged": False, "reason": "disabled", "phase": "after_run"}
    on_linux = {"purged": False, "reason": "non_windows", "phase": "before_run"}
    # one_shot_fast (auto) switches the purge on before the run, not after it.
    assert ddo.maybe_purge_windows_standby_cache("before_run", environ={}) == on_linux
    assert ddo.maybe_purge_windows_standby_cache("after_run", environ={}) == disabled
    assert ddo.maybe_purge_windows_standby_cache("before_run", preset="low_ram_safe", environ={})["reason"] == "disabled"
    assert ddo.maybe_purge_windows_standby_cache(
        "after_run", environ={"DDO_PURGE_WINDOWS_STANDBY_AFTER_RUN": "1"}
    )["reason"] == "non_windows"
    assert ddo.maybe_purge_windows_standby_cache("after_run", environ={}, default="1")["reason"] == "non_windows"
    assert ddo.maybe_purge_windows_standby_cache("before_run", environ={}, enabled=False)["reason"] == "disabled"
    settings = ddo.load_dynamic_offload_settings_from_env(**HOST, environ={"DDO_PRESET": "warm_process"})
    assert ddo.maybe_purge_windows_standby_cache(settings, "before_run")["reason"] == "disabled"
    assert ddo.maybe_purge_windows_standby_cache(phase="before_run", settings=settings, enabled=True) == on_linux
    events = []
    got = ddo.maybe_purge_windows_standby_cache(
        "before_run", environ={}, record_event=lambda *a, **k: events.append(a), event_name="purge", print_message=False
    )
    assert got == on_linux and events == []  # nothing was purged, so nothing is recorded
