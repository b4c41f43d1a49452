"""A command that starts its own ranks (``needle chat --tp N``) hands them its input
through a FIFO: rank 0 reads every line and then the input's end (mpiexec forwarded the
lines but never the end)."""

from __future__ import annotations

import io
import os
import sys
import threading
import time

from needle.distributed import stdin_relay


def test_the_ranks_read_every_line_then_the_end(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("first turn\n\nsecond\n"))
    monkeypatch.delenv(stdin_relay.INPUT_VAR, raising=False)
    with stdin_relay.relayed_stdin():
        path = os.environ[stdin_relay.INPUT_VAR]
        source, interactive = stdin_relay.input_stream()  # as rank 0 opens it
        with source:
            assert source.readlines() == ["first turn\n", "\n", "second\n"]
        assert interactive is False  # a StringIO is no terminal
    assert stdin_relay.INPUT_VAR not in os.environ and not os.path.exists(path)


def test_a_reader_that_stops_early_ends_the_copy(monkeypatch):
    """Rank 0 closes the FIFO after /exit: the copying thread ends on the broken pipe,
    quietly (no exception escapes it)."""
    escaped = []
    monkeypatch.setattr(threading, "excepthook", escaped.append)
    monkeypatch.setattr(sys, "stdin", io.StringIO("/exit\n" + "more\n" * 100_000))
    with stdin_relay.relayed_stdin():
        source, _ = stdin_relay.input_stream()
        assert source.readline() == "/exit\n"
        source.close()
    deadline = time.monotonic() + 10
    while any(t.name == stdin_relay.THREAD_NAME for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the copy did not stop"
        time.sleep(0.01)
    assert escaped == []


def test_outside_a_relayed_job_the_input_is_stdin(monkeypatch):
    monkeypatch.delenv(stdin_relay.INPUT_VAR, raising=False)
    monkeypatch.setattr(sys, "stdin", io.StringIO("x\n"))
    assert stdin_relay.input_stream() == (sys.stdin, False)
