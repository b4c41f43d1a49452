"""Quantized weights (capabilities ``int8`` and ``int4``): the reference of the kernels.

A quantized matrix W (n, k) is ``qweight`` (int32, n x words), ``scales`` (float32,
n x groups) and ``offsets`` (float32, n x groups, or None); ``needle.quant.format`` (and
docs/quantization.md) defines the packing and the value of each element.
"""

from __future__ import annotations

import numpy as np

from ...quant.format import dequantize as _dequantize
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
