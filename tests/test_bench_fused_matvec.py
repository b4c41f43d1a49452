"""The fused-projection benchmark cases (benchmarks/cases_fused_matvec.py) run, and needle's
results agree with the numpy and PyTorch compositions (speed is never asserted here)."""

from __future__ import annotations

import json

import pytest
from benchmarks import __main__ as bench_main

import needle.backend_ndarray as nd


@pytest.mark.parametrize("device", ["cpu_numpy", "cpu"])
def test_quick_fused_matvec_cases_run_and_agree(device, tmp_path):
    dev = nd.cpu_numpy() if device == "cpu_numpy" else nd.cpu()
    assert dev.enabled(), dev.reason  # both CPU backends are part of the install
    out = tmp_path / "bench.json"
    assert bench_main.main(["--device", device, "--quick", "--repeat", "2",
                            "--cases", "fused_matvec", "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    names = {c["name"] for c in cases}
    for dt in ("f32", "bf16"):
        for name in (f"rmsnorm_matvec_{dt}_64x96", f"rmsnorm_matvec_swiglu_{dt}_64x160",
                     f"matvec_add_{dt}_160x64"):
            assert name in names
    for case in cases:
        assert not case["skipped"], case
        assert case["check"]["ok"], case
        peers = set(case["impls"]) - {"needle"}
        assert peers, case["name"]  # numpy (float32) or torch: something to compare with
        for fw, impl in case["impls"].items():
            assert impl["error"] is None, (case["name"], fw, impl["error"])
