"""One-row products on CUDA (``kernels/matmul.cu``'s gemv family): a decode step's
projections, a warp per output row, bandwidth-bound.

``gemv_glu``: ``matmul_swiglu`` of one row. A pair of warps reads the gate and up rows of
each output (each warp reads its row as gemv_t does) and the first writes silu(gate) * up,
so a decode step has no 2 x intermediate-wide product in memory and no separate SwiGLU
launch; the numbers are those of the product then ``swiglu`` (each product rounded first).
"""

from __future__ import annotations

from ..gpu.array import MATMUL, SUFFIX, GpuArray, cdiv
from ..gpu.matmul import GEMV_DTYPES, MatmulOps

__all__ = ["GEMV_DTYPES", "GemvOps"]


class GemvOps(MatmulOps):
    def _gemv_glu(self, a: GpuArray, w: GpuArray, out: GpuArray, n: int, p: int) -> None:
        """out (p,) = silu(a @ w[:p].T) * (a @ w[p:].T) for one row a (n,), w (2p, n)."""
        k = self._kernel("matmul", f"gemv_glu_{SUFFIX[a.dtype]}")
        ty = max(2, min(4, k.max_threads // 32))  # groups of 4 warps: 2 outputs, a warp a row
        self.queue.dispatch(k, (cdiv(p, ty // 2), 1, 1), (32, ty, 1),
                            (a.buffer, w.buffer, out.buffer),
                            MATMUL.pack(1, n, p, 1, 0, 0, 0, 1, 1, n))
