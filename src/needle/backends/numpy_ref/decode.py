"""The decode step's fused matrix-vector products (docs/llm.md, "The forward pass").

A decoder layer for one token is five fused operations: norm + QKV projection, attention
(``nn.attention_decode``), output projection + residual add, norm + gate/up projection +
SiLU·mul, down projection + residual add. The three kinds of projection are defined here.

Every intermediate is rounded to the array's dtype exactly where the unfused sequence of
operations would round it (``rmsnorm``, ``matmul``, ``swiglu``, ``ewise_add``), so a fused
kernel differs from the composed ops only in the order of its float32 sums. Weights are
stored (out, in) as PyTorch stores them; ``x``/``a`` hold ``rows`` rows of length ``dim``.
"""

from __future__ import annotations

import numpy as np

from .core import Array, _f, _store
from .elementwise import _sigmoid


def _rms_factor(v: np.ndarray, eps: float) -> np.ndarray:
    """1 / sqrt(mean(v^2) + eps) of each row of v (the compute dtype)."""
    return 1 / np.sqrt((v * v).mean(axis=1, keepdims=True) + np.asarray(eps, v.dtype))


def _normed(x: Array, w: Array, rows: int, dim: int, eps: float) -> np.ndarray:
    """rmsnorm(x) * w rounded to x's dtype, then back in the compute dtype."""
    v = _f(x.array).reshape(rows, dim)
    return _f((v * _rms_factor(v, eps) * _f(w.array)).astype(x.array.dtype))


def _rounded(value: np.ndarray, like: Array) -> np.ndarray:
    return _f(value.astype(like.array.dtype))


def _store_swiglu(out: Array, gate_up: np.ndarray, p: int) -> None:
    """out = silu(g) * u of the products [g | u] (rows, 2p), each rounded first (``swiglu``
    of a rounded product)."""
    gu = _rounded(gate_up, out)
    g, u = gu[:, :p], gu[:, p:]
    _store(out, (g * _sigmoid(g) * u).reshape(-1))


def rmsnorm_matvec(x: Array, w: Array, weight: Array, out: Array, rows: int, dim: int,
                   p: int, eps: float) -> None:
    """out (rows, p) = rmsnorm(x) * w @ weight.T, weight (p, dim): the pre-norm and the
    projection that reads it (query/key/value, or the model's head)."""
    h = _normed(x, w, rows, dim, eps)
    _store(out, (h @ _f(weight.array).reshape(p, dim).T).reshape(-1))


def rmsnorm_matvec_swiglu(x: Array, w: Array, weight: Array, out: Array, rows: int,
                          dim: int, p: int, eps: float) -> None:
    """out (rows, p) = silu(g) * u with [g | u] = rmsnorm(x) * w @ weight.T, weight
    (2p, dim) holding the gate's rows then the up projection's (each rounded before the
    gate, as ``swiglu`` of a rounded product)."""
    h = _normed(x, w, rows, dim, eps)
    _store_swiglu(out, h @ _f(weight.array).reshape(2 * p, dim).T, p)


def folded_rmsnorm_matvec(x: Array, weight: Array, out: Array, dim: int, p: int, eps: float,
                          swiglu: bool) -> None:
    """One row: out (p,) = r * (weight @ x), r = 1 / sqrt(mean(x^2) + eps), the norm's scale
    already folded into weight's columns (weight * norm_weight, rounded once at load) and the
    normed vector never rounded; with ``swiglu`` weight is (2p, dim) and out = silu(g) * u of
    the two products, each rounded first."""
    v = _f(x.array).reshape(1, dim)
    y = (v @ _f(weight.array).reshape(2 * p if swiglu else p, dim).T) * _rms_factor(v, eps)
    if swiglu:
        _store_swiglu(out, y, p)
    else:
        _store(out, y.reshape(-1))


def matvec_add(a: Array, weight: Array, total: Array, rows: int, dim: int, p: int) -> None:
    """total (rows, p) += a @ weight.T, a (rows, dim), weight (p, dim), the product rounded
    before the add: a projection added into the residual stream, in place."""
    y = _rounded(_f(a.array).reshape(rows, dim) @ _f(weight.array).reshape(p, dim).T, total)
    with np.errstate(over="ignore"):
        _store(total, (_f(total.array).reshape(rows, p) + y).reshape(-1))
