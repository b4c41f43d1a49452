"""The decode loop's engine: a KV cache, the prefill, and one decode step replayed per token.

On a device whose backend can record work (capability ``graphs``: a CUDA graph, a recorded
Metal command buffer), the first decode step runs eagerly (compiling kernels, warming the
memory pool), the second is captured, and every later token is: write the token and its
position into two small device buffers, replay, read the logits. The host does a few
microseconds of work per token instead of hundreds of Python-level launches. Where capture
is unavailable, or fails, every step runs eagerly; the results are the same. Prefills are
captured too, one graph per prompt-length bucket (``prefill_graphs.py``).

A recorded step cannot read its position on the host, so its attention kernel is chosen
once, when it is recorded. Where the backend's choice depends on how many positions are
read (``nd.attention_decode_bands``: on CUDA a short cache's ranges merge within a
thread-block cluster), the positions are cut into bands and each band records its own step,
told the band's bound; the numbers are the same in every band.
"""

from __future__ import annotations

import bisect
import os
import warnings
from collections import deque
from collections.abc import Iterator

import numpy as np

from .. import backend_ndarray as nd
from ..backends.api import has
from ..errors import GenerationError
from .cache import DecodeState, KVCache
from .prefill_graphs import PrefillGraphs


class Decoder:
    """Generation state of one model: its KV cache and (maybe) a captured decode step."""

    def __init__(self, model):
        self.model = model
        self.cache = KVCache(model.config, model.max_seq_len, model.device, model.dtype)
        self.state = DecodeState(model.device)
        backend = model.device.backend
        self._capture = backend.capture if has(backend, "graphs") else None
        if os.environ.get("NEEDLE_DECODE_GRAPH", "1") == "0":
            self._capture = None
        self.prefills = PrefillGraphs(model, self.cache, self._capture)
        # bounds on the positions a step reads, ascending, the last the capacity
        self.bands = model.transformer.decode_bands(self.cache)
        # (kind of step, band) -> (graph, its logits); -> steps run eagerly so far
        self._recorded: dict[tuple[str, int], tuple] = {}
        self._eager: dict[tuple[str, int], int] = {}
        self._on_device = None  # (token, position) the state buffers already hold
        self._sampling = None  # (params, seeds, seen) device buffers of the sampled step
        self.last_logits = None
        self.length = 0  # a step reads no cache row past its own: stale rows are harmless

    @property
    def length(self) -> int:
        """Positions of the current sequence (the next step writes this one)."""
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        self._length = value

    @property
    def captured(self) -> bool:
        """Whether decode steps replay a captured graph (in some band)."""
        return any(kind == "step" for kind, _ in self._recorded)

    @property
    def _greedy(self):
        """(graph, logits) of a captured greedy step, or None."""
        return next((r for (kind, _), r in self._recorded.items() if kind == "greedy"), None)

    def prefill(self, ids) -> object:
        """Start a new sequence with the prompt ``ids``; the next-token logits (1, vocab).

        Where the backend records work, the prompt is padded to its length's bucket and
        that bucket's recorded prefill replays (``prefill_graphs.py``); the logits are the
        same."""
        host = self.model.host_ids([list(ids)])[0]  # checked before anything is written
        n = len(host)
        if self.prefills.applies(n):
            logits = self.prefills.run(host)
        else:
            logits = self.model.prefill(host[None], self.cache)
        self.length = n
        self._on_device = None
        return logits

    def rewind(self, length: int) -> None:
        """Forget every position from ``length`` on: the next step writes position
        ``length`` (a decode step reads only the positions before its own)."""
        if not 0 < length <= self.length:
            raise GenerationError(f"can rewind to 1..{self.length} positions, not {length}")
        self.length = length
        self._on_device = None

    def step(self, token: int):
        """Append ``token`` at the next position; the next-token logits (1, vocab).

        With a captured step the logits live in the graph's output buffer, which the next
        step overwrites: copy them (``.numpy()``) to keep them.
        """
        self._check_room()
        self.state.set(token, self.length)
        self._on_device = None
        self.length += 1
        return self._run("step", lambda: self.model.decode_step(self.state, self.cache))

    def greedy_step(self, token: int) -> int:
        """Append ``token`` at the next position and return the greedy next token.

        The same result as ``Sampler()(step(token))``, with the choice made on the device:
        the captured greedy step also takes the argmax, stores it as the next step's token and
        advances the position, so the host only replays and reads back one integer (and sets
        nothing when ``token`` is the one the device just chose). The step's logits are kept
        in ``last_logits`` (overwritten by the next step).
        """
        self._queue("greedy", token)
        chosen = int(self.state.token.numpy().reshape(-1)[0])
        self._on_device = (chosen, self.length)
        return chosen

    def _queue(self, kind: str, token: int | None) -> None:
        """Queue one step of ``kind`` ("greedy" or "sampled") at the next position: for
        ``token``, or (None) for the token the previous step left on the device."""
        self._check_room()
        if token is not None and self._on_device != (token, self.length):
            self.state.set(token, self.length)
        self.length += 1
        body = self._greedy_body if kind == "greedy" else self._sampled_body
        self.last_logits = self._run(kind, body)

    # --- sampling on the device (capability "sampling") ----------------------------------
    def start_sampling(self, sampler, prompt: list[int]) -> None:
        """Load a sequence's sampling settings, seed and seen tokens (the prompt) into the
        device buffers the sampled step reads (the same buffers every time, so a captured
        step stays valid)."""
        vocab = self.model.config.vocab_size
        if self._sampling is None:
            dev = self.model.device
            self._sampling = (nd.empty((1, 5), "float32", dev), nd.empty((1,), "int32", dev),
                              nd.empty((1, vocab), "bool", dev))
        params, seeds, seen = self._sampling
        params[...] = nd.array(sampler.params.row()[None], device=params.device)
        seeds[...] = sampler.seed
        seen[...] = nd.array(sampler.seen_mask(vocab)[None], device=seen.device, dtype="bool")

    def sample_first(self, logits) -> int:
        """The token after the prompt, drawn on the device from the prefill's ``logits``
        (it becomes the next step's input there)."""
        params, seeds, seen = self._sampling
        position = nd.array(np.array([self.length], np.int32), device=self.model.device)
        token = self.state.token.reshape((1,))
        nd.sample(logits, params, seeds, position, seen, out=token)
        self.state.position[...] = position
        chosen = int(self.state.token.numpy().reshape(-1)[0])
        self._on_device = (chosen, self.length)
        return chosen

    def _sampled_body(self):
        """The decode step, then a draw into the token buffer and position + 1."""
        state = self.state
        logits = self.model.decode_step(state, self.cache)
        params, seeds, seen = self._sampling
        following = state.position + 1
        nd.sample(logits, params, seeds, following, seen, out=state.token.reshape((1,)))
        state.position[...] = following
        return logits

    def greedy_stream(self, token: int, count: int) -> Iterator[int]:
        """Up to ``count`` greedy tokens after ``token``: what ``count`` calls of
        ``greedy_step`` would return; see ``stream``."""
        return self.stream("greedy", token, count)

    def stream(self, kind: str, token: int, count: int) -> Iterator[int]:
        """Up to ``count`` tokens after ``token``, each chosen on the device ("greedy": the
        argmax; "sampled": a draw, after ``start_sampling``), with the device one step
        ahead of the host.

        Each step is queued before the previous step's token is read (an asynchronous read
        where the backend has one), so the device does not sit idle while the host reads a
        token, checks it and queues the next replay. When the caller stops early (a stop
        token; close the iterator, or let it go), the step queued ahead is undone: the
        decoder is left as if one step had been taken per token received (a sampled step
        undone leaves its token marked seen).
        ``last_logits`` is that of the newest step queued (None after an undo).
        """
        if count <= 0:
            return
        ahead: deque = deque()  # pending reads of the tokens of queued steps, oldest first

        def queue_step(first: int | None = None) -> None:
            self._queue(kind, first)
            ahead.append(self.state.token.numpy_later())

        try:
            queue_step(token)
            for i in range(count):
                if i + 1 < count and self.length < self.cache.capacity:
                    queue_step()  # the next step reads its token from the device
                chosen = int(ahead.popleft()().reshape(-1)[0])
                self._on_device = (chosen, self.length) if not ahead else None
                yield chosen
                if i + 1 < count and not ahead:
                    queue_step(chosen)  # no room was left to queue ahead: raises
        finally:
            if ahead:  # steps queued beyond the tokens taken: undo them
                for read in ahead:
                    read()
                self.length -= len(ahead)
                self._on_device = None
                self.last_logits = None

    def _greedy_body(self):
        """The decode step, then the argmax into the token buffer and position + 1."""
        state = self.state
        logits = self.model.decode_step(state, self.cache)
        state.token[...] = logits.argmax(axis=-1).reshape((1, 1))
        state.position[...] = state.position + 1
        return logits

    def _check_room(self) -> None:
        if self.length >= self.cache.capacity:
            raise GenerationError(f"the sequence is full ({self.cache.capacity} positions); load "
                                  "the model with a larger max_seq_len")

    def _band(self) -> int:
        """The band of the step at ``length - 1`` (it reads ``length`` positions)."""
        return bisect.bisect_left(self.bands, self.length)  # the first bound >= length

    def _run(self, kind: str, body):
        """``body()`` for a step of this kind in the current position's band: eagerly the
        first time (compiling its kernels, sizing its buffers), captured the second (where
        the backend can), replayed from then on."""
        key = (kind, self._band())
        self.state.max_positions = self.bands[key[1]]
        recorded = self._recorded.get(key)
        if recorded is not None and recorded[0].closed:
            # closed by another part (leaving a process group closes the graphs of its
            # collectives): record the step again
            del self._recorded[key]
            recorded = None
        if recorded is None and self._capture is not None and self._eager.get(key, 0) >= 1:
            try:
                with self._capture() as graph:
                    out = body()
            except Exception as e:  # any failure to record falls back to eager: same results
                warnings.warn(f"decode-step capture failed on {self.model.device.name}, "
                              f"decoding eagerly instead: {e}", RuntimeWarning, stacklevel=4)
                self._capture = None
            else:
                recorded = self._recorded[key] = (graph, out)
        if recorded is not None:
            recorded[0].replay()
            return recorded[1]
        self._eager[key] = self._eager.get(key, 0) + 1
        return body()
