"""The distributed benchmarks (the figures the 2-GPU machine is to give) run, tiny, on 2
MPI ranks; what they print is what docs/distributed.md describes."""

from __future__ import annotations

from pathlib import Path

import pytest

from .jobs import run_job

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


@pytest.mark.parametrize("script, args, expect", [
    ("distributed_allreduce.py", ("--min-mib", "0.25", "--max-mib", "0.5", "--samples", "2"),
     "all_reduce float32 sum, 2 ranks, mpi on cpu"),
    ("distributed_tp_decode.py", ("--shapes", "tiny", "--dtype", "float32", "--prompt", "4",
                                  "--tokens", "6"), "TP=2 tiny float32 on cpu (mpi): decode"),
    ("distributed_dp_step.py", ("--preset", "tiny", "--steps", "2"),
     "DP=2 tiny on cpu (mpi): step"),
])
def test_benchmark_runs(script, args, expect):
    job = run_job(str(BENCHMARKS / script), *args)
    assert job.returncode == 0, job.stderr
    assert job.stdout.startswith(expect)
