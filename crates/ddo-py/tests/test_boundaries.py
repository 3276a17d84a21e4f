"""The module stays correct at its boundaries: concurrent forwards, interrupted forwards, odd
module structures, and errors of the right class."""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch

import ddo


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def offload(tmp_path, model, route, *, native_budget_gb=0.006, native_prefetch=1):
    """``model`` offloaded on ``route``: ``linear`` (two slots) or ``native`` (saved, then
    loaded through the checkpoint on the host backend). Returns ``(result, module)``."""
    if route == "linear":
        return ddo.enable_offload(model, route="dynamic_offload", prefetch_depth=1, use_environment=False), model
    model.save_pretrained(tmp_path / "m")
    extra = {} if native_prefetch is None else {"prefetch_depth": native_prefetch}
    config = ddo.DynamicOffloadConfig(
        backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=native_budget_gb, **extra
    )
    loaded = ddo.from_pretrained_with_dynamic_offload(tmp_path / "m", apply_dynamic=True, dynamic_offload_config=config)
    return loaded.offload, loaded.module


@pytest.mark.parametrize("route", ["linear", "native"])
def test_forwards_from_several_threads_run_one_at_a_time(tmp_path, flux, route):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result, module = offload(tmp_path, model, route, native_budget_gb=0.02, native_prefetch=None)
    outcomes = []

    def worker():
        for _ in range(8):
            outcomes.append(torch.equal(run(module, inputs), reference))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert outcomes == [True] * 32
    result.remove()


def test_a_keyboard_interrupt_inside_a_block_leaves_the_module_usable_from_any_thread(flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result = ddo.enable_offload(model, route="dynamic_offload", prefetch_depth=1, use_environment=False)

    def interrupt(_m, _args):
        raise KeyboardInterrupt

    handle = model.transformer_blocks[1].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        run(model, inputs)
    handle.remove()
    got = []
    t = threading.Thread(target=lambda: got.append(torch.equal(run(model, inputs), reference)))
    t.start()
    t.join(timeout=60)
    assert got == [True], "another thread runs the module after the interrupt"
    m = result.metrics_snapshot().as_dict()["runtime"]
    # The interrupted pass's partial order was not learned: later passes prefetch in order.
    for _ in range(3):
        assert torch.equal(run(model, inputs), reference)
    after = result.metrics_snapshot().as_dict()["runtime"]
    assert after["prefetch_misses"] == m["prefetch_misses"], (m, after)
    result.remove()


def test_a_forward_inside_its_own_forward_is_refused():
    class Loop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
            self.depth = 0

        def forward(self, x):
            self.depth += 1
            if self.depth == 1:
                x = self(x)
            for b in self.blocks:
                x = b(x)
            return x

    net = Loop().eval()
    result = ddo.enable_offload(net, route="dynamic_offload", use_environment=False)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="inside its own forward"):
        with torch.no_grad():
            net(torch.ones(1, 4))
    result.remove()


def test_a_list_of_lists_streams_the_inner_blocks():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stages = torch.nn.ModuleList(
                [torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(2)]) for _ in range(3)]
            )

        def forward(self, x):
            for stage in self.stages:
                for block in stage:
                    x = block(x).relu()
            return x

    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        reference = net(x)
    result = ddo.enable_offload(net, route="dynamic_offload", prefetch_depth=1, use_environment=False)
    assert [p for p, _ in ddo.find_execution_units(net)] == [f"stages.{s}.{b}" for s in range(3) for b in range(2)]
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(net(x), reference)
    assert result.metrics_snapshot().as_dict()["setup"]["streamed_units"] == 6
    result.remove()


def test_a_non_contiguous_parameter_is_refused_and_the_module_unchanged():
    net = torch.nn.Sequential()
    net.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
    net.blocks[0].weight = torch.nn.Parameter(net.blocks[0].weight.t().contiguous().t())
    before = {n: p.data_ptr() for n, p in net.named_parameters()}
    with pytest.raises(ddo.DynamicOffloadError, match="blocks.0.weight is not contiguous"):
        ddo.enable_offload(net.eval(), route="dynamic_offload", use_environment=False)
    assert {n: p.data_ptr() for n, p in net.named_parameters()} == before
    assert getattr(net, "_ddo_offload", None) is None


def test_a_checkpoint_changed_during_a_run_is_a_checkpoint_error(tmp_path, flux):
    model, inputs = flux
    reference = run(model, inputs)
    model.save_pretrained(tmp_path / "m")
    # A budget of the resident rest and two slots: every block is read again each pass.
    config = ddo.DynamicOffloadConfig(
        backend="vmm",
        execution_device="cpu",
        vmm_resident_weight_budget_gb=0.006,
        prefetch_depth=1,
        load_safetensors_backend="pread",
    )
    loaded = ddo.from_pretrained_with_dynamic_offload(tmp_path / "m", apply_dynamic=True, dynamic_offload_config=config)
    assert torch.equal(run(loaded.module, inputs), reference)
    path = tmp_path / "m" / "diffusion_pytorch_model.safetensors"
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)  # same bytes, another file
    with pytest.raises(ddo.DynamicOffloadSourceChangedError, match="changed while in use") as raised:
        run(loaded.module, inputs)
    assert isinstance(raised.value, ddo.DynamicOffloadCheckpointError)
    loaded.offload.unload()
    loaded.offload.reload()  # the file as it is now
    assert torch.equal(run(loaded.module, inputs), reference)


def test_always_resident_variable_under_the_fields_name(flux):
    model, _ = flux
    result = ddo.enable_offload(
        model, route="dynamic_offload", environ={"DDO_ALWAYS_RESIDENT_MODULES_PATTERN": r"^transformer_blocks\.0$"}
    )
    setup = result.metrics_snapshot().as_dict()["setup"]
    assert not any("ALWAYS_RESIDENT" in w for w in setup.get("warnings", []))
    units = ddo.find_execution_units(model)
    assert setup["unit_count"] == len(units)  # the rest, and every block but transformer_blocks.0
    result.remove()


@pytest.mark.parametrize("route", ["linear", "native"])
def test_state_dict_after_a_forward_is_the_modules_own_values(tmp_path, flux, route):
    model, inputs = flux
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    result, module = offload(tmp_path, model, route)
    assert result.metrics_snapshot().as_dict()["setup"]["streamed_units"] >= 2
    run(module, inputs)
    state = module.state_dict()
    assert state.keys() == reference.keys()
    differing = [k for k in reference if not torch.equal(state[k].cpu(), reference[k])]
    assert differing == []
    # A checkpoint saved from the offloaded module is the module.
    module.save_pretrained(tmp_path / "saved")
    again = type(model).from_pretrained(tmp_path / "saved")
    assert all(torch.equal(again.state_dict()[k], reference[k]) for k in reference)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="before load_state_dict"):
        module.load_state_dict(reference)
    assert torch.equal(run(module, inputs), run(again.eval(), inputs))
    result.remove()


@pytest.mark.parametrize("end", ["remove", "unload", "del"])
def test_a_weight_kept_after_the_offload_ends_stays_readable(tmp_path, flux, end):
    model, inputs = flux
    model.save_pretrained(tmp_path / "m")
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=0.006, prefetch_depth=1)
    loaded = ddo.from_pretrained_with_dynamic_offload(tmp_path / "m", apply_dynamic=True, dynamic_offload_config=config)
    run(loaded.module, inputs)
    resident = loaded.module.get_parameter("x_embedder.weight")  # in the resident rest
    streamed = loaded.module.get_parameter("transformer_blocks.0.attn.to_q.weight")
    expected = model.get_parameter("x_embedder.weight").detach().clone()
    if end == "remove":
        loaded.offload.remove()
    elif end == "unload":
        with pytest.warns(UserWarning, match="still view its device memory"):
            loaded.offload.unload()
    else:
        loaded.offload.remove()
        del loaded
        import gc

        gc.collect()
    # The views own their memory: reading them never faults. A streamed block's parameter
    # between passes is a placeholder that reads the checkpoint while the offload lives and
    # raises a clear error after.
    assert torch.equal(resident, expected)
    assert streamed.shape == model.get_parameter("transformer_blocks.0.attn.to_q.weight").shape
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="remove|unloaded"):
        streamed.float().sum()


def swap_two_weights(m):
    """Two published parameters trade places: each is still one ddo published, at its address."""
    attn = m.transformer_blocks[0].attn
    attn.to_q._parameters["weight"], attn.to_k._parameters["weight"] = (
        attn.to_k._parameters["weight"],
        attn.to_q._parameters["weight"],
    )


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda m: m.transformer_blocks[1].train(), "training mode"),
        (
            lambda m: setattr(m.transformer_blocks[0].attn.to_q, "weight", torch.nn.Parameter(torch.zeros(32, 32))),
            "was changed after ddo attached",
        ),
        (lambda m: setattr(m.transformer_blocks[0].attn.to_q.weight, "data", torch.zeros(32, 32)), "was changed"),
        (swap_two_weights, "now holds another of the module's parameters"),
        (
            lambda m: setattr(m.transformer_blocks[0].attn.to_q, "_parameters", dict(m.transformer_blocks[0].attn.to_q._parameters)),
            "were replaced as a whole",
        ),
    ],
)
def test_changes_the_arena_cannot_serve_are_refused_at_the_next_forward(flux, change, message):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result = ddo.enable_offload(model, route="dynamic_offload", use_environment=False)
    assert torch.equal(run(model, inputs), reference)
    change(model)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match=message):
        run(model, inputs)
    result.remove()


def test_parameters_requiring_grad_are_refused_where_autograd_records(flux):
    """Without autograd (no_grad, inference_mode) nothing keeps views of block memory: the output
    is the resident one. With it, the forward is refused."""
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result = ddo.enable_offload(model, route="dynamic_offload", use_environment=False)
    model.transformer_blocks[1].requires_grad_(True)
    assert torch.equal(run(model, inputs), reference)
    with torch.inference_mode():
        assert torch.equal(model(**inputs)[0], reference)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="requires grad"):
        model(**inputs)
    model.transformer_blocks[1].requires_grad_(False)
    assert torch.equal(run(model, inputs), reference)
    result.remove()


@pytest.mark.parametrize("route", ["linear", "native"])
def test_gradients_enabled_inside_the_forward_are_refused_at_the_block(tmp_path, flux, route):
    """Grad switched on after the entry let the forward in (a hook, a block's own code): the
    first block autograd records is refused, never a backward through reused block memory."""
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result, module = offload(tmp_path, model, route)

    def grad_on(_m, args, kwargs):
        torch.set_grad_enabled(True)
        return args, dict(kwargs, hidden_states=kwargs["hidden_states"].detach().requires_grad_())

    handle = module.transformer_blocks[0].register_forward_pre_hook(grad_on, with_kwargs=True, prepend=True)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="autograd recorded"):
        run(module, inputs)
    handle.remove()
    assert torch.equal(run(module, inputs), reference)
    module.x_embedder.requires_grad_(True)
    handle = module.x_embedder.register_forward_pre_hook(lambda *_: torch._C._set_grad_enabled(True))
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="autograd recorded"):
        run(module, inputs)
    handle.remove()
    module.x_embedder.requires_grad_(False)
    assert torch.equal(run(module, inputs), reference)
    result.remove()


def test_a_capture_begun_inside_the_forward_is_refused_at_the_next_block(flux, monkeypatch):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result = ddo.enable_offload(model, route="dynamic_offload", use_environment=False)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    handle = model.transformer_blocks[1].register_forward_pre_hook(lambda *_: capturing.__setitem__(0, True), prepend=True)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="CUDA graph capture"):
        run(model, inputs)
    handle.remove()
    capturing[0] = False
    assert torch.equal(run(model, inputs), reference)
    result.remove()


def test_placeholders_exchanged_by_swap_tensors_are_refused(flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result = ddo.enable_offload(model, route="dynamic_offload", prefetch_depth=1, use_environment=False)
    attn = model.transformer_blocks[0].attn
    assert isinstance(attn.to_q.weight, ddo.StreamedWeight)
    torch.utils.swap_tensors(attn.to_q.weight, attn.to_k.weight)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="now holds another of the module's parameters"):
        run(model, inputs)
    torch.utils.swap_tensors(attn.to_q.weight, attn.to_k.weight)
    assert torch.equal(run(model, inputs), reference)
    result.remove()


def test_requires_grad_set_between_passes_is_kept_and_never_blocks_the_lifecycle(tmp_path, flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result, module = offload(tmp_path, model, "native")
    module.transformer_blocks[1].requires_grad_(True)
    names = {n for n, p in module.named_parameters() if p.requires_grad}
    assert names
    # Called with grad enabled: the flag is not a change a publish would undo.
    result.unload()
    result.reload()
    assert {n for n, p in module.named_parameters() if p.requires_grad} == names
    assert torch.equal(run(module, inputs), reference)
    result.reclaim()
    assert torch.equal(run(module, inputs), reference)
    result.remove()


def test_reload_after_remove_is_refused_and_hooks_never_double(flux):
    model, inputs = flux
    result = ddo.enable_offload(model, route="dynamic_offload", use_environment=False)
    result.remove()
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="offload the module again"):
        result.reload()
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="nothing to unload"):
        result.unload()
    again = ddo.enable_offload(model, route="dynamic_offload", use_environment=False)
    run(model, inputs)
    assert again.metrics_snapshot().as_dict()["runtime"]["passes"] == 1
    again.remove()


@pytest.mark.parametrize("route", ["linear", "native"])
def test_after_reclaim_parameters_read_the_checkpoint_and_the_next_forward_is_correct(tmp_path, flux, route):
    model, inputs = flux
    own = copy.deepcopy(model)
    reference = run(own, inputs)
    result, module = offload(tmp_path, model, route)
    run(module, inputs)
    slots, freed = result.reclaim()
    assert slots > 0 and freed > 0
    # Reading parameters now never touches released memory: streamed ones are placeholders.
    name = "transformer_blocks.0.attn.to_q.weight"
    weight = module.get_parameter(name)
    assert isinstance(weight, ddo.StreamedWeight)
    assert torch.equal(weight.detach().clone(), own.get_parameter(name).detach())
    assert torch.equal(module.get_parameter("x_embedder.weight"), own.get_parameter("x_embedder.weight"))
    assert torch.equal(run(module, inputs), reference)
    result.remove()


def test_gradients_through_the_offloaded_module_are_refused(flux):
    model, inputs = flux
    result = ddo.enable_offload(model, route="dynamic_offload", use_environment=False)
    x = dict(inputs, hidden_states=inputs["hidden_states"].clone().requires_grad_(True))
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="torch.no_grad"):
        model(**x)
    with torch.no_grad():
        model(**x)  # no graph: fine
    result.remove()


def test_an_assigned_parameter_is_refused_and_submodule_state_dicts_are_right(flux):
    model, inputs = flux
    reference = {k: v.clone() for k, v in model.transformer_blocks[1].state_dict().items()}
    result = ddo.enable_offload(model, route="dynamic_offload", prefetch_depth=1, use_environment=False)
    run(model, inputs)
    block = model.transformer_blocks[1].state_dict()
    assert all(torch.equal(block[k], reference[k]) for k in reference)
    model.transformer_blocks[0].attn.to_q.weight = torch.nn.Parameter(torch.zeros(32, 32), requires_grad=False)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="was changed after ddo attached"):
        run(model, inputs)
    result.remove()


def test_unload_says_when_kept_tensors_still_hold_the_memory(tmp_path, flux):
    model, inputs = flux
    model.save_pretrained(tmp_path / "m")
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=0.006, prefetch_depth=1)
    loaded = ddo.from_pretrained_with_dynamic_offload(tmp_path / "m", apply_dynamic=True, dynamic_offload_config=config)
    run(loaded.module, inputs)
    kept = loaded.module.get_parameter("x_embedder.weight")
    with pytest.warns(UserWarning, match="still view its device memory"):
        loaded.offload.unload()
    del kept
    loaded.offload.reload()
    import warnings as w

    with w.catch_warnings():
        w.simplefilter("error")
        loaded.offload.unload()  # nothing kept: freed at once, no warning
    assert loaded.module.state_dict()["x_embedder.weight"].is_meta


def test_a_forward_after_unload_says_to_reload(tmp_path, flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    model.save_pretrained(tmp_path / "m")
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device="cpu", vmm_resident_weight_budget_gb=0.006, prefetch_depth=1)
    loaded = ddo.from_pretrained_with_dynamic_offload(tmp_path / "m", apply_dynamic=True, dynamic_offload_config=config)
    loaded.offload.unload()
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="is unloaded .*call reload"):
        run(loaded.module, inputs)
    loaded.offload.reload()
    assert torch.equal(run(loaded.module, inputs), reference)
    loaded.offload.remove()


@pytest.mark.parametrize("route", ["linear", "native"])
def test_parameters_read_between_passes_are_the_checkpoints_values(tmp_path, flux, route):
    """A streamed block's memory holds other blocks' weights between passes: its parameters are
    placeholders then, which read the source (norms, EMA copies, printing) and refuse writes."""
    model, inputs = flux
    reference = copy.deepcopy(model)
    want = run(reference, inputs)
    result, module = offload(tmp_path, model, route)
    assert torch.equal(run(module, inputs), want)
    name = "transformer_blocks.0.attn.to_q.weight"
    weight = module.get_parameter(name)
    assert isinstance(weight, ddo.StreamedWeight) and isinstance(weight, torch.nn.Parameter)
    assert (weight.shape, weight.dtype, weight.device) == (reference.get_parameter(name).shape, torch.float32, torch.device("cpu"))
    own = dict(reference.named_parameters())
    # Norms and an EMA copy of every parameter, after a pass and again after the next one.
    for _ in range(2):
        for n, p in module.named_parameters():
            assert torch.equal(p.detach().clone(), own[n].detach()), n
            assert torch.equal(torch.linalg.vector_norm(p), torch.linalg.vector_norm(own[n].detach())), n
        assert torch.equal(run(module, inputs), want)
    assert name in repr(weight)
    # Writes are refused at the moment they are tried, through views and indices too, and
    # nothing changes (the linear route's host tensors included).
    writes = (
        lambda w: w.add_(1),
        lambda w: w.data.copy_(torch.zeros_like(w)),
        lambda w: w.zero_(),
        lambda w: w[0].zero_(),
        lambda w: w.__setitem__(0, 0.0),
        lambda w: w.data.__setitem__((slice(None), 1), 0.0),
        lambda w: w.view(-1).mul_(2),
        lambda w: w.t()[1:3].fill_(7),
        lambda w: w.split(4)[1].zero_(),
        lambda w: setattr(w, "data", torch.zeros(w.shape)),
    )
    with torch.no_grad():
        for write in writes:
            with pytest.raises(ddo.DynamicOffloadLifecycleError, match="writing into transformer_blocks.0"):
                write(weight)
    value = own[name].detach()
    assert torch.equal(weight.detach().clone(), value)
    # Views read the values they view; the common ways out of a tensor give them as plain data.
    assert torch.equal(weight[3].clone(), value[3]) and torch.equal(weight.t()[1:3].clone(), value.t()[1:3])
    assert torch.equal(torch.stack(weight.split(8)), torch.stack(value.split(8)))
    assert weight.tolist() == value.tolist() and (weight.numpy() == value.numpy()).all()
    assert torch.equal(copy.deepcopy(weight), value) and type(copy.deepcopy(weight)) is torch.Tensor
    buffer = io.BytesIO()
    torch.save(dict(module.named_parameters()), buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer)[name], value)
    assert torch.equal(run(module, inputs), want)
    result.remove()


@pytest.mark.parametrize("route", ["linear", "native"])
def test_a_move_to_where_the_weights_are_changes_nothing_and_any_other_is_refused(tmp_path, flux, route):
    model, inputs = flux
    want = run(copy.deepcopy(model), inputs)
    result, module = offload(tmp_path, model, route)
    run(module, inputs)
    assert module.to("cpu") is module
    module.to(device="cpu", dtype=torch.float32).float().cpu()
    assert torch.equal(run(module, inputs), want)
    moves = (
        lambda m: m.half(),
        lambda m: m.to(torch.bfloat16),
        lambda m: m.double(),
        lambda m: m.to("meta"),
        lambda m: m.transformer_blocks[0].half(),
        lambda m: m.single_transformer_blocks[1].attn.to_q.to(torch.bfloat16),
    )
    for move in moves:
        with pytest.raises(ddo.DynamicOffloadLifecycleError, match="moving or casting"):
            move(module)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="load its state_dict"):
        copy.deepcopy(module)
    assert torch.equal(run(module, inputs), want)
    result.remove()
    # Removed: the module is a plain module again.
    if route == "linear":
        assert module.half() is module and module.transformer_blocks[0].attn.to_q.weight.dtype == torch.float16


def test_a_write_into_a_host_tensor_the_linear_route_streams_from_is_refused(flux):
    model, inputs = flux
    want = run(copy.deepcopy(model), inputs)
    kept = model.transformer_blocks[1].attn.to_k.weight  # the user's reference, from before
    result = ddo.enable_offload(model, route="dynamic_offload", prefetch_depth=1, use_environment=False)
    assert torch.equal(run(model, inputs), want)
    with torch.no_grad():
        kept.mul_(2)
    with pytest.raises(ddo.DynamicOffloadSourceChangedError, match="transformer_blocks.1.attn.to_k.weight.*was written"):
        run(model, inputs)
    result.remove()


@pytest.mark.parametrize("route", ["linear", "native"])
def test_an_in_place_write_into_a_resident_weight_is_refused_at_the_next_forward(tmp_path, flux, route):
    model, inputs = flux
    result, module = offload(tmp_path, model, route)
    run(module, inputs)
    resident = module.get_parameter("x_embedder.weight")  # a view of resident arena memory
    assert not isinstance(resident, ddo.StreamedWeight)
    with torch.no_grad():
        torch.nn.init.zeros_(resident)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="x_embedder.weight was written in place"):
        run(module, inputs)
    result.remove()


@pytest.mark.parametrize("route", ["linear", "native"])
@pytest.mark.parametrize("block", ["transformer_blocks.0", "single_transformer_blocks.1"])
def test_a_block_weight_replaced_between_passes_is_refused_and_restoring_it_recovers(tmp_path, flux, route, block):
    # Each block's weights are compared in its pre-hook, while the blocks before it run: the
    # pass ends there with an error, and the module serves again once the weight is back.
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result, module = offload(tmp_path, model, route)
    assert torch.equal(run(module, inputs), reference)
    layer = f"{block}.proj_out" if "single" in block else f"{block}.ff.net.2"
    owner = module.get_submodule(layer)
    published = owner.weight
    owner.weight = torch.nn.Parameter(torch.zeros(published.shape, dtype=published.dtype), requires_grad=False)
    for _ in range(2):  # the refusal repeats: no pass is left open
        with pytest.raises(ddo.DynamicOffloadLifecycleError, match=f"{layer}.weight was changed after ddo attached"):
            run(module, inputs)
    owner.weight = published
    assert torch.equal(run(module, inputs), reference)
    result.remove()


class _Skip(torch.nn.Module):
    """A single block that passes its inputs through."""

    def forward(self, hidden_states, encoder_hidden_states, **_kwargs):
        return encoder_hidden_states, hidden_states


@pytest.mark.parametrize("route", ["linear", "native"])
def test_a_changed_weight_of_a_block_the_forward_skipped_is_refused_before_the_output_returns(tmp_path, flux, route):
    model, inputs = flux
    result, module = offload(tmp_path, model, route)
    run(module, inputs)
    blocks = module.single_transformer_blocks
    skipped = blocks[1]
    blocks[1] = _Skip()
    want = run(module, inputs)  # the block's hooks never run
    assert torch.equal(run(module, inputs), want)
    published = skipped.proj_out.weight
    skipped.proj_out.weight = torch.nn.Parameter(torch.zeros(published.shape, dtype=published.dtype), requires_grad=False)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="single_transformer_blocks.1.proj_out.weight was changed"):
        run(module, inputs)
    skipped.proj_out.weight = published
    assert torch.equal(run(module, inputs), want)
    blocks[1] = skipped
    result.remove()


@pytest.mark.parametrize("derived", [False, True])
def test_reclaim_keeps_the_slots_a_weight_kept_from_a_forward_still_views(tmp_path, flux, derived):
    # A streamed weight kept from inside its block's forward (or a tensor derived from it) views
    # slot memory: reclaim() leaves the slots mapped and says why, and reclaims them once the
    # reference is dropped.
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result, module = offload(tmp_path, model, "native")
    layer = module.single_transformer_blocks[1].proj_mlp
    assert isinstance(layer.weight, ddo.StreamedWeight)
    kept = []
    h = layer.register_forward_hook(lambda m, _i, _o: kept.append(m.weight.t() if derived else m.weight))
    assert torch.equal(run(module, inputs), reference)
    h.remove()
    with pytest.warns(UserWarning, match=r"reclaim\(\) kept the execution slots .*single_transformer_blocks\.1"):
        assert result.reclaim() == (0, 0)
    assert torch.isfinite(kept[0].float()).all()  # still mapped: readable (its values are the slot's now)
    kept.clear()
    slots, freed = result.reclaim()
    assert slots > 0 and freed > 0
    assert torch.equal(run(module, inputs), reference)
    result.remove()


def test_reclaim_keeps_the_slots_of_a_weight_kept_across_a_refused_replan(tmp_path, flux):
    # A re-plan refused because the host holds a view publishes new views of the same memory:
    # the kept one still keeps reclaim() from freeing the slots.
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result, module = offload(tmp_path, model, "native")
    kept = []
    h = module.single_transformer_blocks[1].proj_mlp.register_forward_hook(lambda m, _i, _o: kept.append(m.weight))
    run(module, inputs)
    h.remove()
    assert result.runtime.set_budget(64 << 20) is False
    with pytest.warns(UserWarning, match="weights from before a re-plan refused while they were held"):
        assert result.reclaim() == (0, 0)
    assert torch.isfinite(kept[0].float()).all()
    kept.clear()
    slots, _ = result.reclaim()
    assert slots > 0
    assert torch.equal(run(module, inputs), reference)
    result.remove()


def test_a_forward_after_remove_on_the_native_route_says_the_weights_went_with_the_arena(tmp_path, flux):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    result, module = offload(tmp_path, model, "native")
    assert torch.equal(run(module, inputs), reference)
    result.remove()
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="has no weights: ddo was removed"):
        run(module, inputs)
    # Weights loaded into it: an ordinary module again.
    module.to_empty(device="cpu")
    module.load_state_dict(state)
    import pickle

    copied = pickle.loads(pickle.dumps(module))  # the refusal travels with it until weights are in
    assert torch.equal(run(copied, inputs), reference) and not copied._forward_pre_hooks
    assert torch.equal(run(module, inputs), reference)
    assert not module._forward_pre_hooks


@pytest.mark.parametrize("route", ["linear", "native"])
def test_pickling_and_diffusers_placement_hooks_are_refused_and_the_module_is_unchanged(tmp_path, flux, route):
    import pickle

    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result, module = offload(tmp_path, model, route)
    for target in (module, module.transformer_blocks[0]):
        with pytest.raises(ddo.DynamicOffloadLifecycleError, match="cannot be pickled, copied or saved whole"):
            pickle.dumps(target)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match=r"enable_group_offload\(\) would move or cast"):
        module.enable_group_offload(torch.device("cpu"), offload_type="leaf_level")
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match=r"enable_layerwise_casting\(\)"):
        module.enable_layerwise_casting()
    assert not any(hasattr(m, "_diffusers_hook") for m in module.modules())
    assert torch.equal(run(module, inputs), reference)
    result.remove()
    assert "enable_group_offload" not in module.__dict__ and "__reduce_ex__" not in module.__dict__
    if route == "linear":  # its own host tensors again: an ordinary module
        assert torch.equal(run(pickle.loads(pickle.dumps(module)), inputs), reference)


def test_training_is_refused_when_asked_for_and_the_module_is_unchanged(flux):
    model, inputs = flux
    want = run(copy.deepcopy(model), inputs)
    result = ddo.enable_offload(model, route="dynamic_offload", prefetch_depth=1, use_environment=False)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="eval mode"):
        model.train()
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="cannot require grad"):
        model.requires_grad_()
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.eval() is model and model.requires_grad_(False) is model
    assert torch.equal(run(model, inputs), want)
    result.remove()
    assert model.train() is model and model.training


def test_placeholders_as_inputs_of_out_and_foreach_ops(tmp_path, flux):
    model, inputs = flux
    own = copy.deepcopy(model)
    result, module = offload(tmp_path, model, "native")
    run(module, inputs)
    name = "transformer_blocks.0.attn.to_q.weight"
    weight, value = module.get_parameter(name), own.get_parameter(name).detach()
    out = torch.zeros_like(value)
    torch.add(weight, 1, out=out)
    assert torch.equal(out, value + 1)
    torch.mul(weight[3], 2, out=out[0])
    assert torch.equal(out[0], value[3] * 2)
    with torch.no_grad(), pytest.raises(ddo.DynamicOffloadLifecycleError, match="writing into"):
        torch._foreach_add_([weight], 1)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="load its state_dict"):
        copy.deepcopy(module.transformer_blocks[0])
    # A cast of a submodule to its own dtype is a no-op.
    assert module.transformer_blocks[0].to(torch.float32) is module.transformer_blocks[0]
    assert torch.equal(weight.detach().clone(), value)
    result.remove()


@pytest.mark.parametrize("route", ["linear", "native"])
@pytest.mark.parametrize("op", ["unload", "reclaim", "set_budget"])
def test_a_change_is_refused_before_anything_publishes_again_over_it(tmp_path, flux, route, op):
    # Publishing views (or placeholders) again would silently undo the change, or keep half of
    # it: a tie or a swap of two weights is refused with what to do, and remove() still works.
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result, module = offload(tmp_path, model, route)
    assert torch.equal(run(module, inputs), reference)
    swap_two_weights(module)
    runtime = result.runtime
    act = {
        "unload": result.unload,
        "reclaim": result.reclaim,
        "set_budget": lambda: runtime.set_budget(64 << 20),
    }[op]
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="now holds another of the module's parameters"):
        act()
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="now holds another"):
        run(module, inputs)
    result.remove()


def test_a_change_while_unloaded_is_refused_at_reload(tmp_path, flux):
    model, inputs = flux
    result, module = offload(tmp_path, model, "native")
    run(module, inputs)
    result.unload()
    attn = module.transformer_blocks[0].attn
    attn.to_q.weight = torch.nn.Parameter(torch.zeros_like(attn.to_q.weight), requires_grad=False)
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="to_q.weight was changed after ddo attached"):
        result.reload()
    result.remove()


@pytest.mark.parametrize("route", ["linear", "native"])
@pytest.mark.parametrize("change", ["delete", "parametrize"])
def test_remove_closes_the_session_whatever_became_of_the_parameters(tmp_path, flux, route, change):
    model, inputs = flux
    result, module = offload(tmp_path, model, route)
    run(module, inputs)
    # A resident layer (the rest outside the blocks): a streamed one refuses both at once.
    layer = module.x_embedder
    if change == "delete":
        del layer.bias
    else:

        class Double(torch.nn.Module):
            def forward(self, w):
                return 2 * w

        torch.nn.utils.parametrize.register_parametrization(layer, "weight", Double())
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="was changed after ddo attached"):
        run(module, inputs)
    if route == "linear" and change == "delete":
        result.remove()  # the module's own tensors go back, the deleted one too
        assert isinstance(layer.bias, torch.nn.Parameter) and not layer.bias.is_meta
    else:
        with pytest.warns(UserWarning, match="could not be given back .*x_embedder"):
            result.remove()
    assert result.runtime.session.is_unloaded()
    result.remove()  # a second remove changes nothing


@pytest.mark.parametrize("route", ["linear", "native"])
def test_torch_compile_of_the_module_or_a_block_serves_the_resident_output(tmp_path, flux, route):
    """Dynamo runs ddo's entry and hooks eagerly between its compiled regions; a block compiled
    with fullgraph=True compiles its own computation only (ddo's hooks stay eager around it)."""
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result, module = offload(tmp_path, model, route)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(module, backend="eager")
        for _ in range(2):
            with torch.no_grad():
                assert torch.equal(compiled(**inputs)[0], reference)
        block = module.transformer_blocks[0]
        torch._dynamo.reset()
        module.transformer_blocks[0] = torch.compile(block, backend="eager", fullgraph=True)
        for _ in range(2):
            assert torch.equal(run(module, inputs), reference)
        module.transformer_blocks[0] = block
        assert torch.equal(run(module, inputs), reference)
        torch._dynamo.reset()
        module.transformer_blocks[0] = torch.compile(block, backend="eager")
        assert torch.equal(run(module, inputs), reference)
        module.transformer_blocks[0] = block
    finally:
        torch._dynamo.reset()
    result.remove()
