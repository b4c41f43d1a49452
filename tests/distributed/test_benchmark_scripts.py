"""The distributed benchmarks (the figures the 2-GPU machine is to give) run, tiny, on 2
MPI ranks; what they print is what docs/distributed.md describes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .jobs import run_job

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


@pytest.mark.parametrize("script, args, expect", [
    ("distributed_allreduce.py", ("--min-mib", "0.25", "--max-mib", "0.5", "--samples", "2"),
     "all_reduce float32 sum, 2 ranks, mpi on cpu"),
    ("distributed_allreduce_latency.py", ("--max-kib", "8", "--repeat", "2", "--samples", "2"),
     "all_reduce bfloat16 sum latency, 2 ranks, mpi on cpu"),
    ("distributed_tp_decode.py", ("--shapes", "tiny", "--dtype", "float32", "--prompt", "4",
                                  "--tokens", "6"), "TP=2 tiny float32 on cpu (mpi): decode"),
    ("distributed_dp_step.py", ("--preset", "tiny", "--steps", "2"),
     "DP=2 tiny on cpu (mpi): step"),
    ("distributed_tp_serve.py", ("--shapes", "tiny", "--dtype", "float32", "--streams", "1,4",
                                 "--tokens", "4"),
     "TP=2 serving tiny float32 on cpu (mpi), greedy"),
    ("distributed_tp_serve.py", ("--shapes", "tiny", "--dtype", "float32", "--streams", "1,4",
                                 "--tokens", "4", "--temperature", "0.8", "--top-p", "0.9"),
     "TP=2 serving tiny float32 on cpu (mpi), temperature 0.8, top-p 0.9"),
])
def test_benchmark_runs(script, args, expect):
    job = run_job(str(BENCHMARKS / script), *args)
    assert job.returncode == 0, job.stderr
    assert job.stdout.startswith(expect)
    if script == "distributed_tp_serve.py":  # a row per stream count, tokens made
        rows = [line.split() for line in job.stdout.splitlines()[1:]]
        assert [int(r[2][:-1]) for r in rows] == [1, 4] and all(float(r[3]) > 0 for r in rows)


def test_the_torch_peer_runs():
    """benchmarks/distributed_allreduce_torch.py (torch.distributed's all-reduce, the peer of
    distributed_allreduce.py) under torchrun, on the CPU through gloo: its table's rows.
    torch is part of the test install (README), so its absence fails here, not skips."""
    import torch.distributed.run  # noqa: F401
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               str(BENCHMARKS / "distributed_allreduce_torch.py"), "--min-mib", "0.25",
               "--max-mib", "0.5", "--samples", "2"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    job = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert job.returncode == 0, job.stderr[-3000:]
    lines = job.stdout.splitlines()
    assert lines[0].startswith("all_reduce float32 sum, 2 ranks, torch ")
    rows = [line.split() for line in lines[2:]]
    assert [int(r[0]) for r in rows] == [262144, 524288]
    assert all(float(r[3]) > 0 for r in rows)  # busbw
