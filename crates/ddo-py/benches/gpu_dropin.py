"""Checks, on a CUDA GPU, what a host of the published library uses beside the offload itself:
the host example with the --ddo-* flags on both backends (images equal Diffusers' own), the
execution timer on CUDA events, the phase helpers, a capacity profile built and applied, the
VAE's layer route against resident, and `python -m ddo doctor` / `bench` on a saved model.
Prints one line per check and exits non-zero if one fails."""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
import tempfile
from contextlib import redirect_stdout

import torch

import ddo

# The shared fixtures (tiny_pipelines, host) are in examples/ in the repository, beside this file in
# the GPU bundle.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..", "examples")]
import host  # noqa: E402
from tiny_pipelines import flux_pipeline, flux_transformer_inputs, report  # noqa: E402

DEVICE = os.environ.get("DDO_FEATURES_DEVICE", "cuda:0")


def check_host(work: str, flags: list) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        status = host.main(["--device", DEVICE, "--check", *flags])
    text = out.getvalue()
    assert status == 0 and "identical to the run without ddo: True" in text, text[-2000:]
    return next(line for line in text.splitlines() if line.startswith("generated"))


def tiny_transformer():
    torch.manual_seed(0)
    pipe, _ = flux_pipeline()
    return pipe.transformer.to(torch.bfloat16).eval()


def check_timer(_work: str) -> str:
    model = tiny_transformer()
    inputs = flux_transformer_inputs(0, DEVICE)
    result = ddo.enable_offload(model, route="dynamic_offload", execution_device=DEVICE, use_environment=False)
    timer = result.execution_timer(enabled=True)
    with timer, torch.no_grad():
        for _ in range(3):
            model(**inputs)
            timer.mark_step()
    snap = timer.snapshot(wait=True)
    clock = "cuda_event" if DEVICE.startswith("cuda") else "host_perf_counter"
    assert snap["clock"] == clock and snap["status"] == "complete" and snap["step_count"] == 3, snap
    assert snap["steady_state_seconds_per_step"] > 0, snap
    m = result.metrics_snapshot(execution_timing=timer)
    m.validate()
    # The published constructor, positionally, as hosts call it.
    direct = ddo.DynamicOffloadExecutionTimer(True, DEVICE, None, False)
    with direct, torch.no_grad():
        model(**inputs)
        direct.mark_step()
    attached = direct.attach(result.metrics_snapshot(), wait=True)
    assert attached.runtime["execution_timing"]["status"] == "complete", attached.runtime
    result.remove()
    return f"steady {snap['steady_state_seconds_per_step'] * 1e3:.2f} ms/step"


def check_phases(_work: str) -> str:
    model = tiny_transformer()
    inputs = flux_transformer_inputs(0, DEVICE)
    result = ddo.enable_offload(
        model, route="dynamic_offload", execution_device=DEVICE, use_environment=False, resident_module_budget_gb=0.002
    )
    with torch.no_grad():
        model(**inputs)
    host_cache = ddo.release_pytorch_host_cache(enabled=True, phase="after_run").as_dict()
    idle = ddo.release_native_vmm_idle_cache(enabled=True, phase="after_run", device=DEVICE).as_dict()
    statuses = [json.dumps(d["runtime"])[:200] for d in (host_cache, idle)]
    with torch.no_grad():
        model(**inputs)  # runs again after the release
    result.remove()
    return "; ".join(statuses)


def check_profile(work: str) -> str:
    folder = os.path.join(work, "flux-transformer")
    tiny_transformer().save_pretrained(folder)
    inputs = flux_transformer_inputs(0, DEVICE)
    os.environ["DDO_PROFILE_DIR"] = os.path.join(work, "profiles")
    config = ddo.DynamicOffloadConfig(backend="vmm", execution_device=DEVICE, vmm_resident_weight_budget_gb=0.01)
    if not DEVICE.startswith("cuda"):
        try:
            ddo.from_pretrained_with_dynamic_offload(
                folder, apply_dynamic=True, dynamic_offload_config=config, profile_name="tiny", build_profile=True
            )
        except ddo.DynamicOffloadConfigError as e:
            assert "measures GPU memory" in str(e), e
            return "refused off CUDA, as it must be"
        raise AssertionError("build_profile on the host backend was not refused")
    built = ddo.from_pretrained_with_dynamic_offload(
        folder, apply_dynamic=True, dynamic_offload_config=config, profile_name="tiny", build_profile=True,
        torch_dtype=torch.bfloat16,
    )
    from diffusers import FluxTransformer2DModel

    with torch.no_grad():
        reference = FluxTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).to(DEVICE)(**inputs)[0]
    with built.profile_run(), torch.no_grad():
        assert torch.equal(built.module(**inputs)[0], reference), "the profiled run differs from the resident run"
    recorded = built.offload.metrics_snapshot().as_dict()["setup"]["capacity_profile"]
    assert recorded["status"] == "recorded", recorded
    built.offload.remove()
    again = ddo.from_pretrained_with_dynamic_offload(
        folder, apply_dynamic=True, profile_name="tiny", torch_dtype=torch.bfloat16,
        dynamic_offload_config=ddo.DynamicOffloadConfig(backend="vmm", execution_device=DEVICE),
    )
    applied = again.offload.metrics_snapshot().as_dict()["setup"]["capacity_profile"]
    assert applied["status"] == "applied", applied
    with torch.no_grad():
        assert torch.equal(again.module(**inputs)[0], reference), "the run under the profile's budget differs"
    again.offload.remove()
    return f"recommended {recorded['recommended_budget_gb']:.3f} GiB, applied {applied['budget_gb']:.3f} GiB"


def check_tools(work: str) -> str:
    folder = os.path.join(work, "flux-tools")
    tiny_transformer().save_pretrained(folder)
    doctor = subprocess.run(
        [sys.executable, "-m", "ddo", "doctor", "--checkpoint", folder, "--dir", work, "--json"],
        capture_output=True, text=True, check=True,
    )
    report_ = json.loads(doctor.stdout)
    bench = subprocess.run(
        [sys.executable, "-m", "ddo", "bench", folder, "--device", DEVICE, "--steps", "3", "--json"],
        capture_output=True, text=True,
    )
    assert bench.returncode == 0, f"bench exited {bench.returncode}: {bench.stdout[-3000:]} {bench.stderr[-3000:]}"
    rows = json.loads(bench.stdout)
    return f"doctor {json.dumps(report_)[:300]}; bench {json.dumps(rows)[:300]}"


def main() -> int:
    checks = [
        ("host example, backend linear", lambda w: check_host(w, [])),
        ("host example, backend vmm", lambda w: check_host(w, ["--ddo-backend", "vmm", "--ddo-vmm-resident-weight-budget-gb", "0.01"])),
        ("execution timer on CUDA events", check_timer),
        ("phase helpers after a run", check_phases),
        ("capacity profile built, then applied", check_profile),
        ("python -m ddo doctor and bench", check_tools),
    ]
    with tempfile.TemporaryDirectory() as work:
        return report(checks, work, DEVICE)


if __name__ == "__main__":
    sys.exit(main())
