"""Products of a few rows with int4 weights in one pass over the weights
(``kernels/quant_skinny.cu``): 2..16 rows of x (a batched decode step's tokens) on tensor
cores, W dequantized in registers and read once, where ``gpu/quant.py``'s qmv reads it once
per row (and from 9 rows dequantizes all of W first). fp16/bf16 x, int4 groups of a
multiple of 64, k a multiple of 64; other calls take the generic forms. docs/quantization.md
describes it, docs/cuda_notes.md v14 how it was measured.
"""

from __future__ import annotations

import struct

from ..gpu.array import SUFFIX, GpuArray, aligned16, cdiv
from ..gpu.quant import QuantOps

# QuantSkinnyParams: m, n, k, words, groups, group, has_offsets
QUANT_SKINNY = struct.Struct("7q")
ROWS, WARPS = 8, 4  # weight rows a block owns, its warps (qsk::ROWS, qsk::WARPS)
MAX_ROWS = 16  # rows of x a launch takes


class QuantSkinnyOps(QuantOps):
    def _quant_skinny_special(self, x: GpuArray, qweight: GpuArray, scales: GpuArray,
                              offsets: GpuArray | None, out: GpuArray, m: int, n: int, k: int,
                              bits: int, group_size: int) -> bool:
        """out (m, n) = x (m, k) @ W.T for 2..16 rows, W read once, where it applies."""
        if not (self.tuning.quant_skinny and bits == 4 and 2 <= m <= MAX_ROWS
                and x.dtype in ("float16", "bfloat16") and k % 64 == 0
                and group_size % 64 == 0 and aligned16(x.buffer) and aligned16(qweight.buffer)):
            return False
        tokens = 8 if m <= 8 else 16
        groups = cdiv(k, group_size)
        tables = (2 if offsets is not None else 1) * ROWS * groups
        sums = tokens * groups if offsets is not None else 0
        shared = tokens * k * 2 + 4 * (tables + sums + WARPS * tokens * ROWS)
        if shared > self.device.max_shared_bytes:
            return False
        kern = self._kernel("quant_skinny", f"qmm4_tc{tokens}_{SUFFIX[x.dtype]}")
        kern.check_threads(32 * WARPS)
        kern.reserve_shared(shared)
        params = QUANT_SKINNY.pack(m, n, k, k // 8, groups, group_size,
                                   int(offsets is not None))
        extra = (offsets if offsets is not None else scales).buffer
        self.queue.dispatch(kern, (cdiv(n, ROWS), 1, 1), (32 * WARPS, 1, 1),
                            (x.buffer, qweight.buffer, scales.buffer, extra, out.buffer),
                            params, shared)
        return True
