"""``needle serve`` (with or without --tp) as a user starts it: a process in a session of
its own on a free port, driven by the official ``openai`` client; ``stop`` is a Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import openai

from .test_server import _free_port

NAME = "tiny"
MESSAGES = [{"role": "user", "content": "Hello there"}]


def stream_interrupted(url: str, body: dict, interrupt) -> list[str]:
    """The data events of a streamed ``body`` posted to url/v1/completions, ``interrupt()``
    called once the first has arrived (a Ctrl-C mid-answer)."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                break
        interrupt()
        events += [line[6:] for line in lines if line.startswith("data: ")]
    return events


class ServeJob:
    def __init__(self, model_dir, *options: str, device: str = "cpu", env: dict | None = None,
                 start_timeout: float = 120):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "needle.cli", "serve", str(model_dir), "--port",
                   str(self.port), "--device", device, "--model-name", NAME, *options]
        self.log = tempfile.TemporaryFile("w+")  # a pipe nobody reads could fill and block
        self.proc = subprocess.Popen(command, start_new_session=True, stderr=self.log,
                                     stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "NCCL_NVLS_ENABLE": "0", **(env or {})})
        deadline = time.time() + start_timeout
        while not self._healthy():
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited ({self.proc.returncode}): "
                                     f"{self.stderr()[-3000:]}")
            if time.time() > deadline:
                self.kill()
                raise AssertionError("the server did not start")
            time.sleep(0.1)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                                    timeout=120)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self, timeout: float = 90) -> tuple[int, str]:
        """Ctrl-C (SIGINT to the command's process group, as a terminal sends it); the exit
        status and stderr."""
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return self.proc.returncode, self.stderr()

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    # --- what the tests ask -------------------------------------------------------------
    def chat(self, **options) -> str:
        r = self.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12,
                                                **options)
        return r.choices[0].message.content

    def complete(self, prompt: str, **options) -> str:
        r = self.client.completions.create(model=NAME, prompt=prompt, max_tokens=10,
                                           **options)
        return r.choices[0].text

    def streamed(self, prompt: str, **options) -> str:
        chunks = self.client.completions.create(model=NAME, prompt=prompt, max_tokens=10,
                                                stream=True, **options)
        return "".join(c.choices[0].text for c in chunks)

    def scores(self, prompt: str) -> list[float | None]:
        """Each prompt token's log-probability (echo with logprobs, nothing generated)."""
        r = self.client.completions.create(model=NAME, prompt=prompt, echo=True, max_tokens=0,
                                           logprobs=2)
        return r.choices[0].logprobs.token_logprobs
