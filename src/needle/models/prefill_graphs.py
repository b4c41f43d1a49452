"""Captured prefills: one recorded graph per prompt-length bucket, replayed for every prompt
that rounds up to it.

Issuing a prefill from Python costs about as much host time whatever the prompt's length
(the 1.1B model's 22 layers are ~245 launches, ~11 ms of Python on an H100 host), so a short
prompt waits on the host, not the GPU, and a 2,048-token one is bound by both. On a backend
that records work (capability ``graphs``) the decoder pads the prompt to a bucket (lengths
rounded up to sixteenths of a power of two, at least 64 tokens) and runs the bucket's
recorded prefill instead: the host writes the ids and the last real position into two device
buffers and replays one graph.

Padding is exact: a padded position comes after every real one, so causal attention never
lets a real position see it, and every other step works on each position alone; the logits
are those of the last real position, gathered on the device. The pad positions' keys and
values land in cache rows past the prompt, which no step reads: only models whose layers
all take the fused attention capture prefills (a composed layer uploads its mask from the
host and needs the cache zero past the length, ``KVCache``).

As with the decode step, a bucket's first prefill runs eagerly (it compiles and warms every
kernel of that shape), its second is captured, and later ones replay. At most ``limit``
buckets keep a graph (``NEEDLE_PREFILL_GRAPHS``, default 4; 0 turns capture of prefills off),
the least recently used giving its graph and memory back first. Prompts longer than
``MAX_TOKENS`` run eagerly: there the GPU's time dwarfs the host's.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict

import numpy as np

from .. import backend_ndarray as nd
from ..backend_ndarray import NDArray
from ..errors import ArgumentError

MIN_BUCKET = 64
MAX_TOKENS = 4096  # longer prompts are GPU-bound: a graph would save nothing worth its memory
DEFAULT_LIMIT = 4


def _limit_from_env() -> int:
    value = os.environ.get("NEEDLE_PREFILL_GRAPHS", str(DEFAULT_LIMIT))
    if not value.strip().isdigit():
        raise ArgumentError(f"NEEDLE_PREFILL_GRAPHS must be a whole number of graphs to keep "
                            f"(0 turns captured prefills off), got {value!r}")
    return int(value)


def bucket_of(n: int, capacity: int) -> int:
    """The padded length a prompt of ``n`` tokens runs at: n rounded up to a multiple of a
    sixteenth of the power of two at or above it (so the padding is under an eighth of n),
    and of ``MIN_BUCKET``; at most the cache's ``capacity``."""
    step = max(MIN_BUCKET, 1 << max(0, (n - 1).bit_length() - 4))
    return min(-(-n // step) * step, capacity)


class _Bucket:
    """One bucket's device inputs (ids, last real position) and, once captured, its graph
    and the logits buffer the graph writes."""

    def __init__(self, rows: int, device):
        self.ids = nd.zeros((1, rows), "int32", device)
        self.last = nd.zeros((1,), "int32", device)
        self.graph = None
        self.logits: NDArray | None = None
        self.runs = 0

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()
        self.graph = self.logits = None


class PrefillGraphs:
    """The captured prefills of one decoder (its model and KV cache)."""

    def __init__(self, model, cache, capture, limit: int | None = None):
        self.model, self.cache = model, cache
        self._capture = capture
        self.limit = _limit_from_env() if limit is None else limit
        self._buckets: OrderedDict[int, _Bucket] = OrderedDict()  # least recently used first

    def applies(self, n: int) -> bool:
        """Whether a prompt of ``n`` tokens runs here (else the caller prefills eagerly)."""
        return self._capture is not None and self.limit > 0 and n <= MAX_TOKENS

    def rows(self, n: int) -> int:
        """Cache rows a prefill of ``n`` tokens writes: its bucket, or n when it runs as is."""
        return bucket_of(n, self.cache.capacity) if self.applies(n) else n

    @property
    def captured(self) -> list[int]:
        """The buckets that hold a graph, least recently used first."""
        return [rows for rows, b in self._buckets.items() if b.graph is not None]

    def run(self, host_ids: np.ndarray) -> NDArray:
        """Logits (1, vocab) of the last of ``host_ids`` (n,), checked int32 ids, prefilled
        at the bucket ``rows(n)`` into the cache. A fresh array (the graph's own output
        buffer is overwritten by the bucket's next replay)."""
        n = len(host_ids)
        rows = self.rows(n)
        bucket = self._buckets.pop(rows, None) or _Bucket(rows, self.model.device)
        self._buckets[rows] = bucket  # now the most recently used
        padded = np.zeros((1, rows), np.int32)
        padded[0, :n] = host_ids
        backend = self.model.device.backend  # two uploads into the graph's input buffers
        backend.from_numpy(padded, bucket.ids.handle)
        backend.from_numpy(np.array([n - 1], np.int32), bucket.last.handle)
        if bucket.graph is not None and bucket.graph.closed:  # closed by another part
            bucket.graph = bucket.logits = None  # (a process group left): record it again
        if bucket.graph is None and bucket.runs >= 1 and self._capture is not None:
            self._record(bucket)
            self._evict()
        bucket.runs += 1
        if bucket.graph is None:
            return self._body(bucket)
        bucket.graph.replay()
        return bucket.logits.copy()

    def _body(self, bucket: _Bucket) -> NDArray:
        return self.model.transformer.forward(bucket.ids, self.cache, last_only=True,
                                              last_row=bucket.last)

    def _record(self, bucket: _Bucket) -> None:
        try:
            with self._capture() as graph:
                logits = self._body(bucket)
        except Exception as e:  # a failure to record falls back to eager: same results
            warnings.warn(f"prefill capture failed on {self.model.device.name}, prefilling "
                          f"eagerly instead: {e}", RuntimeWarning, stacklevel=4)
            self._capture = None
            return
        bucket.graph, bucket.logits = graph, logits

    def _evict(self) -> None:
        """Close the least recently used graphs beyond ``limit``."""
        captured = self.captured  # least recently used first
        for rows in captured[:max(0, len(captured) - self.limit)]:
            self._buckets.pop(rows).close()

    def close(self) -> None:
        for bucket in self._buckets.values():
            bucket.close()
        self._buckets.clear()
