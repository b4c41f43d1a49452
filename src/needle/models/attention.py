"""A prompt's attention where the fused kernel does not cover it, composed from array ops.

The fused kernels compute causal attention within a sliding window where a layer has one:
``nd.attention`` for a sequence, ``nd.attention_decode`` for one token (which also
soft-caps scores). A prompt of layers whose scores are soft-capped (Gemma 2) takes this
path: scores = Q Kᵀ · scale, cap · tanh(scores / cap), the causal-and-window mask,
softmax, times V. It moves the scores through memory (an S × S matrix for a prompt of S
tokens), which is why other layers use the fused kernel.
"""

from __future__ import annotations

import numpy as np

from .. import backend_ndarray as nd
from ..backend_ndarray import NDArray
from .config import ModelConfig


def is_fused(cfg: ModelConfig, layer: int) -> bool:
    """Whether layer ``layer``'s prompt attention can use the fused kernel
    (``nd.attention``, which takes its sliding window if it has one): no soft-capping."""
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
