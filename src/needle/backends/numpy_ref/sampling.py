"""Choosing the next token of each row of logits: the reference of capability ``sampling``.

The filters follow transformers' logits processors, in its order: the repetition penalty on
the raw logits (a seen token's logit divided by the penalty when positive, multiplied when
negative), temperature, top-k, top-p over what top-k kept, then min-p. Cut-offs are values:
a token tied with the last one kept is kept too (transformers' sort-based cut keeps an
arbitrary subset of a tie; with distinct logits the two agree).

The draw: u in [0, 1) from a counter-based hash of the row's seed and the position of the
token being chosen (32-bit integer arithmetic, the same in every backend), then the first
token, in vocabulary order, whose running sum of kept probability exceeds u times their
total. A seed therefore fixes the tokens of a run on every device, and a captured decode
step needs no host random state. This reference computes in float64; device kernels in
float32, so a draw whose u falls within rounding of a token boundary may differ.
"""

from __future__ import annotations

import numpy as np

from .core import Array

PARAMS = 5  # per row: temperature, top_k, top_p, min_p, repetition_penalty
_MASK = 0xFFFFFFFF


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) (24 bits) from a 32-bit ``seed`` and ``position``:
    murmur3's 32-bit finalizer over a mix of the two."""
    x = ((seed & _MASK) * 0x9E3779B9 + (position & _MASK) * 0x85EBCA6B + 0x632BE5AB) & _MASK
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _MASK
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _MASK
    x ^= x >> 16
    return (x >> 8) / float(1 << 24)


def penalize(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """float64 logits with transformers' repetition penalty applied to the ``seen`` ones."""
    z = np.asarray(logits, dtype=np.float64).copy()
    if penalty != 1.0:
        z = np.where(seen, np.where(z > 0, z / penalty, z * penalty), z)
    return z


def probabilities(z: np.ndarray, temperature: float, top_k: int, top_p: float,
                  min_p: float) -> np.ndarray:
    """The distribution drawn from, given penalized logits ``z`` (float64; zero outside
    what the filters keep). top_k 0, top_p 1 and min_p 0 are off."""
    z = z / temperature
    keep = np.ones(z.size, dtype=bool)
    if 0 < top_k < z.size:
        keep &= z >= np.partition(z, -top_k)[-top_k]
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    if top_p < 1:
        kept = np.sort(p[keep])[::-1]
        cut = kept[min(int(np.searchsorted(np.cumsum(kept) / kept.sum(), top_p)),
                       kept.size - 1)]
        keep &= p >= cut
    if min_p > 0:
        keep &= p >= min_p * p.max()  # p.max() is the top token's, never filtered
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def draw(p: np.ndarray, u: float) -> int:
    """The first index whose running sum of ``p`` exceeds ``u`` times the total."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, u * c[-1], side="right"), p.size - 1))


def sample(logits: Array, params: Array, seeds: Array, positions: Array, seen: Array,
           out: Array, rows: int, vocab: int) -> None:
    """One token per row of ``logits`` (rows, vocab), into ``out`` (rows,) int32.

    ``params`` (rows, 5) float32: temperature (0: greedy, the first maximum of the penalized
    logits), top_k (0: off), top_p (1: off), min_p (0: off), repetition_penalty (1: off).
    ``seeds`` (rows,) int32: the seed's 32 bits. ``positions`` (rows,) int32: the position of
    the token being chosen. ``seen`` (rows, vocab) bool: tokens already in the sequence; the
    chosen token is marked in it.
    """
    x = logits.array.reshape(rows, vocab)
    prm = params.array.reshape(rows, PARAMS).astype(np.float64)
    mask = seen.array.reshape(rows, vocab)
    for r in range(rows):
        temperature, top_k, top_p, min_p, penalty = prm[r]
        z = penalize(x[r], mask[r], penalty)
        if temperature == 0:
            token = int(np.argmax(z))
        else:
            p = probabilities(z, temperature, int(top_k), top_p, min_p)
            token = draw(p, uniform(int(seeds.array[r]), int(positions.array[r])))
        out.array[r] = token
        mask[r, token] = True
