"""Choosing the next token during generation: greedy, or a seeded draw.

The rules — transformers' repetition penalty, temperature, top-k, top-p and min-p, and a
draw from a hash of (seed, position) — are the array function ``nd.sample``'s (defined by
``backends/numpy_ref/sampling.py``). Where the model's device has capability ``sampling``
the decoder samples there, inside the captured decode step; otherwise ``Sampler`` brings a
row of logits to the host and runs the same function there. Either way a seed fixes the
tokens of a run, on every device.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

import numpy as np

from .. import backend_ndarray as nd
from ..errors import GenerationError


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
        if not isinstance(t, numbers.Real) or isinstance(t, bool) or not 0 <= t < float("inf"):
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
        """Plain argmax: temperature 0 and no repetition penalty (which applies to greedy
        decoding too, as in transformers)."""
        return self.temperature == 0.0 and self.repetition_penalty in (None, 1.0)

    def row(self) -> np.ndarray:
        """The five per-row settings of ``nd.sample``, float32."""
        return np.array([self.temperature, self.top_k or 0,
                         1.0 if self.top_p is None else self.top_p, self.min_p or 0.0,
                         1.0 if self.repetition_penalty is None else self.repetition_penalty],
                        np.float32)


class Sampler:
    """The sampling state of one sequence: its settings, its seed (32 bits; drawn from the
    OS when not given) and the tokens seen so far (for the repetition penalty)."""

    def __init__(self, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, *,
                 min_p: float | None = None, repetition_penalty: float | None = None):
        self.params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty,
                                     seed)
        self.seed = (seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
        self.seed = int(np.array(self.seed & 0xFFFFFFFF, np.uint32).view(np.int32))
        self._seen: list[int] = []

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def observe(self, tokens) -> None:
        """Tokens now part of the sequence (the prompt, then each chosen token)."""
        self._seen.extend(int(t) for t in tokens)

    def seen_mask(self, vocab: int) -> np.ndarray:
        mask = np.zeros(vocab, dtype=bool)
        ids = np.asarray(self._seen, dtype=np.int64)
        mask[ids[(ids >= 0) & (ids < vocab)]] = True
        return mask

    def __call__(self, logits, position: int = 0) -> int:
        """The token at ``position`` from ``logits`` (a row of vocabulary scores, an
        NDArray on any device or a numpy array); chosen on the host unless greedy."""
        if self.greedy and isinstance(logits, nd.NDArray):
            return int(logits.reshape(-1).argmax().item())
        host = logits.numpy() if isinstance(logits, nd.NDArray) else np.asarray(logits)
        return self.sample(host.reshape(-1), position)

    def sample(self, logits: np.ndarray, position: int = 0) -> int:
        """``nd.sample`` of one row on the host (cpu_numpy)."""
        vocab = logits.size
        dev = nd.cpu_numpy()
        token = nd.sample(nd.array(logits.reshape(1, vocab), device=dev),
                          nd.array(self.params.row()[None], device=dev),
                          nd.array(np.array([self.seed], np.int32), device=dev),
                          nd.array(np.array([position], np.int32), device=dev),
                          nd.array(self.seen_mask(vocab)[None], device=dev, dtype="bool"))
        return int(token.numpy()[0])
