"""``needle generate --tp N`` and ``needle chat --tp N``: the same command, run by N
tensor-parallel ranks.

Started by a user, the command starts itself again as N ranks (``needle run``'s launcher;
nccl on CUDA, mpi through mpiexec on the CPU) and returns their exit status. Inside a rank
it joins the process group and loads its share of the model; rank 0 alone reads the chat's
input, writes the text and the report, the others compute beside it (every pass
all-reduces), each user turn broadcast to them from rank 0 (``shared_line``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from ..errors import DistributedError
from . import stdin_relay
from .launch_env import read_launch_env


def _backend_and_device(device: str) -> tuple[str, str | None]:
    from ..backend_ndarray import default_device, device_from_name

    dev = default_device() if device == "auto" else device_from_name(device)
    return ("nccl", None) if dev.kind == "cuda" else ("mpi", dev.name)


def relaunch_or_join(args, argv: list[str], command: str = "generate") -> int | None:
    """Outside a job: run ``needle COMMAND argv`` as args.tp ranks, return the exit
    status. Inside one: join the group (rank != 0 writes no text) and return None."""
    env = read_launch_env()
    backend, device = _backend_and_device(args.device)
    if env.launcher == "single":
        from .launcher import launch

        if backend == "nccl":
            _check_gpus(args.tp)

        if command != "chat":
            return launch(args.tp, ["-m", "needle.cli", command, *argv], backend)
        with stdin_relay.relayed_stdin():  # the ranks read the input through it, not stdin
            return launch(args.tp, ["-m", "needle.cli", command, *argv], backend,
                          stdin=subprocess.DEVNULL)
    if env.world_size != args.tp:
        raise DistributedError(f"--tp {args.tp} in a job of {env.world_size} processes; "
                               "give --tp the job's size (or run needle generate alone: it "
                               "starts the ranks itself)")
    from . import init_process_group

    init_process_group(backend, device=device)
    if env.rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- lives as long as the rank
    return None


def _gpu_count() -> int:
    """CUDA devices the driver reports (no context made: this process only launches)."""
    from ..backends.cuda import device_count

    return device_count()


def _check_gpus(tp: int) -> None:
    """One GPU a rank: say so before starting ranks that would fail one by one."""
    count = _gpu_count()
    if tp > count:
        fix = f"give --tp at most {count}" if count else "no CUDA device is usable here"
        raise DistributedError(f"--tp {tp} runs one rank a GPU, but this machine has {count} "
                               f"GPU{'s' if count != 1 else ''}; {fix} (or --device cpu for "
                               "CPU ranks)")


def shared_seed(seed: int | None) -> int:
    """The sampler's seed, the same on every rank (rank 0 draws one when none is given):
    ranks that sampled different tokens would feed their decoders different inputs."""
    from .. import backend_ndarray as nd
    from .collectives import broadcast
    from .group import group

    value = seed if seed is not None else int(np.random.default_rng().integers(2**31))
    box = nd.array(np.array([value], np.int64), device=group().device)
    return int(broadcast(box, src=0).numpy()[0])


def shared_line(line: str | None) -> str | None:
    """Rank 0's ``line`` (None: the end of its input) on every rank: a chat's turn, read by
    rank 0 alone, which every rank's model must see."""
    from .. import backend_ndarray as nd
    from .collectives import broadcast
    from .group import group

    device = group().device
    data = b"" if line is None else line.encode()
    size = broadcast(nd.array(np.array([len(data) if line is not None else -1], np.int64),
                              device=device), src=0)
    n = int(size.numpy()[0])
    if n < 0:
        return None
    box = nd.array(np.frombuffer(data.ljust(n, b"\0")[:n], np.uint8).copy(), device=device)
    return bytes(broadcast(box, src=0).numpy().astype(np.uint8)).decode() if n else ""
