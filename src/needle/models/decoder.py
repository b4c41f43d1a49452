"""The decode loop's engine: a KV cache, the prefill, and one decode step replayed per token.

On a device whose backend can record work (``backend.capture()``: a CUDA graph, a recorded
Metal command buffer), the first decode step runs eagerly (compiling kernels, warming the
memory pool), the second is captured, and every later token is: write the token and its
position into two small device buffers, replay, read the logits. The host does a few
microseconds of work per token instead of hundreds of Python-level launches. Where capture
is unavailable, or fails, every step runs eagerly; the results are the same.
"""

from __future__ import annotations

import os
import warnings

from ..errors import GenerationError
from .llama import DecodeState, KVCache


class Decoder:
    """Generation state of one model: its KV cache and (maybe) a captured decode step."""

    def __init__(self, model):
        self.model = model
        self.cache = KVCache(model.config, model.max_seq_len, model.device, model.dtype)
        self.state = DecodeState(model.config, model.max_seq_len, model.device,
                                 self.cache.dtype)
        backend = model.device.backend
        self._capture = getattr(backend, "capture", None)
        if os.environ.get("NEEDLE_DECODE_GRAPH", "1") == "0":
            self._capture = None
        self._graph = None
        self._graph_logits = None
        self._eager_steps = 0
        self.length = 0

    @property
    def captured(self) -> bool:
        """Whether decode steps replay a captured graph."""
        return self._graph is not None

    def prefill(self, ids) -> object:
        """Start a new sequence with the prompt ``ids``; the next-token logits (1, vocab)."""
        self.cache.clear()
        logits = self.model.prefill([list(ids)], self.cache)
        self.length = len(ids)
        return logits

    def rewind(self, length: int) -> None:
        """Forget every position from ``length`` on: the next step writes position
        ``length`` (a decode step reads only the positions before its own)."""
        if not 0 < length <= self.length:
            raise GenerationError(f"can rewind to 1..{self.length} positions, not {length}")
        self.length = length

    def step(self, token: int):
        """Append ``token`` at the next position; the next-token logits (1, vocab).

        With a captured step the logits live in the graph's output buffer, which the next
        step overwrites: copy them (``.numpy()``) to keep them.
        """
        if self.length >= self.cache.capacity:
            raise GenerationError(f"the sequence is full ({self.cache.capacity} positions); load "
                              "the model with a larger max_seq_len")
        self.state.set(token, self.length)
        self.length += 1
        if self._graph is None and self._capture is not None and self._eager_steps >= 1:
            self._try_capture()
        if self._graph is not None:
            self._graph.replay()
            return self._graph_logits
        self._eager_steps += 1
        return self.model.decode_step(self.state, self.cache)

    def _try_capture(self) -> None:
        try:
            with self._capture() as graph:
                logits = self.model.decode_step(self.state, self.cache)
        except Exception as e:  # any failure to record falls back to eager: same results
            warnings.warn(f"decode-step capture failed on {self.model.device.name}, decoding "
                          f"eagerly instead: {e}", RuntimeWarning, stacklevel=3)
            self._capture = None
            return
        self._graph, self._graph_logits = graph, logits
