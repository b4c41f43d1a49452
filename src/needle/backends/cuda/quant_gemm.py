"""Prefill products with int8 / int4 weights on Hopper (``kernels/quant_gemm.cu``): out (m, n)
= x (m, k) @ W.T for more rows than the skinny kernels take, W dequantized in registers as the
warpgroup MMA's operand instead of into a workspace for the GEMM. fp16/bf16 x, k a multiple
of 64, groups of one row or of a power of two >= 16 values (four groups' scales a TMA box);
other calls take the generic form. Opt-in (``NEEDLE_QUANT_GEMM=1``, tuning ``quant_gemm``):
on the H100 it is still slower than the workspace form on a 1.1B layer's shapes
(docs/cuda_notes.md v31 says where its time goes).
"""

from __future__ import annotations

import struct

from ...errors import DeviceError
from ..gpu.array import SUFFIX, GpuArray, cdiv
from ..gpu.quant import QuantOps
from .tensor_map import tiled

# QuantGemmParams: m, n, k, group_shift, flags
QUANT_GEMM = struct.Struct("5q")
ROWS, K_STEP, STAGES = 128, 64, 6  # quant_gemm.cu's qg:: constants
_PER_ROW = 1  # flags: one scale a row


def shared_bytes(bits: int, tokens: int) -> int:
    """Dynamic shared memory of a launch: the stages (x's box, the rows' packed words, 4
    scales and 4 offsets a row), two mbarriers a stage, alignment."""
    stage = tokens * K_STEP * 2 + ROWS * K_STEP * bits // 8 + 2 * ROWS * 16
    return STAGES * (stage + 16) + 1024


def kernel_name(bits: int, dtype: str, offsets: bool, exact: bool, tokens: int) -> str:
    """quant_gemm.cu's kernel: "o" with offsets, "g" summing each group exactly and scaling
    it once, "_t64" for tiles of 64 tokens."""
    mode = "o" if offsets else "g" if exact else ""
    return f"qgemm{bits}{mode}{'' if tokens == 128 else '_t64'}_{SUFFIX[dtype]}"


class QuantGemmOps(QuantOps):
    def _quant_gemm_special(self, x: GpuArray, qweight: GpuArray, scales: GpuArray,
                            offsets: GpuArray | None, out: GpuArray, m: int, n: int, k: int,
                            bits: int, group_size: int) -> bool:
        """out (m, n) = x (m, k) @ W.T by quant_gemm.cu where it applies."""
        groups = cdiv(k, group_size)
        per_row = groups == 1
        shift = group_size.bit_length() - 1
        if not (self.tuning.quant_gemm and x.dtype in ("float16", "bfloat16") and k % K_STEP == 0
                and (per_row or (group_size >= 16 and group_size == 1 << shift
                                 and groups % 4 == 0))):
            return False
        # 128-token tiles, or 64 where those would leave multiprocessors idle
        tokens = 128 if cdiv(m, 128) * cdiv(n, ROWS) >= self.device.compute_units else 64
        shared = shared_bytes(bits, tokens)
        if shared > self.device.max_shared_bytes:
            return False
        maps = self._quant_gemm_maps(x, qweight, scales, offsets, m, n, k, bits, groups, tokens)
        if maps is None:
            return False
        # symmetric groups of whole k steps (or one a row): each group's integer products
        # summed exactly and scaled once; otherwise each value dequantized as dequant{8,4}
        exact = offsets is None and (per_row or group_size >= K_STEP)
        kern = self._kernel("quant_gemm", kernel_name(bits, x.dtype, offsets is not None,
                                                      exact, tokens))
        kern.check_threads(384)
        kern.reserve_shared(shared)
        tiles = cdiv(m, tokens) * cdiv(n, ROWS)
        params = QUANT_GEMM.pack(m, n, k, 0 if per_row else shift, _PER_ROW if per_row else 0)
        extra = (offsets if offsets is not None else scales).buffer
        self.queue.dispatch(kern, (min(tiles, self.device.compute_units), 1, 1), (384, 1, 1),
                            (x.buffer, qweight.buffer, scales.buffer, extra, out.buffer),
                            params, shared, raw_args=maps)
        return True

    @staticmethod
    def _quant_gemm_maps(x, qweight, scales, offsets, m, n, k, bits, groups, tokens):
        """The kernel's four tensor maps (x, packed words, scales, offsets; the scales' again
        without offsets), or None where TMA cannot describe an operand (an unaligned
        buffer: the generic form runs)."""
        def at(a: GpuArray) -> int:
            return a.buffer.handle + a.buffer.offset

        words = k * bits // 32
        try:
            map_x = tiled(x.dtype, at(x), (k, m, 1), (k * 2, m * k * 2), (K_STEP, tokens, 1))
            map_w = tiled("int32", at(qweight), (words, n, 1), (words * 4, n * words * 4),
                          (K_STEP * bits // 32, ROWS, 1), 0)

            def table(a: GpuArray) -> bytes:
                if groups == 1:  # one value a row: a box of 128 rows (the unit dims'
                    # strides address nothing but must be multiples of 16)
                    unit = 16 * cdiv(n * 4, 16)
                    return tiled("float32", at(a), (n, 1, 1), (unit, unit), (ROWS, 1, 1), 0)
                return tiled("float32", at(a), (groups, n, 1), (groups * 4, n * groups * 4),
                             (4, ROWS, 1), 0)

            map_s = table(scales)
            map_o = table(offsets) if offsets is not None else map_s
        except DeviceError:
            return None
        return map_x, map_w, map_s, map_o
