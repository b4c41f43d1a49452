"""Attention that the fused kernels do not cover, composed from array ops.

The fused kernels (``nd.attention`` for a sequence, ``nd.attention_decode`` for one token)
compute causal attention, within a sliding window where a layer has one. Layers whose
scores are soft-capped (Gemma 2) take these paths instead: scores = Q Kᵀ · scale,
cap · tanh(scores / cap), the causal-and-window mask, softmax, times V. They move the
scores through memory (an S × S matrix for a prompt of S tokens), which is why layers that
need neither use the fused kernels.

The decode path keeps every shape fixed and reads the position only on the device, so a
captured decode step replays it for any position, like the fused one.
"""

from __future__ import annotations

import numpy as np

from .. import backend_ndarray as nd
from ..backend_ndarray import NDArray
from .cache import DecodeState, RotaryTables
from .config import ModelConfig


def is_fused(cfg: ModelConfig, layer: int) -> bool:
    """Whether layer ``layer`` can use the fused kernels (``nd.attention``,
    ``nd.attention_decode``, which take its sliding window if it has one): no
    soft-capping."""
    return cfg.attn_softcap is None


def softcap(x: NDArray, cap: float | None) -> NDArray:
    """cap * tanh(x / cap), computed in float32; x unchanged when cap is None."""
    if cap is None:
        return x
    return ((x.astype("float32") / cap).tanh() * cap).astype(x.dtype)


def prefill(cfg: ModelConfig, q: NDArray, k: NDArray, v: NDArray, kv_len: int,
            window: int | None, masks: dict | None = None) -> NDArray:
    """Causal attention of q (batch, q_heads, seq, d), the last ``seq`` of ``kv_len``
    positions, over k and v (batch, kv_heads, capacity, d); returns q's shape. ``masks``:
    a dict the caller keeps for one pass, where the layers that share a mask (Gemma 3's
    sliding ones) find it on the device after the first made it (a mask is made on the
    host: one upload a pass, not one a layer)."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    k, v = k[:, :, :kv_len, :], v[:, :, :kv_len, :]
    grouped = q.compact().reshape((b, hkv, group * s, d))  # rows: (head in group, position)
    scores = (grouped @ k.swapaxes(2, 3)).astype("float32") * cfg.attn_scale
    scores = softcap(scores, cfg.attn_softcap)
    key = (s, kv_len, group, window)
    mask = None if masks is None else masks.get(key)
    if mask is None:
        mask = nd.array(_mask(s, kv_len, group, window), device=q.device)
        if masks is not None:
            masks[key] = mask
    scores = scores + mask
    probs = scores.softmax().astype(q.dtype)
    return (probs @ v).reshape((b, hq, s, d))


def _mask(s: int, kv_len: int, group: int, window: int | None) -> np.ndarray:
    """(group * s, kv_len) float32: 0 where row r's query (position kv_len - s + r % s) may
    see key j — j at or before it, and within the window — else -inf."""
    query = (kv_len - s + np.arange(group * s) % s)[:, None]
    key = np.arange(kv_len)[None, :]
    allowed = key <= query
    if window is not None:
        allowed &= key > query - window
    return np.where(allowed, 0.0, -np.inf).astype(np.float32)


def decode(cfg: ModelConfig, qkv: NDArray, keys: NDArray, values: NDArray,
           rope: RotaryTables, state: DecodeState, window: int | None) -> NDArray:
    """One token's attention at the position in ``state.position``: RoPE at that row of
    the tables, its key and value added into that (zero) row of the caches, attention over
    positions 0..p (and within the window). Returns (q_heads * head_dim,)."""
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    capacity = keys.shape[2]
    position = state.position
    cos, sin = rope.cos.take(position), rope.sin.take(position)  # (1, d / 2)
    flat = qkv.reshape((hq + 2 * hkv, d))
    q = flat[:hq].reshape((1, 1, hq, d)).rope(cos, sin)
    k = flat[hq:hq + hkv].reshape((1, 1, hkv, d)).rope(cos, sin)
    rows, head_rows = state.composed_constants(capacity)
    at = head_rows + position  # row p of each KV head in the (kv_heads * capacity, d) caches
    nd.scatter_add(at, k.reshape((hkv, d)), hkv * capacity,
                   out=keys.reshape((hkv * capacity, d)))
    nd.scatter_add(at, flat[hq + hkv:], hkv * capacity,
                   out=values.reshape((hkv * capacity, d)))
    grouped = q.reshape((1, hkv, hq // hkv, d))
    scores = (grouped @ keys.swapaxes(2, 3)).astype("float32") * cfg.attn_scale
    scores = softcap(scores, cfg.attn_softcap)
    scores = nd.where(rows <= position, scores, -np.inf)
    if window is not None:
        scores = nd.where(rows > position - window, scores, -np.inf)
    probs = scores.softmax().astype(qkv.dtype)
    return (probs @ values).reshape((hq * d,))
