"""``needle serve --tp N``: one serving engine over N tensor-parallel ranks.

Every rank holds its share of the model (``load_tensor_parallel``) and an ``Engine`` of its
own (its share of the heads' KV pages, its recorded decode steps). Rank 0 runs the HTTP
server and the scheduler: before each step it sends the step (the ``StepBatch`` with its
rows' sampling, recorded or eager, greedy or not; ``step_message.py``) to the other ranks,
which run the same ``Engine.execute`` beside it, since every step all-reduces. The step
crosses as two broadcasts on the group (NCCL on GPUs). When rank 0 runs out of work it tells
the others to wait on the host (``Doorbell``) instead of in a collective, which would
time out on a quiet server; its next step rings them back.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..distributed.collectives import broadcast_host
from ..distributed.doorbell import Doorbell
from . import step_message as msg
from .batch import StepBatch
from .engine import Engine

BELL = "needle-serve/bell"
RUN, STOP = b"run", b"stop"


# A rank waiting for the next step's message waits through its current step first: a
# sleeping poll (up to 1 ms late) is on every step's critical path, since rank 0's step
# waits for this rank in its first all-reduce. Two H200s, Llama-3-8B shapes, TP=2: 1 / 8 /
# 64 streams 212-222 / 1,359-1,421 / 7,658-8,087 tok/s sleeping after 2 ms, 251-259 /
# 1,614-1,643 / 8,303-8,386 spinning 20 ms (.hx/s35/tp_serve_probe.py).
STEP_SPIN_S = 0.05


def _receive(n: int) -> np.ndarray:
    return broadcast_host(np.zeros(n, np.int64), spin=STEP_SPIN_S)


class StepLink:
    """Rank 0's side (``send``, ``pause``, ``stop``) and the other ranks' (``receive``) of
    the steps' channel; the others start waiting on the host."""

    def __init__(self):
        self.bell = Doorbell(BELL)
        self.awake = False  # the other ranks are waiting in a broadcast, not on the bell
        self.stopped = False

    def send(self, batch: StepBatch, captured: bool, greedy: bool, fed: bool) -> None:
        if not self.awake:
            self.bell.ring(RUN)
            self.awake = True
        head, payload = msg.pack(batch, captured, greedy, fed)
        broadcast_host(head)
        broadcast_host(payload)

    def pause(self) -> None:
        """No work for now: the others go back to the bell."""
        if self.awake and not self.stopped:
            broadcast_host(msg.header(msg.IDLE))
            self.awake = False
            self.bell.taken()  # the others ran the steps since the last ring

    def stop(self) -> None:
        """The others leave ``receive`` (with None); idempotent."""
        if self.stopped:
            return
        if self.awake:
            broadcast_host(msg.header(msg.STOP))
        else:
            self.bell.ring(STOP)
        self.stopped = True

    def receive(self) -> tuple[StepBatch, bool, bool, bool] | None:
        """The next step rank 0 runs, or None when it stops."""
        while True:
            if not self.awake:
                if self.bell.wait() == STOP:
                    return None
                self.awake = True
            head = _receive(msg.HEADER)
            kind = int(head[0])
            if kind == msg.STOP:
                return None
            if kind == msg.IDLE:
                self.awake = False
                continue
            return msg.unpack(head, _receive(msg.payload_size(head)))


class TensorParallelEngine(Engine):
    """Rank 0's engine: an ``Engine`` whose steps are sent to the other ranks first; its
    ``shutdown`` lets them go (they return from ``follow``)."""

    def __init__(self, model, **options):
        super().__init__(model, **options)
        self.link = StepLink()

    def execute(self, batch: StepBatch, captured: bool, greedy: bool,
                fed: bool = False) -> Callable[[], np.ndarray]:
        self.link.send(batch, captured, greedy, fed)
        return super().execute(batch, captured, greedy, fed)

    def _pause(self) -> None:
        self.link.pause()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        super().shutdown(drain, timeout)
        self.link.stop()


def follow(engine: Engine) -> None:
    """The other ranks: run each step rank 0 sends, until it stops."""
    link = StepLink()
    while (step := link.receive()) is not None:
        engine.execute(*step)  # its result is rank 0's to read
