"""The collectives' contract, on 2 real MPI processes (scripts/collectives_contract.py
checks every op, dtype and CPU device against numpy on both ranks)."""

from __future__ import annotations

import re

import pytest

from needle import backend_ndarray as nd
from needle import distributed as dist
from needle.errors import DistributedError

from .jobs import run_job


def test_contract_on_two_processes():
    job = run_job("collectives_contract.py")
    assert job.returncode == 0, job.stdout + job.stderr
    # the ranks share one pipe: unbuffered (PYTHONUNBUFFERED), a line's text and its newline
    # are two writes, which the other rank's may fall between
    assert sorted(re.findall(r"ok \d", job.stdout)) == ["ok 0", "ok 1"]


def test_collectives_need_a_group():
    assert not dist.is_initialized()
    assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    with pytest.raises(DistributedError, match="init_process_group"):
        dist.all_reduce(nd.array([1.0]))
    with pytest.raises(DistributedError, match="init_process_group"):
        dist.barrier()


def test_unknown_backend_and_wrong_device():
    with pytest.raises(DistributedError, match="unknown backend"):
        dist.init_process_group(backend="gloo")
    with pytest.raises(DistributedError, match="CPU arrays"):
        dist.init_process_group(backend="mpi", device=nd.Device("cuda", 0))
    assert not dist.is_initialized()


def test_single_process_group():
    """A process started alone is rank 0 of 1 (MPI singleton): collectives are identities."""
    g = dist.init_process_group(backend="mpi", device="cpu_numpy", timeout=10)
    try:
        assert (g.rank, g.world_size, g.device) == (0, 1, nd.cpu_numpy())
        x = nd.array([[1.0, 2.0]], device=nd.cpu_numpy())
        assert dist.all_reduce(x, "avg").numpy().tolist() == [[1.0, 2.0]]
        assert dist.all_gather(x).shape == (1, 1, 2)
        assert dist.reduce_scatter(x).numpy().tolist() == [[1.0, 2.0]]
        with pytest.raises(DistributedError, match="already initialized"):
            dist.init_process_group(backend="mpi")
    finally:
        dist.destroy_process_group()



def test_checked_calls_catch_ranks_that_disagree():
    job = run_job("mismatch.py", env={"NEEDLE_DIST_CHECK": "1"})
    assert job.returncode == 0, job.stdout + job.stderr
    assert sorted(re.findall(r"caught \d", job.stdout)) == ["caught 0", "caught 1"]
