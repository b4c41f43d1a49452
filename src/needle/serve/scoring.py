"""Prompt logprobs: each prompt token's log-probability under the tokens before it, and the
likeliest tokens there (``RequestParams.prompt_logprobs``; OpenAI's ``echo`` with
``logprobs``, which lm-evaluation-harness's loglikelihood tasks send).

A prompt chunk's step already computes every position's final hidden state; the choosing
rows alone go through the LM head. A scored chunk's other positions go through it too, in
slices (``models/token_logprobs.py``). Each slice's float32 log-softmax stays on the device;
the host reads back only the values asked for: each row's token, and its top tokens (on the
device where one is asked for).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import backend_ndarray as nd
from ..backend_ndarray import NDArray
from ..models.token_logprobs import log_softmax, rows_per_slice, values_at
from .request import TokenLogprob


@dataclass
class ScoredRow:
    """A scored row of a step: the request, and the prompt token it scores (under the
    logits of the position before it)."""

    request: object
    token: int


def log_softmax_slices(model, hidden: NDArray, rows: np.ndarray) -> list[NDArray]:
    """The float32 log-softmax (m, vocab) of the logits of ``hidden``'s ``rows``, slice by
    slice, on the device. Every tensor-parallel rank runs this (the head gathers across
    them); only rank 0 reads the result."""
    tr, dev = model.transformer, hidden.device
    step = rows_per_slice(model.config.vocab_size)
    return [log_softmax(tr._logits(hidden.take(
                nd.array(np.asarray(rows[at:at + step], np.int32), device=dev))))
            for at in range(0, len(rows), step)]


def read(slices: list[NDArray], scored: list[ScoredRow]) -> list[TokenLogprob]:
    """Each scored row's TokenLogprob (its token's log-probability, and its request's
    ``prompt_logprobs`` likeliest tokens') from ``log_softmax_slices``'s result."""
    out: list[TokenLogprob] = []
    at = 0
    for scores in slices:
        m, vocab = scores.shape
        rows = scored[at:at + m]
        ks = [r.request.params.prompt_logprobs for r in rows]
        own = values_at(scores, [r.token for r in rows])
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
