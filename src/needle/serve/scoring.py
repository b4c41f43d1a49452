"""Prompt logprobs: each prompt token's log-probability under the tokens before it, and the
likeliest tokens there (``RequestParams.prompt_logprobs``; OpenAI's ``echo`` with
``logprobs``, which lm-evaluation-harness's loglikelihood tasks send).

A prompt chunk's step already computes every position's final hidden state; the choosing
rows alone go through the LM head. A scored chunk's other positions go through it too, in
slices small enough that a slice's logits stay near ``SLICE_VALUES`` values whatever the
vocabulary (a 2,048-token chunk of a 128k-token vocabulary would be 1 GiB of float32). Each
slice's float32 log-softmax stays on the device; the host reads back only the values asked
for: each row's token, and its top tokens (on the device where one is asked for).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import backend_ndarray as nd
from ..backend_ndarray import NDArray
from .request import TokenLogprob

SLICE_VALUES = 1 << 24  # logits in one slice of scored rows (64 MiB of float32)


@dataclass
class ScoredRow:
    """A scored row of a step: the request, the prompt position whose token it scores
    (its logits are those of the position before), and that token."""

    request: object
    position: int
    token: int


def slice_rows(vocab: int) -> int:
    return max(1, SLICE_VALUES // max(vocab, 1))


def log_softmax_slices(model, hidden: NDArray, rows: np.ndarray) -> list[NDArray]:
    """The float32 log-softmax (m, vocab) of the logits of ``hidden``'s ``rows``, slice by
    slice, on the device. Every tensor-parallel rank runs this (the head gathers across
    them); only rank 0 reads the result."""
    tr, dev = model.transformer, hidden.device
    step = slice_rows(model.config.vocab_size)
    out = []
    for at in range(0, len(rows), step):
        idx = nd.array(np.asarray(rows[at:at + step], np.int32), device=dev)
        logits = tr._logits(hidden.take(idx)).astype("float32")
        out.append(logits.log_softmax())
    return out


def read(slices: list[NDArray], scored: list[ScoredRow], top: list[int]) -> list[TokenLogprob]:
    """Each scored row's TokenLogprob (its token's log-probability, and its ``top[i]``
    likeliest tokens') from ``log_softmax_slices``'s result."""
    out: list[TokenLogprob] = []
    at = 0
    for scores in slices:
        m, vocab = scores.shape
        rows = scored[at:at + m]
        ks = top[at:at + m]
        flat = scores.reshape((m * vocab, 1))
        where = np.arange(m, dtype=np.int64) * vocab + [r.token for r in rows]
        own = flat.take(nd.array(where, device=scores.device)).numpy().reshape(-1)
        k = max(ks, default=0)
        if k == 1:  # the common case (lm-evaluation-harness's greedy check): on the device
            best = scores.argmax(axis=-1).numpy().reshape(-1, 1)
            values = scores.max(axis=-1).numpy().reshape(-1, 1)
        elif k > 1:
            host = scores.numpy()
            best = np.argpartition(-host, k - 1, axis=-1)[:, :k] if k < vocab else \
                np.broadcast_to(np.arange(vocab), (m, vocab))
            values = np.take_along_axis(host, best, axis=-1)
            order = np.argsort(-values, axis=-1, kind="stable")
            best = np.take_along_axis(best, order, axis=-1)
            values = np.take_along_axis(values, order, axis=-1)
        for i, r in enumerate(rows):
            alternatives = () if not ks[i] else tuple(
                (int(t), float(v)) for t, v in zip(best[i, :ks[i]], values[i, :ks[i]]))
            out.append(TokenLogprob(r.token, float(own[i]), alternatives))
        at += m
    return out
