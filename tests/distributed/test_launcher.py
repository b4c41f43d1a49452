"""``needle run``: ranks get their variables; a failed or hung rank ends the job quickly
with a message naming it."""

from __future__ import annotations

import time

import pytest

from needle.cli import main as needle_main
from needle.errors import DistributedError

from .jobs import SCRIPTS, run_job


def test_ranks_get_their_variables_and_a_failure_stops_the_rest():
    """The launcher's own processes (the nccl path's launcher; the script needs no GPU)."""
    start = time.monotonic()
    job = run_job("fail_rank.py", n=3, backend="nccl")
    assert time.monotonic() - start < 30  # the others were stopped, not waited for
    assert job.returncode == 3
    for rank in range(3):
        assert f"rank {rank} of 3 local {rank}" in job.stdout
    assert "needle run: rank 1 exited with status 3; stopping the other ranks" in job.stderr


def test_mpi_rank_failure_is_named():
    start = time.monotonic()
    job = run_job("fail_rank.py")
    assert time.monotonic() - start < 30
    assert job.returncode != 0
    assert "rank 0 of 2 local 0" in job.stdout and "rank 1 of 2 local 1" in job.stdout
    assert "needle run: rank 1 exited with status 3" in job.stderr
    # and the launcher's own line: where mpiexec fails before any rank runs, the only one
    assert f"needle run: mpiexec exited with status {job.returncode}" in job.stderr


def test_a_hung_rank_times_out_the_others():
    start = time.monotonic()
    job = run_job("fail_rank.py", "hang", options=("--timeout", "2"))
    assert time.monotonic() - start < 40
    assert job.returncode != 0
    assert "all_reduce timed out after 2 s" in job.stderr
    assert "needle run: rank 0 exited with status 1" in job.stderr


def test_bad_invocations(capsys):
    assert needle_main(["run", "-n", "2", str(SCRIPTS / "missing.py")]) == 1
    assert "is not a file" in capsys.readouterr().err
    assert needle_main(["run", "-n", "0", str(SCRIPTS / "fail_rank.py")]) == 1
    assert "must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        needle_main(["run", "--backend", "gloo", "-n", "2", "x.py"])


def test_launch_errors_are_distributed_errors():
    from needle.distributed.launcher import launch

    with pytest.raises(DistributedError):
        launch(0, ["x.py"])


@pytest.mark.parametrize("backend", ["nccl", "mpi"])
def test_sigterm_to_the_launcher_stops_every_rank(tmp_path, backend):
    """A service manager stops ``needle run`` (``needle serve --tp``) with SIGTERM to the
    launcher alone: the ranks are stopped too (SIGTERM), not left running without it."""
    import signal
    import subprocess
    import sys

    command = [sys.executable, "-m", "needle.cli", "run", "-n", "2", "--backend", backend,
               str(SCRIPTS / "sleep_rank.py"), str(tmp_path)]
    launcher = subprocess.Popen(command, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"started{r}").exists() for r in range(2)):
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
        assert all((tmp_path / f"stopped{r}").exists() for r in range(2))
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
