"""The decode step's fused projections (numpy_ref/decode.py) on every GPU.

Generic form: the separate kernels (rmsnorm, the matrix-vector product, swiglu, add), with
the same roundings as the definition. A device backend replaces a call with one fused
kernel through ``_fused_matvec_special`` (CUDA: ``cuda/kernels/decode.cu``).
"""

from __future__ import annotations

from .array import GpuArray
from .base import GpuBase


class DecodeOps(GpuBase):
    def _fused_matvec_special(self, kind: str, x: GpuArray, w: GpuArray | None,
                              weight: GpuArray, out: GpuArray, rows: int, dim: int, p: int,
                              eps: float) -> bool:
        """One fused kernel for ``kind`` ("rmsnorm", "rmsnorm_swiglu" or "add"), where the
        device has one for these sizes; False: the generic form runs instead."""
        return False

    def rmsnorm_matvec(self, x: GpuArray, w: GpuArray, weight: GpuArray, out: GpuArray,
                       rows: int, dim: int, p: int, eps: float) -> None:
        """out (rows, p) = rmsnorm(x) * w @ weight.T."""
        if self._fused_matvec_special("rmsnorm", x, w, weight, out, rows, dim, p, eps):
            return
        h = self._new_array(rows * dim, x.dtype)
        self.rmsnorm(x, w, h, dim, eps)
        self.matmul(h, weight, out, rows, dim, p, transpose_b=True)

    def rmsnorm_matvec_swiglu(self, x: GpuArray, w: GpuArray, weight: GpuArray,
                              out: GpuArray, rows: int, dim: int, p: int, eps: float) -> None:
        """out (rows, p) = silu(g) * u, [g | u] = rmsnorm(x) * w @ weight.T."""
        if self._fused_matvec_special("rmsnorm_swiglu", x, w, weight, out, rows, dim, p, eps):
            return
        h = self._new_array(rows * dim, x.dtype)
        self.rmsnorm(x, w, h, dim, eps)
        gate_up = self._new_array(rows * 2 * p, x.dtype)
        self.matmul(h, weight, gate_up, rows, dim, 2 * p, transpose_b=True)
        self.swiglu(gate_up, out, p)

    def matvec_add(self, a: GpuArray, weight: GpuArray, total: GpuArray, rows: int, dim: int,
                   p: int) -> None:
        """total (rows, p) += a @ weight.T (the product rounded first), in place."""
        if self._fused_matvec_special("add", a, None, weight, total, rows, dim, p, 0.0):
            return
        y = self._new_array(rows * p, a.dtype)
        self.matmul(a, weight, y, rows, dim, p, transpose_b=True)
        self.ewise_add(total, y, total)
