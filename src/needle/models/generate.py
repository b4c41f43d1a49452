"""Autoregressive generation: the prefill/decode loop and streaming.

The loop is model-agnostic: it needs a ``Decoder`` (``prefill(ids)`` then steps) from the
model and a ``Sampler`` (``sampling.py``). Greedy decoding takes the argmax on the device,
and so does sampling where the device has capability ``sampling``: one step queued ahead of
the host, so only one integer crosses to the host per token. Elsewhere each row of logits
is sampled on the host, with the same rules and the same draws.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ..backend_ndarray import NDArray
from ..backends.api import has
from ..errors import GenerationError, IndexOutOfRangeError, ShapeError
from .sampling import Sampler

DEFAULT_MAX_NEW_TOKENS = 128


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


def _check_length(model, prompt: int, max_new_tokens) -> int:
    if max_new_tokens is None:
        max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, model.max_seq_len - prompt)
    if not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if prompt + max_new_tokens > model.max_seq_len:
        limit = model.config.max_position_embeddings
        raise GenerationError(
            f"prompt ({prompt} tokens) + max_new_tokens ({max_new_tokens}) exceed the model's "
            f"max_seq_len {model.max_seq_len}; "
            + ("load it with a larger max_seq_len or ask for fewer tokens"
               if model.max_seq_len < limit else
               f"this model was trained for {limit} positions (max_position_embeddings), "
               "so ask for fewer tokens or shorten the prompt"))
    return int(max_new_tokens)


def stream(model, prompt, max_new_tokens: int | None = None, temperature=None, top_k=None,
           top_p=None, seed: int | None = None, stop: Iterable[int] | None = None,
           stats: GenerationStats | None = None, *, min_p=None,
           repetition_penalty=None) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` new token ids; a stop token is yielded, then it ends.

    Sampling settings left as None take the model's generation defaults
    (``model.generation_config``, from generation_config.json: greedy unless it samples).
    ``stop`` defaults to the end-of-sequence ids of config.json and generation_config.json;
    pass ``()`` to never stop early.
    """
    ids = prompt_ids(prompt, model.config.vocab_size)
    max_new_tokens = _check_length(model, len(ids), max_new_tokens)
    gen = model.generation_config
    params = gen.sampling(temperature, top_k, top_p, min_p, repetition_penalty, seed)
    sampler = Sampler(params.temperature, params.top_k, params.top_p, params.seed,
                      min_p=params.min_p, repetition_penalty=params.repetition_penalty)
    stop_ids = frozenset(gen.eos_token_ids if stop is None else _stop_ids(stop))
    stats = stats if stats is not None else GenerationStats()
    if max_new_tokens == 0:
        return
    decoder = model.decoder()
    on_device = not sampler.greedy and has(model.device.backend, "sampling")
    start = time.perf_counter()
    sampler.observe(ids)
    logits = decoder.prefill(ids)
    if on_device:
        decoder.start_sampling(sampler, ids)
        token = decoder.sample_first(logits)
    else:
        token = sampler(logits, len(ids))
    stats.prefill_tokens, stats.prefill_seconds = len(ids), time.perf_counter() - start
    yield token
    if token in stop_ids or max_new_tokens == 1:
        return
    # the choice made on the device, one step queued ahead of the host; else on the host
    if sampler.greedy or on_device:
        steps = decoder.stream("greedy" if sampler.greedy else "sampled", token,
                               max_new_tokens - 1)
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
    """``count`` tokens, each drawn from the step fed the previous one."""
    for _ in range(count):
        sampler.observe((token,))
        logits = decoder.step(token)
        token = sampler(logits, decoder.length)
        yield token


def generate(model, prompt, max_new_tokens: int | None = None, temperature=None, top_k=None,
             top_p=None, seed: int | None = None, stop: Iterable[int] | None = None,
             callback: Callable[[int], object] | None = None,
             stats: GenerationStats | None = None, *, min_p=None,
             repetition_penalty=None) -> list[int]:
    """The new token ids as a list; ``callback(token)`` is called as each one is made."""
    if callback is not None and not callable(callback):
        raise GenerationError(f"callback must be callable (called with each new token id), "
                              f"got {type(callback).__name__}")
    out = []
    for token in stream(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, stop,
                        stats, min_p=min_p, repetition_penalty=repetition_penalty):
        out.append(token)
        if callback is not None:
            callback(token)
    return out


def _stop_ids(stop) -> list[int]:
    """``stop`` as token ids: an iterable of ints (``()`` never stops early)."""
    try:
        ids = list(stop)
    except TypeError:
        raise GenerationError(f"stop must be a list of token ids, got {stop!r}") from None
    if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in ids):
        raise GenerationError(f"stop must be a list of token ids (ints), got {stop!r}")
    return [int(s) for s in ids]
