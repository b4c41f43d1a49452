"""Perplexity of a model on a text: exp of the mean negative log-likelihood of its tokens.

A text longer than the model's context is read in windows of ``context`` tokens that start
every ``stride`` tokens (transformers' "perplexity of fixed-length models" recipe): each
token is scored once, by the first window that holds it with at least one token before it,
so a stride shorter than the context gives later windows' tokens more to condition on. The
first token of the text has nothing before it and is not scored. The log-softmax is taken
on the device in float32, a slice of rows at a time; only each row's target value comes
back (``token_logprobs.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import ArgumentError
from .token_logprobs import log_softmax, rows_per_slice, values_at


@dataclass
class Perplexity:
    nll: float  # summed negative log-likelihood (nats) of the scored tokens
    tokens: int  # tokens scored
    windows: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def nll_per_token(self) -> float:
        return self.nll / self.tokens


def windows(n: int, context: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over n tokens."""
    scored_to = 1  # positions below this are scored (position 0 never is)
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        first = max(scored_to, begin + 1)
        if first < end:
            yield begin, end, first
        scored_to = end
        if end == n:
            return


def token_logprobs(model, ids: list[int], first: int = 1) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i in first..len(ids)-1, from one forward pass over ids."""
    logits = model.forward([ids])  # (1, T, vocab)
    t, vocab = logits.shape[1], logits.shape[2]
    logits = logits.reshape((t, vocab))
    rows = rows_per_slice(vocab)
    out = [values_at(log_softmax(logits[a:min(a + rows, t - 1)]), ids[a + 1:a + 1 + rows])
           for a in range(first - 1, t - 1, rows)]
    return np.concatenate(out).astype(np.float64)


def perplexity(model, ids: list[int], context: int | None = None, stride: int | None = None,
               progress: bool = False) -> Perplexity:
    """The perplexity of ``ids`` under ``model`` (windows of ``context`` tokens, default the
    model's max_seq_len, every ``stride``, default ``context``)."""
    context = model.max_seq_len if context is None else context
    stride = context if stride is None else stride
    if len(ids) < 2:
        raise ArgumentError(f"perplexity needs at least 2 tokens (the first is not scored), "
                            f"got {len(ids)}")
    if not 2 <= context <= model.max_seq_len:
        raise ArgumentError(f"context must be in [2, max_seq_len {model.max_seq_len}], got "
                            f"{context}; load the model with a larger max_seq_len")
    if not 1 <= stride <= context:
        raise ArgumentError(f"stride must be in [1, context {context}], got {stride}")
    plan = list(windows(len(ids), context, stride))
    if progress:
        from tqdm import tqdm

        plan = tqdm(plan, desc="scoring", unit="window")
    nll, tokens = 0.0, 0
    for begin, end, first in plan:
        logp = token_logprobs(model, ids[begin:end], first - begin)
        nll -= float(logp.sum())
        tokens += len(logp)
    return Perplexity(nll, tokens, len(plan))
