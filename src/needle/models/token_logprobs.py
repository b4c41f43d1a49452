"""Reading log-probabilities of given tokens off rows of logits on the device: the shared
step of scoring a prompt (``serve/scoring.py``) and of perplexity (``perplexity.py``).

Rows go through the float32 log-softmax a slice at a time, each slice at most
``SLICE_VALUES`` values whatever the vocabulary (a 2,048-row window of a 128k-token
vocabulary would be 1 GiB of float32), and only each row's own token's value comes back.
"""

from __future__ import annotations

import numpy as np

from .. import backend_ndarray as nd
from ..backend_ndarray import NDArray

SLICE_VALUES = 1 << 24  # logits in one slice of rows (64 MiB of float32)


def rows_per_slice(vocab: int) -> int:
    return max(1, SLICE_VALUES // max(vocab, 1))


def log_softmax(logits: NDArray) -> NDArray:
    """The float32 log-softmax of rows of logits (m, vocab), on their device."""
    return logits.astype("float32").log_softmax()


def values_at(scores: NDArray, tokens) -> np.ndarray:
    """scores[i, tokens[i]] of a (m, vocab) device array, gathered there, on the host."""
    m, vocab = scores.shape
    where = np.arange(m, dtype=np.int64) * vocab + np.asarray(tokens, np.int64)
    flat = scores.reshape((m * vocab, 1))
    return flat.take(nd.array(where, device=scores.device)).numpy().reshape(-1)
