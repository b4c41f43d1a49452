"""Prefill products with int8 / int4 weights on Hopper (``kernels/quant_gemm.cu``): out (m, n)
= x (m, k) @ W.T for more rows than the skinny kernels take, W dequantized in registers as the
warpgroup MMA's operand instead of into a workspace for the GEMM. fp16/bf16 x, k a multiple
of 64, groups of one row or of a power of two >= 16 values (four groups' scales a TMA box).
Int4 dequantized value by value takes 128 values of k a pipeline stage (``k_step``): half
the loop's bookkeeping a tensor-core instruction of 64-value steps.
The grid shares the k steps of all tiles out evenly (stream-K), so a product of fewer tiles
than multiprocessors keeps them all busy.
Tuning ``quant_gemm`` (``NEEDLE_QUANT_GEMM``): "auto" (default) takes it for up to 256 rows,
and up to 768 where each multiprocessor gets at least a 2,048-wide tile's k steps (on the
H100 at 512 tokens: the 1.1B layer's gate/up and down products, 1.27x and 1.36x the bf16
GEMM's time before its 176-wide tiles, against the workspace form's 1.60x and 1.56x; its
q/k/v and output products stay with the workspace, which split tiles' partial sums would
cost more than they save).
More rows take the workspace form: the GEMM's higher MMA rate outweighs the dequantization,
which shrinks relative to it (docs/cuda_notes.md v31-v32). "always" takes it wherever it
applies (tests), "off" never.
"""

from __future__ import annotations

import struct

from ...errors import DeviceError
from ..gpu.array import SUFFIX, GpuArray, cdiv
from ..gpu.quant import QuantOps
from .memory import address
from .tensor_map import matrix_map, tiled

# QuantGemmParams: m, n, k, group_shift, flags, chunk, chunks
QUANT_GEMM = struct.Struct("7q")
ROWS, TOKENS, K_STEP = 128, 128, 64  # quant_gemm.cu's qg:: tile; K_STEP: the short k step
WIDE_STEP = 128  # the long k step (kernels "_k128")
STAGES = {K_STEP: 6, WIDE_STEP: 4}  # quant_gemm.cu's stages<KT>()
_PER_ROW = 1  # flags: one scale a row
ACCUMULATORS = 4 * 128 * 128  # bytes of a tile's float32 sums (a shared tile's partial)
MIN_SHARE = 512  # values of k: the least work a group gets
AUTO_ROWS, AUTO_MAX_ROWS, AUTO_SHARE = 256, 768, 2048  # "auto": takes(); AUTO_SHARE in values


def exact_form(bits: int, group_size: int, per_row: bool, offsets: bool) -> bool:
    """Whether a product takes the exact form ("g" kernels: each group's integer products
    summed in float32 and scaled once, W's float32 values): symmetric groups of whole
    64-value k steps or one a row, but int4 only from groups of 128: int4 groups of 64 take
    the dequantizing form in 128-value steps, measured ~9% faster on the H100
    (docs/cuda_notes.md v35), with W's values rounded to x's dtype as the workspace form's."""
    return not offsets and (per_row or group_size >= (WIDE_STEP if bits == 4 else K_STEP))


def k_step(bits: int, k: int, group_size: int, per_row: bool, exact: bool) -> int:
    """The kernel's k step: WIDE_STEP for int4 dequantized value by value (offsets, or
    symmetric groups of 32) where k is a multiple of it and a stage's groups fit the 4-group
    scale box (groups of 32 or more); K_STEP otherwise. Measured on the H100
    (docs/cuda_notes.md v35): the wide step was faster for those forms only (int8 and the
    exact form slower, the exact form's two sets of sums then spilling)."""
    wide = bits == 4 and not exact and k % WIDE_STEP == 0 and (per_row or group_size >= 32)
    return WIDE_STEP if wide else K_STEP


def shared_bytes(bits: int, kt: int) -> int:
    """Dynamic shared memory of a launch with k steps of ``kt``: the stages (x's boxes, the
    rows' packed words, 4 scales and 4 offsets a row), two mbarriers a stage, alignment."""
    stage = TOKENS * kt * 2 + ROWS * kt * bits // 8 + 2 * ROWS * 16
    return STAGES[kt] * (stage + 16) + 1024


def kernel_name(bits: int, dtype: str, offsets: bool, exact: bool, kt: int) -> str:
    """quant_gemm.cu's kernel: "o" with offsets, "g" summing each group exactly and scaling
    it once; "_k128" with 128-value k steps."""
    mode = "o" if offsets else "g" if exact else ""
    wide = "_k128" if kt == WIDE_STEP else ""
    return f"qgemm{bits}{mode}{wide}_{SUFFIX[dtype]}"


def share_count(tiles: int, chunks: int, chunk: int, sms: int, kt: int) -> int:
    """Groups of a launch: one a multiprocessor, each taking an equal share of the tiles'
    chunks (``chunks`` a tile, ``chunk`` k steps of ``kt`` each), but at least MIN_SHARE
    values of k (or a whole tile) each and at most 3 groups a tile, so that no tile is split
    in more than 4 partial sums."""
    work = tiles * chunks
    least = max(1, min(chunks, cdiv(MIN_SHARE, chunk * kt)))  # chunks
    return max(1, min(sms, 3 * tiles, work // least))


def takes(m: int, work: int, grid: int) -> bool:
    """"auto"'s rule for m rows and ``work`` values of k summed over the 128 x 128 tiles, over
    ``grid`` groups: up to AUTO_ROWS rows always, up to AUTO_MAX_ROWS where each group's share
    is at least AUTO_SHARE values (a 2,048-wide tile): measured on the H100, below that a
    512-token product's split tiles cost more than the workspace form's dequantization."""
    return m <= AUTO_ROWS or (m <= AUTO_MAX_ROWS and work >= AUTO_SHARE * grid)


class QuantGemmOps(QuantOps):
    def _quant_gemm_special(self, x: GpuArray, qweight: GpuArray, scales: GpuArray,
                            offsets: GpuArray | None, out: GpuArray, m: int, n: int, k: int,
                            bits: int, group_size: int) -> bool:
        """out (m, n) = x (m, k) @ W.T by quant_gemm.cu where it applies."""
        groups = cdiv(k, group_size)
        per_row = groups == 1
        shift = group_size.bit_length() - 1
        mode = self.tuning.quant_gemm
        if mode == "off" or (mode == "auto" and m > AUTO_MAX_ROWS):
            return False
        # sm_90a kernels (elsewhere they trap); out takes 4-byte stores of two values
        if not (self.tuning.tma and address(out) % 4 == 0
                and x.dtype in ("float16", "bfloat16") and k > 0 and k % K_STEP == 0
                and (per_row or (group_size >= 16 and group_size == 1 << shift
                                 and groups % 4 == 0))):
            return False
        # each group's integer products summed exactly and scaled once, or each value
        # dequantized as dequant{8,4}
        exact = exact_form(bits, group_size, per_row, offsets is not None)
        kt = k_step(bits, k, group_size, per_row, exact)
        tiles = cdiv(m, TOKENS) * cdiv(n, ROWS)
        chunk = group_size // kt if exact and not per_row else 1  # k steps shared out
        chunks = k // kt // chunk
        grid = share_count(tiles, chunks, chunk, self.device.compute_units, kt)
        if mode == "auto" and not takes(m, tiles * k, grid):
            return False
        shared = shared_bytes(bits, kt)
        if shared > self.device.max_shared_bytes:
            return False
        maps = self._quant_gemm_maps(x, qweight, scales, offsets, m, n, k, bits, groups, kt)
        if maps is None:
            return False
        kern = self._kernel("quant_gemm",
                            kernel_name(bits, x.dtype, offsets is not None, exact, kt))
        kern.check_threads(384)
        kern.reserve_shared(shared)
        # partial sums of the tiles that groups share (one a group at most), if any
        shared_tiles = (tiles * chunks) % grid or (tiles * chunks // grid) % chunks
        partials = self._workspace(grid * ACCUMULATORS) if shared_tiles else out.buffer
        params = QUANT_GEMM.pack(m, n, k, 0 if per_row else shift, _PER_ROW if per_row else 0,
                                 chunk, chunks)
        extra = (offsets if offsets is not None else scales).buffer
        self.queue.dispatch(kern, (grid, 1, 1), (384, 1, 1),
                            (x.buffer, qweight.buffer, scales.buffer, extra, out.buffer,
                             partials, self._counters(tiles)),
                            params, shared, raw_args=maps)
        return True

    @staticmethod
    def _quant_gemm_maps(x, qweight, scales, offsets, m, n, k, bits, groups, kt):
        """The kernel's four tensor maps (x in boxes of 64 values, a k step's packed words,
        scales, offsets; the scales' again without offsets), or None where TMA cannot
        describe an operand (an unaligned buffer: the generic form runs)."""
        words = k * bits // 32
        try:
            map_x = matrix_map(x.dtype, address(x), m, k, 1, 0, TOKENS, K_STEP)
            map_w = matrix_map("int32", address(qweight), n, words, 1, 0, ROWS,
                               kt * bits // 32, swizzle=0)

            def table(a: GpuArray) -> bytes:
                if groups == 1:  # one value a row: a box of 128 rows (the unit dims'
                    # strides address nothing but must be multiples of 16)
                    unit = 16 * cdiv(n * 4, 16)
                    return tiled("float32", address(a), (n, 1, 1), (unit, unit), (ROWS, 1, 1),
                                 0)
                return matrix_map("float32", address(a), n, groups, 1, 0, ROWS, 4, swizzle=0)

            map_s = table(scales)
            map_o = table(offsets) if offsets is not None else map_s
        except DeviceError:
            return None
        return map_x, map_w, map_s, map_o
