"""One-row products on CUDA (``kernels/matmul.cu``'s gemv family): a decode step's
projections, a warp per weight row, bandwidth-bound.

``gemv_glu``: ``matmul_swiglu`` of one row. A pair of warps reads the gate and up rows of
each output (each warp reads its row as gemv_t does) and the first writes silu(gate) * up,
so a decode step has no 2 x intermediate-wide product in memory and no separate SwiGLU
launch; the numbers are those of the product then ``swiglu`` (each product rounded first).

``gemv_t_norm`` / ``gemv_glu_norm`` (capability ``folded_norm_matvec``): the same products
with the RMSNorm in front folded in: the model multiplies the norm's scale into the weight's
columns at load, and each warp sums x^2 over the values its dot product already reads, so
the norm costs no launch, no pass and no registers for its weight; the result is
r * (W x), the normed vector never rounded (numpy_ref/decode.py).

``gemv_t_add``: ``matvec_add`` of one row, total[j] += the rounded product, in place (the
output and down projections into the residual stream): no separate add launch.
"""

from __future__ import annotations

import struct

from ..gpu.array import MATMUL, SUFFIX, GpuArray, cdiv, overlap
from ..gpu.matmul import GEMV_DTYPES, MatmulOps

__all__ = ["GEMV_DTYPES", "GemvOps"]

GEMV_PARAMS = struct.Struct("qqf")  # matmul.cu GemvParams: n, p, eps


class GemvOps(MatmulOps):
    def _gemv_glu(self, a: GpuArray, w: GpuArray, out: GpuArray, n: int, p: int,
                  kernel: str = "gemv_glu") -> None:
        """out (p,) = silu(a @ w[:p].T) * (a @ w[p:].T) for one row a (n,), w (2p, n);
        ``gemv_geglu``: gelu_tanh(...) * (...)."""
        self._gemv_pairs(kernel, a, w, out, MATMUL.pack(1, n, p, 1, 0, 0, 0, 1, 1, n), p)

    def _gemv_pairs(self, name: str, a: GpuArray, w: GpuArray, out: GpuArray, params: bytes,
                    p: int) -> None:
        """A group of 4 warps: 2 outputs, a warp a row (gate, up)."""
        k = self._kernel("matmul", f"{name}_{SUFFIX[a.dtype]}")
        ty = max(2, min(4, k.max_threads // 32))
        self.queue.dispatch(k, (cdiv(p, ty // 2), 1, 1), (32, ty, 1),
                            (a.buffer, w.buffer, out.buffer), params)

    def folded_rmsnorm_matvec(self, x: GpuArray, weight: GpuArray, out: GpuArray, dim: int,
                              p: int, eps: float, swiglu: bool) -> None:
        """numpy_ref.folded_rmsnorm_matvec: one kernel for the gemv dtypes; float64 by the
        composed projections with a unit norm weight (rmsnorm, then the product)."""
        params = GEMV_PARAMS.pack(dim, p, eps)
        if x.dtype in GEMV_DTYPES and swiglu:
            self._gemv_pairs("gemv_glu_norm", x, weight, out, params, p)
        elif x.dtype in GEMV_DTYPES:
            self._gemv_rows("gemv_t_norm", x, weight, out, p, params)
        else:
            ones = self._new_array(dim, x.dtype)
            self.fill(ones, 1)
            compose = self.rmsnorm_matvec_swiglu if swiglu else self.rmsnorm_matvec
            compose(x, ones, weight, out, 1, dim, p, eps)

    def _gemv_add(self, a: GpuArray, weight: GpuArray, total: GpuArray, rows: int, dim: int,
                  p: int) -> bool:
        """matvec_add of one row by ``gemv_t_add`` (total[j] += the rounded product), where
        it applies (the backend's _fused_matvec_special asks)."""
        if not (rows == 1 and a.dtype in GEMV_DTYPES and not overlap(a.buffer, total.buffer)
                and not overlap(weight.buffer, total.buffer)):
            return False
        self._gemv_rows("gemv_t_add", a, weight, total, p, GEMV_PARAMS.pack(dim, p, 0.0))
        return True
