"""Products of a few rows with int8 / int4 weights in one pass over the weights
(``kernels/quant_skinny.cu``): 2..16 rows of x (a batched decode step's tokens) on tensor
cores, W dequantized in registers and read once, where ``gpu/quant.py``'s qmv reads it once
per row (and from 9 rows dequantizes all of W first). fp16/bf16 x; int8 in groups of a
multiple of 16 values (per channel, GGUF Q8_0, Q5_K, Q6_K) and int4 in groups of a multiple
of 32 (g64, g128, GGUF Q4_0, Q4_K), with or without offsets; k a multiple of the group's
unit. Each lane loads ``_load_width`` words of a weight row at once (16 bytes where the
groups allow), x is read through L1, and 4 to 16 warps of a block share its 8 rows' k.
Other calls take the generic forms. docs/quantization.md describes it, docs/cuda_notes.md
v51 how it was measured.
"""

from __future__ import annotations

import struct

from ..gpu.array import SUFFIX, GpuArray, aligned16, cdiv
from ..gpu.quant import QuantOps, packed_buffers

# QuantSkinnyParams: m, n, k, words, groups, group, has_offsets
QUANT_SKINNY = struct.Struct("7q")
ROWS = 8  # weight rows a block owns (qskw::ROWS)
MAX_ROWS = 16  # rows of x a launch takes
WORD_WARPS = 16  # most warps a block (quant_skinny.cu QSKW_THREADS / 32)


class QuantSkinnyOps(QuantOps):
    def _quant_skinny_special(self, x: GpuArray, qweight: GpuArray, scales: GpuArray,
                              offsets: GpuArray | None, out: GpuArray, m: int, n: int, k: int,
                              bits: int, group_size: int) -> bool:
        """out (m, n) = x (m, k) @ W.T for 2..16 rows, W read once, where it applies."""
        if not (self.tuning.quant_skinny and 2 <= m <= MAX_ROWS
                and x.dtype in ("float16", "bfloat16") and aligned16(x.buffer)
                and aligned16(qweight.buffer)):
            return False
        tokens = 8 if m <= 8 else 16
        width = _load_width(bits, k, group_size)
        if width == 0:
            return False
        return self._skinny_launch(x, qweight, scales, offsets, out, m, n, k, bits, group_size,
                                  tokens, width)

    def _skinny_launch(self, x, qweight, scales, offsets, out, m, n, k, bits, group_size,
                      tokens, width) -> bool:
        """``qmm{bits}w{width}_tc*``, ``width`` words a lane's load; warps a block doubled
        (4 to WORD_WARPS) while the grid has fewer than 16 warps a multiprocessor and each
        keeps 2 sets (False where the block's scales do not fit in shared memory)."""
        groups, blocks = cdiv(k, group_size), cdiv(n, ROWS)
        sets = k // (4 * width * 32 // bits)
        warps = 4
        while (warps < WORD_WARPS and blocks * warps < 16 * self.device.compute_units
               and sets >= 4 * warps):
            warps *= 2
        tables = (2 if offsets is not None else 1) * ROWS * groups
        shared = 4 * (tables + warps * tokens * ROWS)
        if shared > self.device.max_shared_bytes:
            return False
        kern = self._kernel("quant_skinny", f"qmm{bits}w{width}_tc{tokens}_{SUFFIX[x.dtype]}")
        warps = min(warps, kern.max_threads // 32)
        kern.reserve_shared(shared)
        params = QUANT_SKINNY.pack(m, n, k, k * bits // 32, groups, group_size,
                                   int(offsets is not None))
        self.queue.dispatch(kern, (cdiv(n, ROWS), 1, 1), (32 * warps, 1, 1),
                            packed_buffers((x.buffer,), qweight, scales, offsets, out), params,
                            shared)
        return True


def _load_width(bits: int, k: int, group_size: int) -> int:
    """Words a lane of qmm*w* loads at once: the most (4, 2, 1) whose set (4 lanes' loads:
    16 x width int8 or 32 x width int4 values) lies in one group and tiles k; 0: none (int8
    groups of other than a multiple of 16, int4 of 32)."""
    for width in (4, 2, 1):
        values = 4 * width * 32 // bits
        if group_size % values == 0 and k % values == 0:
            return width
    return 0
