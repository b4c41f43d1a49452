"""The bad-input catalogue (tests/bad_inputs/cases.py): every case must raise a NeedleError
whose message names the argument that was wrong; CLI cases must exit non-zero naming it,
without a traceback. Each group runs in its own subprocess, so a crash or a hang fails the
group instead of the test run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bad_inputs.cases import CASES, DEVICES

WORKER = Path(__file__).parent / "bad_inputs" / "worker.py"
RUNS = [(group, device) for group in CASES for device in DEVICES.get(group, [None])]


@pytest.mark.parametrize("group,device", RUNS, ids=[f"{g}-{d or 'any'}" for g, d in RUNS])
def test_bad_inputs_raise_clear_errors(group, device):
    args = [sys.executable, str(WORKER), group] + ([device] if device else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NEEDLE_DEVICE": "cpu"}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, f"the {group} worker died (status {proc.returncode}) after " \
        f"{len(results)} cases:\n{proc.stderr[-2000:]}"
    assert len(results) == len(CASES[group])
    failures = [f"  {r['code']}\n      {r['why']}" for r in results if not r["ok"]]
    assert not failures, f"{len(failures)} of {len(results)} {group} cases:\n" + "\n".join(failures)


def test_catalogue_covers_the_public_api():
    runs = sum(len(CASES[g]) * len(DEVICES.get(g, [None])) for g in CASES)
    assert runs >= 300, runs
    assert set(CASES) == {"arrays", "ops", "nn", "optim", "data", "serialization", "models", "cli"}
