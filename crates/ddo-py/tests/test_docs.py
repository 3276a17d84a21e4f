"""The Python quickstart of the README and of the book runs as written, on a tiny Flux pipeline
saved as the folder it names, with the tiny pipeline's small sizes added to the call, and
generates what Diffusers' own loading generates."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from tiny_pipelines import flux_pipeline, own_memory  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
PROMPT_CALL = '("a red cat on the mat")'
SMALL = '("a red cat on the mat", num_inference_steps=2, height=8, width=8, max_sequence_length=48)'


def python_blocks(page: str) -> list:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def runnable(code: str) -> str:
    assert PROMPT_CALL in code, "the quickstart calls the pipeline with its prompt"
    return code.replace(PROMPT_CALL, SMALL)


def resident_image(folder) -> np.ndarray:
    from diffusers import DiffusionPipeline

    pipe = own_memory(DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16))
    torch.manual_seed(0)
    return np.asarray(pipe("a red cat on the mat", num_inference_steps=2, height=8, width=8, max_sequence_length=48).images[0])


@pytest.mark.parametrize("page", ["README.md", "docs/src/guide/quickstart.md"])
def test_the_folder_quickstart_runs_as_written_and_generates_the_resident_image(tmp_path, monkeypatch, page):
    torch.manual_seed(0)
    pipe, _ = flux_pipeline()
    pipe.save_pretrained(tmp_path / "FLUX.1-dev")
    monkeypatch.chdir(tmp_path)
    code = runnable(python_blocks(page)[0])
    namespace: dict = {}
    torch.manual_seed(0)
    exec(compile(code, page, "exec"), namespace)
    loaded = namespace["loaded"]
    assert set(loaded.plan.components) == {"text_encoder", "text_encoder_2", "transformer", "vae"}
    assert "transformer" in loaded.components
    got = np.asarray(namespace["image"])
    np.testing.assert_array_equal(got, resident_image(tmp_path / "FLUX.1-dev"))
    loaded.remove()


def test_the_built_pipeline_quickstart_runs_as_written(tmp_path):
    torch.manual_seed(0)
    pipe, _ = flux_pipeline()
    pipe.save_pretrained(tmp_path / "flux")
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(tmp_path / "flux")
    code = runnable(python_blocks("docs/src/guide/quickstart.md")[1])
    namespace: dict = {"pipe": pipe}
    exec(compile(code, "quickstart", "exec"), namespace)
    results = namespace["results"]
    assert results["transformer"].runtime_route == "linear_runtime"
    assert namespace["image"].size == (8, 8)
    for r in results.values():
        r.remove()
