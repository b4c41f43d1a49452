"""Paged attention (capability ``paged_attention``): keys and values of many sequences in one
pool of fixed-size pages, each sequence reading its own pages through a block table (the
vLLM design; ``needle.serve`` keeps the pool).

Layout of a pool (one per layer for keys, one for values): ``num_pages * page_size`` slots,
each slot one position's row of ``kv_heads * head_dim`` values, i.e. (num_pages, page_size,
kv_heads, head_dim). Position j of a sequence whose block-table row is ``table`` lives in
slot ``table[j // page_size] * page_size + j % page_size``.
"""

from __future__ import annotations

import numpy as np

from .core import Array, _f, _store
from .nn import soft_cap


def paged_write(k: Array, v: Array, slots: Array, key_pages: Array, value_pages: Array,
                tokens: int, row: int, num_slots: int) -> None:
    """Store row t of ``k`` and ``v`` (tokens, row) in slot ``slots[t]`` (int32) of
    ``key_pages`` and ``value_pages`` (num_slots, row), for every t. All floating arrays
    share one dtype. Slots outside 0..num_slots-1 (padding, -1) are skipped."""
    s = slots.array[:tokens].astype(np.int64)
    ok = (s >= 0) & (s < num_slots)
    kp = key_pages.array.reshape(num_slots, row)
    vp = value_pages.array.reshape(num_slots, row)
    kp[s[ok]] = k.array.reshape(tokens, row)[ok]
    vp[s[ok]] = v.array.reshape(tokens, row)[ok]


def paged_attention(q: Array, key_pages: Array, value_pages: Array, block_tables: Array,
                    seq_of: Array, positions: Array, out: Array, tokens: int, q_heads: int,
                    kv_heads: int, head_dim: int, page_size: int, max_pages: int,
                    num_pages: int, scale: float, window: int = 0, softcap: float = 0.0) -> None:
    """Causal grouped-query attention of ``tokens`` queries, each over its own sequence's
    pages.

    ``q`` and ``out`` are (tokens, q_heads, head_dim); the pools are (num_pages, page_size,
    kv_heads, head_dim); ``block_tables`` (sequences, max_pages) int32; ``seq_of`` and
    ``positions`` (tokens,) int32: query t belongs to the sequence of block-table row
    ``seq_of[t]``, sits at position p = ``positions[t]`` and sees that sequence's keys at
    positions 0..p (its own key included: write it first with ``paged_write``), or with a
    sliding ``window`` > 0 at positions max(0, p - window + 1)..p; with ``softcap`` > 0
    (Gemma 2) the scaled scores s become softcap · tanh(s / softcap). Query head
    h reads KV head h // (q_heads // kv_heads). Scores, softmax and the weighted sum are
    computed in float32 (float64 for float64) and rounded once to ``out``'s dtype.
    A query whose pages are out of range (p < 0, p // page_size >= max_pages, or a page id
    outside 0..num_pages-1) gets NaN: kernels cannot raise, so the caller checks on the host.
    """
    d, group = head_dim, q_heads // kv_heads
    qq = _f(q.array).reshape(tokens, q_heads, d)
    kp = key_pages.array.reshape(num_pages * page_size, kv_heads, d)
    vp = value_pages.array.reshape(num_pages * page_size, kv_heads, d)
    tables = block_tables.array.reshape(-1, max_pages).astype(np.int64)
    result = np.empty((tokens, q_heads, d), qq.dtype)
    for t in range(tokens):
        p = int(positions.array[t])
        slots = _slots(tables[int(seq_of.array[t])], p, page_size, max_pages, num_pages)
        if slots is None:
            result[t] = np.nan
            continue
        if window > 0:
            slots = slots[max(0, p - window + 1):]
        kk = np.repeat(_f(kp[slots]).transpose(1, 0, 2), group, axis=0)  # (q_heads, p+1, d)
        vv = np.repeat(_f(vp[slots]).transpose(1, 0, 2), group, axis=0)
        scores = soft_cap(np.einsum("hd,htd->ht", qq[t], kk) * np.asarray(scale, qq.dtype),
                          softcap)
        e = np.exp(scores - scores.max(axis=1, keepdims=True))
        result[t] = np.einsum("ht,htd->hd", e / e.sum(axis=1, keepdims=True), vv)
    _store(out, result.reshape(-1))


def _slots(table: np.ndarray, p: int, page_size: int, max_pages: int,
           num_pages: int) -> np.ndarray | None:
    """Slots of positions 0..p through one block-table row, or None when out of range."""
    if p < 0 or p // page_size >= max_pages:
        return None
    j = np.arange(p + 1)
    pages = table[j // page_size]
    if pages.min() < 0 or pages.max() >= num_pages:
        return None
    return pages * page_size + j % page_size
