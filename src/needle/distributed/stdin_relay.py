"""The user's input, handed to rank 0 of a job that a command started for itself
(``needle chat --tp N``).

mpiexec forwards its stdin to rank 0 but not the input's end: Open MPI 5's prterun left a
chat's rank 0 waiting in ``readline`` after the last line of a pipe. So the command keeps
its stdin and copies it, line by line, into a FIFO whose path the ranks find in
``NEEDLE_TP_INPUT``; rank 0 reads the FIFO, which ends when the input does. The same path
serves the nccl launcher's ranks, which would otherwise share the terminal.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

INPUT_VAR = "NEEDLE_TP_INPUT"  # the FIFO rank 0 reads the user's input from
TTY_VAR = "NEEDLE_TP_TTY"  # "1": that input is a terminal (rank 0 shows its prompt)
THREAD_NAME = "needle-stdin-relay"


@contextmanager
def relayed_stdin() -> Iterator[None]:
    """While the block runs (the job), copy this process's stdin into a FIFO named in the
    environment the ranks inherit (start them with stdin=DEVNULL: mpiexec would otherwise
    read the same input)."""
    folder = tempfile.mkdtemp(prefix="needle-input-")
    path = os.path.join(folder, "stdin")
    os.mkfifo(path, 0o600)
    saved = {k: os.environ.get(k) for k in (INPUT_VAR, TTY_VAR)}
    os.environ[INPUT_VAR] = path
    os.environ[TTY_VAR] = "1" if sys.stdin.isatty() else "0"
    threading.Thread(target=_copy, args=(sys.stdin, path), name=THREAD_NAME,
                     daemon=True).start()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(folder, ignore_errors=True)


def _copy(source: TextIO, path: str) -> None:
    """Lines of ``source`` into the FIFO until the input ends (or rank 0 is gone). Opening
    the FIFO waits for rank 0 to open it; a rank 0 that never does leaves this daemon
    thread waiting, harmlessly, until the command exits."""
    try:
        with open(path, "w") as fifo:
            for line in iter(source.readline, ""):
                fifo.write(line)
                fifo.flush()
    except OSError:  # rank 0 closed its end (it read /exit, or failed)
        pass


def input_stream() -> tuple[TextIO, bool]:
    """(where this process reads the user's input, whether it is a terminal): the relayed
    FIFO inside a job that a command started, else stdin."""
    path = os.environ.get(INPUT_VAR)
    if path:
        return open(path), os.environ.get(TTY_VAR) == "1"  # noqa: SIM115 -- the chat's
    return sys.stdin, sys.stdin.isatty()
