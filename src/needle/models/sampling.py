"""Choosing the next token: greedy, or a seeded draw after transformers' logits processors.

The filters follow transformers' processors, in its order: the repetition penalty on the
raw logits (a seen token's logit divided by the penalty when positive, multiplied when
negative), temperature, top-k, top-p over what top-k kept, then min-p. Cut-offs are values:
a token tied with the last one kept is kept too (transformers' sort-based cut keeps an
arbitrary subset of a tie; with distinct logits the two agree exactly).

The draw is reproducible everywhere: a uniform u in [0, 1) from a counter-based hash of the
seed and the position of the token being chosen (32-bit integer arithmetic, the same in
numpy and in a device kernel), then the first token, in vocabulary order, whose running sum
of kept probability exceeds u times their total. A seed therefore fixes the tokens of a run
on every device, and a captured decode step needs no host random state.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

import numpy as np

from ..errors import GenerationError

_MASK = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; None (or 0 for top_k, 1.0 for top_p and the penalty) turns
    a filter off. ``seed`` fixes the draws (None: a fresh one)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if not isinstance(t, numbers.Real) or isinstance(t, bool) or not t >= 0 \
                or t == float("inf"):
            raise GenerationError(f"temperature must be a finite number >= 0, got {t!r}")
        if k is not None and (not isinstance(k, numbers.Integral) or isinstance(k, bool)
                              or k < 0):
            raise GenerationError(f"top_k must be an int >= 0 (0: off) or None, got {k!r}")
        if p is not None and (not isinstance(p, numbers.Real) or not 0 < p <= 1):
            raise GenerationError(f"top_p must be in (0, 1] or None, got {p!r}")
        m = self.min_p
        if m is not None and (not isinstance(m, numbers.Real) or not 0 <= m <= 1):
            raise GenerationError(f"min_p must be in [0, 1] or None, got {m!r}")
        r = self.repetition_penalty
        if r is not None and (not isinstance(r, numbers.Real) or not 0 < r < float("inf")):
            raise GenerationError(f"repetition_penalty must be a positive number or None, "
                                  f"got {r!r}")
        s = self.seed
        if s is not None and (not isinstance(s, numbers.Integral) or isinstance(s, bool)):
            raise GenerationError(f"seed must be an int or None, got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty is not None and self.repetition_penalty != 1.0


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) (24 bits) from ``seed`` and ``position``: murmur3's
    32-bit finalizer over a mix of the two."""
    x = (seed * 0x9E3779B9 + position * 0x85EBCA6B + 0x632BE5AB) & _MASK
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _MASK
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _MASK
    x ^= x >> 16
    return (x >> 8) / float(1 << 24)


def penalize(logits: np.ndarray, seen, penalty: float | None) -> np.ndarray:
    """transformers' repetition penalty: seen tokens' logits / penalty (positive) or
    * penalty (negative); float64."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1).copy()
    if penalty is not None and penalty != 1.0 and len(seen):
        idx = np.fromiter(seen, dtype=np.int64) if not isinstance(seen, np.ndarray) else seen
        z[idx] = np.where(z[idx] > 0, z[idx] / penalty, z[idx] * penalty)
    return z


def probabilities(logits: np.ndarray, params: SamplingParams, seen=()) -> np.ndarray:
    """The distribution a sampled token is drawn from (float64, zero outside what the
    filters keep); ``seen``: the token ids of the sequence so far (for the penalty)."""
    z = penalize(logits, seen, params.repetition_penalty) / params.temperature
    keep = np.ones(z.size, dtype=bool)
    if params.top_k and params.top_k < z.size:
        keep &= z >= np.partition(z, -params.top_k)[-params.top_k]
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    if params.top_p is not None and params.top_p < 1:
        kept = np.sort(p[keep])[::-1]
        cut = kept[min(int(np.searchsorted(np.cumsum(kept) / kept.sum(), params.top_p)),
                       kept.size - 1)]
        keep &= p >= cut
    if params.min_p:
        keep &= p >= params.min_p * p.max()  # p.max() is the top token's, never filtered
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def draw(p: np.ndarray, u: float) -> int:
    """The first index whose running sum of ``p`` exceeds ``u`` times the total."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, u * c[-1], side="right"), p.size - 1))


class Sampler:
    """Picks the next token from a logits row: greedy, or a seeded draw (see the module
    notes). Keeps the sequence's tokens for the repetition penalty (``observe``)."""

    def __init__(self, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, *,
                 min_p: float | None = None, repetition_penalty: float | None = None):
        self.params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty,
                                     seed)
        self.seed = (seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
        self.seed &= _MASK
        self.seen: set[int] = set()

    @property
    def greedy(self) -> bool:
        return self.params.greedy and not self.params.penalized

    def observe(self, tokens) -> None:
        """Tokens now part of the sequence (the prompt, then each chosen token)."""
        self.seen.update(int(t) for t in tokens)

    def __call__(self, logits, position: int = 0) -> int:
        """The token at ``position`` from ``logits``, a row of vocabulary scores (an NDArray
        on any device, or a numpy array)."""
        if self.greedy:
            row = logits.reshape(-1)
            return int(row.argmax().item() if hasattr(row, "item") else np.argmax(row))
        host = logits.numpy() if hasattr(logits, "numpy") else np.asarray(logits)
        return self.sample(host.reshape(-1), position)

    def sample(self, logits: np.ndarray, position: int = 0) -> int:
        """The token drawn from ``probabilities(logits)`` with this sampler's seed."""
        if self.params.greedy:  # a penalty without sampling: greedy on penalized logits
            return int(np.argmax(penalize(logits, self.seen, self.params.repetition_penalty)))
        return draw(self.probabilities(logits), uniform(self.seed, position))

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        return probabilities(logits, self.params, self.seen)
