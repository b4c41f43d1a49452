"""The native CPU backend's thread pool: sized from the cores this process may use (affinity
and cgroup quota), threads that sleep rather than spin, and the user's settings respected."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from needle.backends.cpu import threads


def _cgroup(tmp_path, v2=None, v1=None):
    if v2 is not None:
        (tmp_path / "cpu.max").write_text(v2 + "\n")
    if v1 is not None:
        (tmp_path / "cpu").mkdir()
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(f"{v1[0]}\n")
        (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(f"{v1[1]}\n")
    return tmp_path


@pytest.mark.parametrize("v2,v1,expected", [
    ("max 100000", None, None),
    ("150000 100000", None, 1.5),
    ("200000 100000", None, 2.0),
    (None, (-1, 100000), None),
    (None, (50000, 100000), 0.5),
    (None, None, None),
    ("garbage", None, None),
])
def test_cgroup_cpu_limit_reads_v2_and_v1(tmp_path, v2, v1, expected):
    assert threads.cgroup_cpu_limit(_cgroup(tmp_path, v2, v1)) == expected


def test_available_cpus_is_capped_by_the_quota_and_at_least_one(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 64)
    assert threads.available_cpus(_cgroup(tmp_path, "250000 100000")) == 3  # 2.5 CPUs -> 3
    assert threads.available_cpus(tmp_path / "none") == 64
    (tmp_path / "cpu.max").write_text("1000 100000\n")  # 0.01 CPU
    assert threads.available_cpus(tmp_path) == 1


def test_configure_fills_in_only_what_the_user_left_unset(monkeypatch):
    monkeypatch.setattr(threads, "available_cpus", lambda: 6)
    env: dict = {}
    assert threads.configure(env) == {"OMP_NUM_THREADS": "6", "OMP_WAIT_POLICY": "passive"}
    env = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "active"}
    assert threads.configure(env) == {} and env["OMP_NUM_THREADS"] == "3"
    env = {"NEEDLE_CPU_THREADS": "2", "GOMP_SPINCOUNT": "1000"}
    assert threads.configure(env) == {"OMP_NUM_THREADS": "2"}
    env = {"NEEDLE_CPU_THREADS": "lots"}
    assert threads.configure(env)["OMP_NUM_THREADS"] == "6"


def _team_size(env: dict, prefix: list[str] | None = None) -> int:
    code = ("import needle.backend_ndarray as nd; d = nd.cpu();"
            "print(d.backend.num_threads() if d.enabled else 'disabled')")
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "NEEDLE_CPU_THREADS")}
    out = subprocess.run([*(prefix or []), sys.executable, "-c", code], env={**clean, **env},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out != "disabled", ("the native cpu backend is not built: it is part of the "
                               "install (pip install -e .)")
    return int(out)


def test_the_loaded_backend_uses_the_chosen_team_size():
    assert _team_size({}) == threads.available_cpus()
    assert _team_size({"NEEDLE_CPU_THREADS": "1"}) == 1
    assert _team_size({"OMP_NUM_THREADS": "3"}) == 3


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or not os.path.exists("/usr/bin/taskset"), reason="needs taskset and 2 CPUs")
def test_the_team_follows_the_affinity_mask():
    cpu = sorted(os.sched_getaffinity(0))[0]
    assert _team_size({}, ["taskset", "-c", str(cpu)]) == 1


DECODE_SPLIT = """
import numpy as np
from needle import backend_ndarray as nd
rng = np.random.default_rng(0)
worst = 0.0
for qh, kvh, d, p in [(5, 1, 64, 70), (10, 2, 32, 3), (7, 1, 128, 200), (16, 2, 64, 130),
                      (3, 3, 16, 0)]:
    arrays = [rng.standard_normal((qh + 2 * kvh) * d), rng.standard_normal((256, d // 2)),
              rng.standard_normal((256, d // 2)), np.array([p], np.int32),
              rng.standard_normal((kvh, 256, d)), rng.standard_normal((kvh, 256, d))]
    got, want = (nd.attention_decode(*[nd.array(a.astype(a.dtype if a.dtype == np.int32
                                                         else np.float32), device=dev)
                                       for a in arrays], qh).numpy()
                 for dev in (nd.cpu(), nd.cpu_numpy()))
    worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
print(worst)
"""


@pytest.mark.parametrize("team", ["3", "4", "7"])
def test_decode_attention_splits_a_kv_head_among_the_threads(team):
    """attention_decode takes a KV head with its query heads as one item, split into parts
    where there are fewer KV heads than threads: every split (5 query heads over 1 KV head
    with 4 threads: parts of 2, 2, 1) gives numpy_ref's result."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "NEEDLE_CPU_THREADS")}
    out = subprocess.run([sys.executable, "-c", DECODE_SPLIT],
                         env={**clean, "OMP_NUM_THREADS": team}, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert float(out) < 1e-5, out
