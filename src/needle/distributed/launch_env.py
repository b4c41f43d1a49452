"""Where this process sits in a job, read from the variables launchers already set.

torchrun, Slurm wrappers and ``needle run`` set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``; Open MPI's ``mpiexec`` sets ``OMPI_COMM_WORLD_RANK``,
``OMPI_COMM_WORLD_SIZE`` and ``OMPI_COMM_WORLD_LOCAL_RANK``. A process started alone is rank
0 of a world of 1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import DistributedError

DEFAULT_ADDR = "127.0.0.1"
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "env" (RANK/WORLD_SIZE), "mpi" (mpiexec) or "single"


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise DistributedError(f"{name} is not set; launch with `needle run -n N`, torchrun "
                                   "or mpiexec, or set it yourself")
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r} is not an integer") from None


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """This process's rank, world size, local rank and the rendezvous address, checked."""
    env = os.environ if env is None else env
    if "RANK" in env or "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK", rank)
        launcher = "env"
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", rank)
        launcher = "mpi"
    else:
        rank, world, local, launcher = 0, 1, 0, "single"
    if world < 1:
        raise DistributedError(f"WORLD_SIZE must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise DistributedError(f"RANK {rank} is outside 0..{world - 1} (WORLD_SIZE {world})")
    if local < 0:
        raise DistributedError(f"LOCAL_RANK must be >= 0, got {local}")
    port = _int(env, "MASTER_PORT", DEFAULT_PORT)
    if not 0 < port < 65536:
        raise DistributedError(f"MASTER_PORT {port} is not a TCP port (1..65535)")
    return LaunchEnv(rank, world, local, env.get("MASTER_ADDR", DEFAULT_ADDR), port, launcher)
