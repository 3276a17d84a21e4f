"""torch.compile beside offload: regional compilation (Diffusers' ``compile_repeated_blocks``, or
``block.compile()`` on each repeated block) of a module ddo offloads gives the uncompiled offloaded
module's output, compiles once (no recompilation while weights stream into other slots each
pass), and a whole-module ``torch.compile(fullgraph=True)`` gets ddo's refusal."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch._dynamo.utils import counters

import ddo

from test_boundaries import offload, run


def compile_regionally(module, how, **kwargs):
    if how == "compile_repeated_blocks":
        module.compile_repeated_blocks(fullgraph=True, **kwargs)
    else:
        for block in list(module.transformer_blocks) + list(module.single_transformer_blocks):
            block.compile(**kwargs)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class Recompiles(logging.Handler):
    """The recompilation reasons Dynamo logs (``torch._logging``'s ``recompiles`` artifact)."""

    def __init__(self):
        super().__init__()
        self.reasons = []

    def emit(self, record):
        self.reasons.append(record.getMessage())


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("how", ["compile_repeated_blocks", "block.compile"])
@pytest.mark.parametrize("route", ["linear", "native"])
def test_regional_compilation_gives_the_uncompiled_offloaded_output_and_compiles_once(tmp_path, flux, route, how, backend):
    model, inputs = flux
    result, module = offload(tmp_path, model, route)
    assert result.metrics_snapshot().as_dict()["setup"]["streamed_units"] >= 2
    want = run(module, inputs)
    compile_regionally(module, how, backend=backend)
    logger = logging.getLogger("torch._dynamo.guards.recompiles")
    torch._logging.set_logs(recompiles=True)
    seen = Recompiles()
    logger.addHandler(seen)
    try:
        assert torch.equal(run(module, inputs), want)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs >= 2 and not counters["graph_break"], (dict(counters["stats"]), dict(counters["graph_break"]))
        for _ in range(3):
            assert torch.equal(run(module, inputs), want)
        # Weights streamed into other slots (other storage) each pass: nothing compiled again.
        assert counters["stats"]["unique_graphs"] == graphs and not counters["recompiles"], dict(counters["stats"])
        assert not seen.reasons, seen.reasons
    finally:
        logger.removeHandler(seen)
        torch._logging.set_logs()
    result.remove()


def test_inductor_regional_compilation_offloaded_equals_resident_bit_for_bit(tmp_path, flux):
    """One block compiled by inductor (kept small: one graph for the C compiler)."""
    model, inputs = flux
    resident = copy.deepcopy(model)
    uncompiled = run(resident, inputs)
    result, module = offload(tmp_path, model, "native")
    resident.transformer_blocks[0].compile(backend="inductor", fullgraph=True)
    module.transformer_blocks[0].compile(backend="inductor", fullgraph=True)
    want = run(resident, inputs)
    torch.testing.assert_close(want, uncompiled)
    for _ in range(2):
        assert torch.equal(run(module, inputs), want)
    assert not counters["recompiles"]
    result.remove()


@pytest.mark.parametrize("route", ["linear", "native"])
@pytest.mark.parametrize("compile_whole", ["torch.compile", "module.compile"])
def test_a_whole_module_fullgraph_compile_is_refused_and_the_module_serves_on(tmp_path, flux, route, compile_whole):
    model, inputs = flux
    reference = run(copy.deepcopy(model), inputs)
    result, module = offload(tmp_path, model, route)
    if compile_whole == "torch.compile":
        compiled = torch.compile(module, backend="eager", fullgraph=True)
    else:
        module.compile(backend="eager", fullgraph=True)
        compiled = module
    with pytest.raises(ddo.DynamicOffloadUnsupportedError, match=r"regional compilation.*compile_repeated_blocks"):
        run(compiled, inputs)
    if compile_whole == "module.compile":
        module._compiled_call_impl = None
    assert torch.equal(run(module, inputs), reference)
    # Regional compilation afterwards works.
    module.compile_repeated_blocks(fullgraph=True, backend="eager")
    assert torch.equal(run(module, inputs), reference)
    result.remove()
