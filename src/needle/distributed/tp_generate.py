"""``needle generate --tp N``, ``needle chat --tp N`` and ``needle serve --tp N``: the same
command, run by N tensor-parallel ranks.

Started by a user, the command starts itself again as N ranks (``needle run``'s launcher;
nccl on CUDA, mpi through mpiexec on the CPU) and returns their exit status. Inside a rank
it joins the process group and loads its share of the model; rank 0 alone reads the chat's
input, writes the text and the report, the others compute beside it (every pass
all-reduces), each user turn broadcast to them from rank 0 (``shared_line``); a server's
steps reach them through ``serve/tp_engine.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from ..errors import ArgumentError, DistributedError
from . import stdin_relay
from .collectives import broadcast_host
from .launch_env import read_launch_env
from .launcher import GRACE_S

# seconds the ranks of a stopped command have to finish: a server drains its running
# answers first (uvicorn's graceful shutdown, 60 s at most)
_GRACE = {"serve": 75.0}


def _backend_and_device(device: str) -> tuple[str, str | None]:
    from ..backend_ndarray import default_device, device_from_name

    dev = default_device() if device == "auto" else device_from_name(device)
    return ("nccl", None) if dev.kind == "cuda" else ("mpi", dev.name)


def start(args, argv: list[str], command: str) -> int | None:
    """``--tp`` of ``needle COMMAND``: an ArgumentError below 1; with 1, None (run here);
    outside a job, the exit status of COMMAND run as args.tp ranks; inside one, None once
    this process has joined the group and args.seed (if the command has one) is the same
    on every rank."""
    if args.tp < 1:
        raise ArgumentError(f"--tp must be >= 1, got {args.tp}")
    if args.tp == 1:
        return None
    status = relaunch_or_join(args, argv, command)
    if status is None and hasattr(args, "seed"):
        args.seed = shared_seed(args.seed)
    return status


def relaunch_or_join(args, argv: list[str], command: str = "generate") -> int | None:
    """Outside a job: run ``needle COMMAND argv`` as args.tp ranks, return the exit
    status. Inside one: join the group (rank != 0 writes no text) and return None."""
    env = read_launch_env()
    backend, device = _backend_and_device(args.device)
    if env.launcher == "single":
        from .launcher import launch  # looked up at the call (tests replace it)

        if backend == "nccl":
            _check_gpus(args.tp)
        python_args = ["-m", "needle.cli", command, *argv]
        if command != "chat":
            return launch(args.tp, python_args, backend, grace=_GRACE.get(command, GRACE_S))
        with stdin_relay.relayed_stdin():  # the ranks read the input through it, not stdin
            return launch(args.tp, python_args, backend, stdin=subprocess.DEVNULL)
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
    value = seed if seed is not None else int(np.random.default_rng().integers(2**31))
    return int(broadcast_host(np.array([value], np.int64))[0])


def shared_line(line: str | None) -> str | None:
    """Rank 0's ``line`` (None: the end of its input) on every rank: a chat's turn, read by
    rank 0 alone, which every rank's model must see. The other ranks' ``line`` is unused."""
    data = b"" if line is None else line.encode()
    n = int(broadcast_host(np.array([-1 if line is None else len(data)], np.int64))[0])
    if n <= 0:
        return None if n < 0 else ""
    payload = np.frombuffer(data, np.uint8) if len(data) == n else np.zeros(n, np.uint8)
    return broadcast_host(payload).tobytes().decode()
