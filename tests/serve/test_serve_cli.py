"""``needle serve`` as a process: it starts, answers, and on Ctrl-C (SIGINT) or a service
manager's SIGTERM lets the running answer finish before it exits with status 0; bad
options exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from .serve_job import stream_interrupted
from .test_server import _free_port  # noqa: E402


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_drains_the_running_answer_then_exits(model_dir, stop):
    port = _free_port()
    env = {**os.environ, "NEEDLE_CPU_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "needle.cli", "serve", str(model_dir),
                             "--port", str(port), "--device", "cpu", "--max-seqs", "2",
                             "--model-name", "tiny", "--max-batch-tokens", "64",
                             "--no-prefix-cache"], env=env, stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.1)
        body = {"model": "tiny", "prompt": "The quick brown", "max_tokens": 120,
                "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        # Ctrl-C (or a SIGTERM) mid-answer
        events = stream_interrupted(url, body, lambda: proc.send_signal(stop))
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 120  # the answer was finished, not cut
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "needle serve: tiny on cpu" in err and "stopped (running answers" in err
        assert "prefix cache off; up to 2 sequences, 64 tokens a step" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_options_exit_2(model_dir, capsys):
    from needle.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", str(model_dir), "--kv-memory", "lots"])
    assert e.value.code == 2 and "is not a size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", str(model_dir), "--port", "70000"])
    assert "is not a port" in capsys.readouterr().err


def test_a_step_too_small_for_the_sequences_exits_1(model_dir, capsys):
    from needle.cli import main

    assert main(["serve", str(model_dir), "--device", "cpu", "--max-seqs", "8",
                 "--max-batch-tokens", "8"]) == 1
    assert "max_batch_tokens (8) must exceed max_seqs (8)" in capsys.readouterr().err
