"""The host example (``examples/host.py``) runs a tiny random Flux pipeline with the published
``--ddo-*`` flags and generates the image Diffusers generates without ddo."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import host  # noqa: E402


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--ddo-backend", "linear", "--ddo-preset", "low_ram_safe", "--show-profile"],
        ["--ddo-backend", "vmm", "--ddo-vmm-resident-weight-budget-gb", "0.01", "--show-metrics"],
    ],
    ids=["defaults", "linear", "vmm"],
)
def test_the_host_example_generates_what_diffusers_generates(flags, capsys):
    assert host.main(["--device", "cpu", "--check", *flags]) == 0
    out = capsys.readouterr().out
    assert "identical to the run without ddo: True" in out
    assert "transformer: route dynamic_offload" in out
    if "--show-profile" in flags:
        assert "DDO profile" in out
    if "--show-metrics" in flags:
        assert '"schema_version": 2' in out


def test_a_bad_flag_value_is_the_flags_error():
    with pytest.raises(Exception, match="--ddo-vmm-resident-weight-budget-gb"):
        host.main(["--device", "cpu", "--ddo-backend", "vmm", "--ddo-vmm-resident-weight-budget-gb", "-1"])
