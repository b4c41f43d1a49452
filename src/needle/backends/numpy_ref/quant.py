"""Quantized weights (capabilities ``int8`` and ``int4``, and ``fused_quant_matvec`` for the
decode step's projections): the reference of the kernels.

A quantized matrix W (n, k) is ``qweight`` (int32, n x words), ``scales`` (float32,
n x groups) and ``offsets`` (float32, n x groups, or None); ``needle.quant.format`` (and
docs/quantization.md) defines the packing and the value of each element.
"""

from __future__ import annotations

import numpy as np

from ...quant.format import dequantize as _dequantize
from . import decode
from .core import Array, _f, _store


def _weights(qweight: Array, scales: Array, offsets: Array | None, n: int, k: int, bits: int,
             group_size: int) -> np.ndarray:
    words = -(-k // (32 // bits))
    groups = -(-k // group_size)
    q = qweight.array.reshape(n, words)
    s = scales.array.reshape(n, groups)
    b = None if offsets is None else offsets.array.reshape(n, groups)
    return _dequantize(q, s, b, bits, group_size, k)


def dequantize(qweight: Array, scales: Array, offsets: Array | None, out: Array, n: int,
               k: int, bits: int, group_size: int) -> None:
    """out (n, k) = the matrix the packed one stands for, computed in float32 and rounded
    once to ``out.dtype`` (float16, bfloat16 or float32)."""
    _store(out, _weights(qweight, scales, offsets, n, k, bits, group_size))


def quant_matmul(x: Array, qweight: Array, scales: Array, offsets: Array | None, out: Array,
                 m: int, n: int, k: int, bits: int, group_size: int) -> None:
    """out (m, n) = x (m, k) @ W.T for a quantized W (n, k).

    x and out share one float dtype; products are summed in float32 and rounded once.
    Backends may order the sum differently, and for m > 1 may round W to x's dtype before a
    tensor-core product (within that dtype's tolerance): the matvec (m = 1, decoding) never
    does.
    """
    w = _weights(qweight, scales, offsets, n, k, bits, group_size)
    xs = _f(x.array.reshape(m, k)).astype(np.float32)
    _store(out, xs @ w.T)


def _matrix(qweight: Array, scales: Array, offsets: Array | None, n: int, k: int, bits: int,
            group_size: int) -> Array:
    """The packed matrix as a float32 Array (its values exactly, never rounded to x's dtype)."""
    w = Array(n * k, "float32")
    w.array[:] = _weights(qweight, scales, offsets, n, k, bits, group_size).reshape(-1)
    return w


def quant_rmsnorm_matvec(x: Array, w: Array, qweight: Array, scales: Array,
                         offsets: Array | None, out: Array, rows: int, dim: int, p: int,
                         eps: float, bits: int, group_size: int, swiglu: bool) -> None:
    """``decode.rmsnorm_matvec`` (or, with ``swiglu``, ``decode.rmsnorm_matvec_swiglu``) with
    a packed weight of p (2p with swiglu: gate rows then up rows) rows of length dim: the
    normed x, rounded to its dtype, times the matrix's float32 values, summed in float32."""
    n = 2 * p if swiglu else p
    weight = _matrix(qweight, scales, offsets, n, dim, bits, group_size)
    fused = decode.rmsnorm_matvec_swiglu if swiglu else decode.rmsnorm_matvec
    fused(x, w, weight, out, rows, dim, p, eps)


def quant_matvec_add(a: Array, qweight: Array, scales: Array, offsets: Array | None,
                     total: Array, rows: int, dim: int, p: int, bits: int,
                     group_size: int) -> None:
    """``decode.matvec_add`` with a packed (p, dim) weight: total += a @ W.T in place, the
    product rounded to total's dtype first."""
    weight = _matrix(qweight, scales, offsets, p, dim, bits, group_size)
    decode.matvec_add(a, weight, total, rows, dim, p)
