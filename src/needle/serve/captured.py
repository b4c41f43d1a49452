"""Decode steps captured once per batch size and replayed (capability ``graphs``).

A batched step is some 15 launches per layer; from Python each costs tens of
microseconds, which for a 1.1B model on a GPU is far more than the kernels' time. A step in
which every sequence decodes one token has the same shape for a given number of
sequences, so it is captured (a CUDA graph, a recorded Metal command buffer) for a bucket
of sizes (1, 2, 4, ... 256; a step of 5 sequences runs the 8 bucket with 3 padding tokens
that write nowhere) and the block tables as wide as the longest sequence can be. Each
replay reads its inputs from one device buffer the host rewrites before it
(``DeviceBatch.load``) and leaves the logits and the tokens chosen in the graph's output
buffers. A bucket has two recorded steps: one ending in the argmax (every sequence
greedy), one ending in ``nd.sample`` over sampling inputs rewritten before each replay
(``choice.DeviceRows``), where the device samples; elsewhere a sampled step's logits come
to the host (``choice.choose_on_host``). A step may take its tokens from the previous
step's choices on the device (``fed``), so that the engine queues it before reading them.
As in ``models/decoder.py``, a bucket's first step runs eagerly, its second is captured; a
failed capture falls back to eager steps with a RuntimeWarning; the results are the same.
``NEEDLE_DECODE_GRAPH=0`` turns capture off.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import numpy as np

from ..backends.api import has
from ..errors import GenerationError
from . import batch as batch_step
from . import choice

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeGraphs:
    def __init__(self, model, cache, max_pages: int):
        backend = model.device.backend
        self.model, self.cache, self.max_pages = model, cache, max_pages
        self._capture = backend.capture if has(backend, "graphs") else None
        if os.environ.get("NEEDLE_DECODE_GRAPH", "1") == "0":
            self._capture = None
        self._inputs: dict[int, batch_step.DeviceBatch] = {}
        self._rows: dict[int, choice.DeviceRows] = {}  # bucket -> sampling inputs
        self.samples_on_device = choice.on_device(model.device)
        # (bucket, sampled) -> (graph, (logits, tokens chosen))
        self._recorded: dict[tuple[int, bool], tuple] = {}
        self._eager: dict[tuple[int, bool], int] = {}
        self._last: tuple | None = None  # (bucket, tokens chosen) of the last step run
        self.logits = None  # the last step's logits (bucket, vocab), on the device

    @property
    def enabled(self) -> bool:
        return self._capture is not None

    def bucket(self, n: int) -> int | None:
        return next((b for b in BUCKETS if b >= n), None)

    def run(self, batch: batch_step.StepBatch, greedy: bool,
            fed: bool = False) -> Callable[[], np.ndarray]:
        """Queue a decode-only ``batch``; returns a function that gives the token chosen
        for each sequence, on the host (read asynchronously where the device chose them:
        more steps may be queued before it is called). ``greedy``: every sequence takes
        its argmax; else ``batch.sampling`` says how each chooses. ``fed``: the batch's
        tokens are the ones the step run just before chose, for the same sequences, copied
        on the device (the host has not read them)."""
        n = len(batch.tokens)
        size = self.bucket(n)
        inputs = self._inputs.get(size)
        if inputs is None:
            inputs = self._inputs[size] = batch_step.DeviceBatch(size, self.max_pages,
                                                                 self.model.device)
        inputs.load(batch)
        if fed:
            if self._last is None or self._last[0] != size:
                raise GenerationError("a fed decode step must follow a step of its size")
            inputs.tokens[0, :n] = self._last[1][:n]
        sampled = not greedy and self.samples_on_device
        rows = None
        if sampled:
            rows = self._rows.get(size)
            if rows is None:
                rows = self._rows[size] = choice.DeviceRows(
                    size, self.model.config.vocab_size, self.model.device)
            rows.load(batch.sampling, mask=not fed)
        logits, chosen = self._step(size, inputs, rows)
        self._last, self.logits = (size, chosen), logits
        if greedy or sampled:
            return chosen[:n].numpy_later()
        logits_rows = logits.numpy()[:n]  # before a later replay rewrites them
        return lambda: choice.choose_on_host(logits_rows, batch.sampling)

    def _step(self, size: int, inputs: batch_step.DeviceBatch,
              rows: choice.DeviceRows | None):
        """Run (record, replay) the bucket's step: its argmax, or (``rows``) its draw."""
        def body():
            logits = batch_step.forward(self.model, self.cache, inputs, size)
            return logits, (logits.argmax(axis=-1) if rows is None else rows.choose(logits))

        key = (size, rows is not None)
        recorded = self._recorded.get(key)
        if recorded is None and self._capture is not None and self._eager.get(key, 0) >= 1:
            try:
                with self._capture() as graph:
                    out = body()
            except Exception as e:  # noqa: BLE001 - any failure to record: eager, same results
                warnings.warn(f"batched decode-step capture failed on "
                              f"{self.model.device.name}, stepping eagerly instead: {e}",
                              RuntimeWarning, stacklevel=3)
                self._capture = None
            else:
                recorded = self._recorded[key] = (graph, out)
        if recorded is not None:
            recorded[0].replay()
            return recorded[1]
        self._eager[key] = self._eager.get(key, 0) + 1
        return body()
