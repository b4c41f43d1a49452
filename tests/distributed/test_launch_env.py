"""Reading the launch variables of torchrun/needle run and of mpiexec."""

from __future__ import annotations

import pytest

from needle.distributed.launch_env import read_launch_env
from needle.errors import DistributedError


def test_torchrun_variables():
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                           "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank) == (3, 4, 1)
    assert (env.master_addr, env.master_port, env.launcher) == ("10.0.0.2", 1234, "env")


def test_mpiexec_variables_and_defaults():
    env = read_launch_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                           "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (1, 2, 1, "mpi")
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 29500)
    alone = read_launch_env({})
    assert (alone.rank, alone.world_size, alone.launcher) == (0, 1, "single")


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0"}, "WORLD_SIZE is not set"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "outside 0..1"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE must be >= 1"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "not a TCP port"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "-1"}, "LOCAL_RANK"),
])
def test_bad_variables_are_named(env, message):
    with pytest.raises(DistributedError, match=message):
        read_launch_env(env)
