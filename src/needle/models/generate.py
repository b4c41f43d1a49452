"""Autoregressive generation: sampling, the prefill/decode loop, streaming.

The loop is model-agnostic: it needs a ``Decoder`` (``prefill(ids)`` then ``step(token)``,
each returning the next-token logits) from the model, and it turns logits into tokens
with a ``Sampler``. Greedy decoding (temperature 0) takes the argmax on the device, so only
one integer crosses to the host per token; sampling brings the logits row to the host,
where top-k/top-p filtering and a seeded draw are cheap and exactly reproducible.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ..backend_ndarray import NDArray
from ..errors import GenerationError, IndexOutOfRangeError, ShapeError


class Sampler:
    """Picks the next token from a logits row: greedy, or temperature + top-k + top-p.

    The semantics follow Hugging Face's logits warpers applied in that order: divide by
    the temperature, keep the ``top_k`` largest logits, then keep the smallest set of the
    most likely tokens whose probabilities sum to at least ``top_p``, and draw.
    """

    def __init__(self, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None):
        if not isinstance(temperature, numbers.Real) or not temperature >= 0:
            raise GenerationError(f"temperature must be a number >= 0, got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, numbers.Integral) or top_k < 1):
            raise GenerationError(f"top_k must be a positive int or None, got {top_k!r}")
        if top_p is not None and (not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
            raise GenerationError(f"top_p must be in (0, 1] or None, got {top_p!r}")
        self.temperature, self.top_k, self.top_p = float(temperature), top_k, top_p
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __call__(self, logits: NDArray) -> int:
        """The next token from ``logits``, a row of vocabulary scores on any device."""
        if self.greedy:
            return int(logits.reshape(-1).argmax().item())
        return self.sample(logits.numpy().reshape(-1))

    def sample(self, logits: np.ndarray) -> int:
        """A seeded draw from ``probabilities(logits)``."""
        p = self.probabilities(logits)
        return int(self.rng.choice(p.size, p=p))

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution the sampler draws from: zero outside the top-k / top-p set."""
        z = np.asarray(logits, dtype=np.float64).reshape(-1) / self.temperature
        if self.top_k is not None and self.top_k < z.size:
            kth = np.partition(z, -self.top_k)[-self.top_k]
            z = np.where(z < kth, -np.inf, z)
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.top_p is not None and self.top_p < 1:
            order = np.argsort(-p, kind="stable")
            keep = int(np.searchsorted(np.cumsum(p[order]), self.top_p)) + 1
            kept = np.zeros_like(p)
            kept[order[:keep]] = p[order[:keep]]
            p = kept / kept.sum()
        return p


@dataclass
class GenerationStats:
    """Token counts and wall times of one generation (filled in while it runs)."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def prompt_ids(prompt, vocab_size: int) -> list[int]:
    """The prompt as a list of token ids, checked against the vocabulary."""
    if isinstance(prompt, NDArray) or hasattr(prompt, "numpy"):
        prompt = prompt.numpy()
    arr = np.asarray(prompt)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise ShapeError(f"prompt_ids must be a non-empty 1-d sequence of ints (or shape "
                         f"(1, n)), got shape {arr.shape} of {arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab_size:
        bad = int(arr.min() if arr.min() < 0 else arr.max())
        raise IndexOutOfRangeError(f"prompt token id {bad} is outside the vocabulary "
                                   f"(0..{vocab_size - 1})")
    return [int(t) for t in arr]


def stream(model, prompt, max_new_tokens: int, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
           stop: Iterable[int] | None = None,
           stats: GenerationStats | None = None) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` new token ids; a stop token is yielded, then it ends.

    ``stop`` defaults to the model's end-of-sequence ids; pass ``()`` to never stop early.
    """
    ids = prompt_ids(prompt, model.config.vocab_size)
    if not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if len(ids) + max_new_tokens > model.max_seq_len:
        raise GenerationError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                         f"exceed the model's max_seq_len {model.max_seq_len}; load it with a "
                         "larger max_seq_len or ask for fewer tokens")
    sampler = Sampler(temperature, top_k, top_p, seed)
    stop_ids = frozenset(model.config.eos_token_ids if stop is None else (int(s) for s in stop))
    stats = stats if stats is not None else GenerationStats()
    if max_new_tokens == 0:
        return
    decoder = model.decoder()
    start = time.perf_counter()
    token = sampler(decoder.prefill(ids))
    stats.prefill_tokens, stats.prefill_seconds = len(ids), time.perf_counter() - start
    yield token
    if token in stop_ids or max_new_tokens == 1:
        return
    if sampler.greedy:  # the choice made on the device, one step queued ahead of the host
        steps = decoder.greedy_stream(token, max_new_tokens - 1)
    else:
        steps = _sampled(decoder, sampler, token, max_new_tokens - 1)
    try:
        for _ in range(max_new_tokens - 1):
            start = time.perf_counter()
            token = next(steps)
            stats.decode_tokens += 1
            stats.decode_seconds += time.perf_counter() - start
            yield token
            if token in stop_ids:
                return
    finally:
        steps.close()  # undoes a step queued ahead of a stop


def _sampled(decoder, sampler: Sampler, token: int, count: int) -> Iterator[int]:
    """``count`` tokens, each sampled on the host from the step fed the previous one."""
    for _ in range(count):
        token = sampler(decoder.step(token))
        yield token


def generate(model, prompt, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop: Iterable[int] | None = None, callback: Callable[[int], object] | None = None,
             stats: GenerationStats | None = None) -> list[int]:
    """The new token ids as a list; ``callback(token)`` is called as each one is made."""
    out = []
    for token in stream(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, stop,
                        stats):
        out.append(token)
        if callback is not None:
            callback(token)
    return out
