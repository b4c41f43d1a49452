"""Quantized weights (kernel file ``quant``; capabilities ``int8``/``int4``; the reference is
``numpy_ref/quant.py``, the packing docs/quantization.md).

Up to ``QMV_MAX_M`` rows of x (decoding, small batches) the packed matrix is read once per row
by ``qmv{bits}_*``, which dequantizes in registers; larger products (prefill) dequantize W
into a workspace of x's dtype and run the dtype's GEMM. A device may take a few rows in one
pass over W instead (``_quant_skinny_special``: a batched decode step), and many rows by a
GEMM that dequantizes W as it loads it (``_quant_gemm_special``: no workspace).
The decode step's fused projections with packed weights (``quant_rmsnorm_matvec``,
``quant_matvec_add``) are composed of the kernels above; a device replaces a call with one
fused kernel through ``_quant_matvec_special`` (CUDA: ``cuda/quant_decode.py``).
"""

from __future__ import annotations

import struct

from ...errors import DTypeError, ShapeError
from .array import SUFFIX, GpuArray, aligned16, cdiv
from .base import GpuBase

# quant.cu's QuantParams: m, n, k, words, groups, group, offsets, staged, group_shift
QUANT = struct.Struct("9q")
QMV_ROWS = 2  # rows of W per warp (quant.cu's QMV_ROWS)
QMV_WARPS = 4  # warps per group
QMV_MAX_M = 8
ACTIVATIONS = ("float16", "bfloat16", "float32")


def packed_buffers(inputs: tuple, qweight: GpuArray, scales: GpuArray,
                   offsets: GpuArray | None, out: GpuArray) -> tuple:
    """The buffers every packed-weight kernel takes (quant.cu, quant_skinny.cu,
    quant_decode.cu, quant_stream.cu, quant_gemm.cu): ``inputs`` (x, and the decode
    projections' norm weight), the packed words, the scales, the offsets (the scales again
    where there are none: the kernels without offsets never read it), out."""
    extra = (offsets if offsets is not None else scales).buffer
    return (*inputs, qweight.buffer, scales.buffer, extra, out.buffer)


class QuantOps(GpuBase):
    # whether the device's qmv kernels stage x in shared memory (quant.cu does, quant.metal
    # reads x directly); a device backend sets it
    qmv_staged_x = False

    def _quant_params(self, qweight, scales, offsets, m, n, k, bits, group_size, op, x=None):
        if bits not in (8, 4):
            raise ShapeError(f"{op}: bits must be 8 or 4, not {bits}")
        if group_size < 1:
            raise ShapeError(f"{op}: group_size must be positive, got {group_size}")
        words, groups = cdiv(k, 32 // bits), cdiv(k, group_size)
        if qweight.size != n * words or scales.size != n * groups \
                or (offsets is not None and offsets.size != n * groups):
            raise ShapeError(f"{op}: packed arrays do not match an ({n}, {k}) {bits}-bit matrix "
                             f"with groups of {group_size}")
        chunk = 128 // bits  # values in one 16-byte load of packed words
        staged = (self.qmv_staged_x and k % chunk == 0 and group_size % chunk == 0
                  and x is not None and aligned16(x.buffer))  # x read in 16-byte vectors
        shared = 4 * (k + k // chunk) if staged else 0
        if shared > self.device.max_shared_bytes:
            staged, shared = False, 0
        shift = group_shift(groups, group_size // chunk)
        params = QUANT.pack(m, n, k, words, groups, group_size, int(offsets is not None),
                            int(staged), shift)
        return params, shared

    def quant_matmul(self, x: GpuArray, qweight: GpuArray, scales: GpuArray,
                     offsets: GpuArray | None, out: GpuArray, m: int, n: int, k: int,
                     bits: int, group_size: int) -> None:
        """out (m, n) = x (m, k) @ W.T for a packed W (numpy_ref.quant_matmul)."""
        if x.dtype not in ACTIVATIONS:
            raise DTypeError(f"quant_matmul needs float16, bfloat16 or float32 x, not {x.dtype}")
        if out.size == 0:
            return
        params, shared = self._quant_params(qweight, scales, offsets, m, n, k, bits,
                                            group_size, "quant_matmul", x)
        if m > 1 and self._quant_skinny_special(x, qweight, scales, offsets, out, m, n, k,
                                                bits, group_size):
            return
        if m > QMV_MAX_M:
            if self._quant_gemm_special(x, qweight, scales, offsets, out, m, n, k, bits,
                                        group_size):
                return
            w = self._new_array(n * k, x.dtype)
            self.dequantize(qweight, scales, offsets, w, n, k, bits, group_size)
            self.matmul(x, w, out, m, k, n, transpose_b=True)
            return
        kern = self._kernel("quant", f"qmv{bits}_{SUFFIX[x.dtype]}")
        warps = max(1, min(QMV_WARPS, kern.max_threads // 32))
        groups = cdiv(n, QMV_ROWS * warps)
        if shared:
            kern.reserve_shared(shared)
        self.queue.dispatch(kern, (groups, m, 1), (32, warps, 1),
                            packed_buffers((x.buffer,), qweight, scales, offsets, out), params,
                            shared)

    def dequantize(self, qweight: GpuArray, scales: GpuArray, offsets: GpuArray | None,
                   out: GpuArray, n: int, k: int, bits: int, group_size: int) -> None:
        """out (n, k) = the packed matrix in out's dtype (numpy_ref.dequantize)."""
        if out.dtype not in ACTIVATIONS:
            raise DTypeError(f"dequantize writes float16, bfloat16 or float32, not {out.dtype}")
        if out.size == 0:
            return
        params, _ = self._quant_params(qweight, scales, offsets, n, n, k, bits, group_size,
                                       "dequantize")
        self._launch_1d(f"dequant{bits}_{SUFFIX[out.dtype]}", qweight.size,
                        packed_buffers((), qweight, scales, offsets, out), params, "quant")

    # --- the decode step's fused projections ------------------------------------------------
    def quant_rmsnorm_matvec(self, x: GpuArray, w: GpuArray, qweight: GpuArray,
                             scales: GpuArray, offsets: GpuArray | None, out: GpuArray,
                             rows: int, dim: int, p: int, eps: float, bits: int,
                             group_size: int, swiglu: bool) -> None:
        """out (rows, p) = rmsnorm(x) * w @ W.T (swiglu: silu(g) * u of W's 2p rows)."""
        kind = "rmsnorm_qmv_swiglu" if swiglu else "rmsnorm_qmv"
        if self._quant_matvec_special(kind, x, w, qweight, scales, offsets, out, rows, dim, p,
                                      eps, bits, group_size):
            return
        h = self._new_array(rows * dim, x.dtype)
        self.rmsnorm(x, w, h, dim, eps)
        n = 2 * p if swiglu else p
        y = self._new_array(rows * n, x.dtype) if swiglu else out
        self.quant_matmul(h, qweight, scales, offsets, y, rows, n, dim, bits, group_size)
        if swiglu:
            self.swiglu(y, out, p)

    def quant_matvec_add(self, a: GpuArray, qweight: GpuArray, scales: GpuArray,
                         offsets: GpuArray | None, total: GpuArray, rows: int, dim: int,
                         p: int, bits: int, group_size: int) -> None:
        """total (rows, p) += a @ W.T (the product rounded first), in place."""
        if self._quant_matvec_special("qmv_add", a, None, qweight, scales, offsets, total,
                                      rows, dim, p, 0.0, bits, group_size):
            return
        y = self._new_array(rows * p, a.dtype)
        self.quant_matmul(a, qweight, scales, offsets, y, rows, p, dim, bits, group_size)
        self.ewise_add(total, y, total)

    def _quant_skinny_special(self, x: GpuArray, qweight: GpuArray, scales: GpuArray,
                              offsets: GpuArray | None, out: GpuArray, m: int, n: int, k: int,
                              bits: int, group_size: int) -> bool:
        """A few rows (a batched decode step) in one pass over the packed matrix, where a
        device has such a kernel (CUDA: ``cuda/quant_skinny.py``); False: the forms above."""
        return False

    def _quant_gemm_special(self, x: GpuArray, qweight: GpuArray, scales: GpuArray,
                            offsets: GpuArray | None, out: GpuArray, m: int, n: int, k: int,
                            bits: int, group_size: int) -> bool:
        """Many rows (a prefill) with W dequantized as the GEMM loads it, where a device has
        such a kernel (CUDA on Hopper: ``cuda/quant_gemm.py``); False: W is dequantized into a
        workspace and the dtype's GEMM runs."""
        return False

    def _quant_matvec_special(self, kind: str, x: GpuArray, w: GpuArray | None,
                              qweight: GpuArray, scales: GpuArray, offsets: GpuArray | None,
                              out: GpuArray, rows: int, dim: int, p: int, eps: float,
                              bits: int, group_size: int) -> bool:
        """One fused kernel for ``kind`` ("rmsnorm_qmv", "rmsnorm_qmv_swiglu" or "qmv_add")
        where the device has one for these sizes; False: the composed form runs instead."""
        return False


def group_shift(groups: int, per_group: int) -> int:
    """log2 of the 16-byte chunks per group when a power of two (30: one group a row), else
    -1 (the kernels then divide)."""
    if groups == 1:
        return 30
    return per_group.bit_length() - 1 if per_group and per_group & (per_group - 1) == 0 else -1
