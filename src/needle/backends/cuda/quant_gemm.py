"""Prefill products with int8 / int4 weights on Hopper (``kernels/quant_gemm.cu``): out (m, n)
= x (m, k) @ W.T for more rows than the skinny kernels take, W dequantized in registers as the
warpgroup MMA's operand instead of into a workspace for the GEMM. fp16/bf16 x, k a multiple
of 64, groups of one row or of a power of two >= 16 values (four groups' scales a TMA box).
A tile is 128 weight rows by 128 tokens, or 256 tokens (``token_tile``: products of many
tiles) where each W tile's dequantized fragments then serve twice the tokens. With 128, int4
dequantized value by value takes 128 values of k a pipeline stage (``k_step``): half the
loop's bookkeeping a tensor-core instruction of 64-value steps.
The grid shares the k steps of all tiles out evenly (stream-K), so a product of fewer tiles
than multiprocessors keeps them all busy; a split tile's owner has the other groups' float32
parts copied into its pipeline while it runs its last stages.
Tuning ``quant_gemm`` (``NEEDLE_QUANT_GEMM``): "auto" (default) takes it for up to 256 rows,
up to 768 where each multiprocessor gets at least a 2,048-wide tile's k steps, and up to
2,048 where it takes 256-token tiles (``takes``). On the H100 at 512 tokens that is the 1.1B
layer's gate/up (256-token tiles, 1.07-1.09x the bf16 GEMM's time with int4 g128 against
the workspace form's 1.65x) and down products (1.26-1.27x against 1.57x; docs/cuda_notes.md
v37); its q/k/v and output products stay with the workspace form, which split tiles'
partial sums would cost more than they save.
More rows take the workspace form: the GEMM's higher MMA rate outweighs the dequantization,
which shrinks relative to it (docs/cuda_notes.md v31-v32, v36). "always" takes it wherever
it applies (tests), "off" never.
"""

from __future__ import annotations

import struct

from ...errors import DeviceError
from ..gpu.array import SUFFIX, GpuArray, cdiv
from ..gpu.quant import QuantOps, packed_buffers
from .memory import address
from .tensor_map import matrix_map, tiled

# QuantGemmParams: m, n, k, group_shift, flags, chunk, chunks
QUANT_GEMM = struct.Struct("7q")
ROWS, TOKENS, K_STEP = 128, 128, 64  # quant_gemm.cu's qg:: tile; K_STEP: the short k step
WIDE_STEP = 128  # the long k step (kernels "_k128")
WIDE_TOKENS = 256  # tokens a tile of the "_t256" kernels (dequantizing, 64-value steps)
STAGES = {(K_STEP, TOKENS): 6, (WIDE_STEP, TOKENS): 4,  # quant_gemm.cu's stages<KT, TK>()
          (K_STEP, WIDE_TOKENS): 5}
_PER_ROW = 1  # flags: one scale a row
MIN_SHARE = 512  # values of k: the least work a group gets
SPLIT = 3  # groups a tile at most (share_count)
AUTO_ROWS, AUTO_MAX_ROWS, AUTO_SHARE = 256, 768, 2048  # "auto": takes(); AUTO_SHARE in values
AUTO_WIDE_MAX_ROWS = 2048  # "auto" with 256 tokens a tile: takes()


def token_tile(m: int, n: int, sms: int) -> int:
    """Tokens a tile for an (m, k) @ (k, n) product on ``sms`` multiprocessors: WIDE_TOKENS
    where its tiles give every group one or more whole ones and pad m no further than 128
    would; TOKENS otherwise. A wide tile's dequantized fragments serve twice the tokens (the
    loop is bound by their instructions, not the MMAs), but its split tiles' partial sums are
    twice the bytes: measured on the H100 (docs/cuda_notes.md v36), 256 won on the 1.1B
    layer's gate/up product from 512 tokens (1.14x the bf16 GEMM's time, was 1.33x) and lost
    where tiles are fewer than multiprocessors (q/k/v, o, down at 512 tokens) or half empty
    (384 tokens)."""
    tiles = cdiv(m, WIDE_TOKENS) * cdiv(n, ROWS)
    padded_alike = 2 * cdiv(m, WIDE_TOKENS) == cdiv(m, TOKENS)
    return WIDE_TOKENS if padded_alike and tiles >= sms else TOKENS


def exact_form(bits: int, group_size: int, per_row: bool, offsets: bool, tk: int) -> bool:
    """Whether a product takes the exact form ("g" kernels: each group's integer products
    summed in float32 and scaled once, W's float32 values): symmetric groups of whole
    64-value k steps or one a row, but int4 only from groups of 128: int4 groups of 64 take
    the dequantizing form in 128-value steps, measured ~9% faster on the H100
    (docs/cuda_notes.md v35), with W's values rounded to x's dtype as the workspace form's.
    Never with 256 tokens a tile: its two sets of 128 sums would not fit the registers."""
    return tk == TOKENS and not offsets and (
        per_row or group_size >= (WIDE_STEP if bits == 4 else K_STEP))


def k_step(bits: int, k: int, group_size: int, per_row: bool, exact: bool, tk: int) -> int:
    """The kernel's k step: WIDE_STEP for int4 dequantized value by value (offsets, or
    symmetric groups of 32) where k is a multiple of it and a stage's groups fit the 4-group
    scale box (groups of 32 or more); K_STEP otherwise. Measured on the H100
    (docs/cuda_notes.md v35): the wide step was faster for those forms only (int8 and the
    exact form slower, the exact form's two sets of sums then spilling). 256 tokens a tile
    take 64-value steps (a stage of 128 would leave room for two)."""
    wide = (bits == 4 and not exact and tk == TOKENS and k % WIDE_STEP == 0
            and (per_row or group_size >= 32))
    return WIDE_STEP if wide else K_STEP


def shared_bytes(bits: int, kt: int, tk: int) -> int:
    """Dynamic shared memory of a launch with k steps of ``kt`` and ``tk`` tokens a tile: the
    stages (x's boxes, the rows' packed words, 4 scales and 4 offsets a row), two mbarriers a
    stage, alignment."""
    stage = tk * kt * 2 + ROWS * kt * bits // 8 + 2 * ROWS * 16
    return STAGES[kt, tk] * (stage + 16) + 1024


def accumulators(tk: int) -> int:
    """Bytes of a tile's float32 sums (a shared tile's partial, one slot a group)."""
    return 4 * ROWS * tk


def kernel_name(bits: int, dtype: str, offsets: bool, exact: bool, kt: int, tk: int) -> str:
    """quant_gemm.cu's kernel: "o" with offsets, "g" summing each group exactly and scaling
    it once; "_k128" with 128-value k steps, "_t256" with 256 tokens a tile."""
    mode = "o" if offsets else "g" if exact else ""
    wide = "_k128" if kt == WIDE_STEP else "_t256" if tk == WIDE_TOKENS else ""
    return f"qgemm{bits}{mode}{wide}_{SUFFIX[dtype]}"


def share_count(tiles: int, chunks: int, chunk: int, sms: int, kt: int) -> int:
    """Groups of a launch: one a multiprocessor, each taking an equal share of the tiles'
    chunks (``chunks`` a tile, ``chunk`` k steps of ``kt`` each), but at least MIN_SHARE
    values of k (or a whole tile) each and at most SPLIT groups a tile, so that no tile is
    split in more than SPLIT + 1 partial sums (4, 6 or 9 groups measured no faster on the
    down product: docs/cuda_notes.md v36)."""
    work = tiles * chunks
    least = max(1, min(chunks, cdiv(MIN_SHARE, chunk * kt)))  # chunks
    return max(1, min(sms, SPLIT * tiles, work // least))


def takes(m: int, tiles: int, k: int, grid: int, tk: int) -> bool:
    """"auto"'s rule for m rows in ``tiles`` tiles of ``tk`` tokens with k values each, over
    ``grid`` groups: up to AUTO_ROWS rows always; up to AUTO_MAX_ROWS where each group's
    share is at least AUTO_SHARE values of k (a 2,048-wide tile; 256-token tiles always give
    a group a whole one: token_tile): measured on the H100, below that a 512-token product's
    split tiles cost more than the workspace form's dequantization; up to AUTO_WIDE_MAX_ROWS
    with 256-token tiles, two or more a group (the 1.1B gate/up product at 2,048 tokens 1.14x
    the bf16 GEMM's time, the workspace form 1.19x; its q/k/v product, 1.2 tiles a group,
    1.58x against 1.22x: docs/cuda_notes.md v36)."""
    if m <= AUTO_ROWS or (m <= AUTO_MAX_ROWS and tiles * k >= AUTO_SHARE * grid):
        return True
    return tk == WIDE_TOKENS and m <= AUTO_WIDE_MAX_ROWS and tiles >= 2 * grid


class QuantGemmOps(QuantOps):
    def _quant_gemm_special(self, x: GpuArray, qweight: GpuArray, scales: GpuArray,
                            offsets: GpuArray | None, out: GpuArray, m: int, n: int, k: int,
                            bits: int, group_size: int) -> bool:
        """out (m, n) = x (m, k) @ W.T by quant_gemm.cu where it applies."""
        groups = cdiv(k, group_size)
        per_row = groups == 1
        shift = group_size.bit_length() - 1
        mode = self.tuning.quant_gemm
        if mode == "off" or (mode == "auto" and m > AUTO_WIDE_MAX_ROWS):
            return False
        # sm_90a kernels (elsewhere they trap); out takes 4-byte stores of two values
        if not (self.tuning.tma and address(out) % 4 == 0
                and x.dtype in ("float16", "bfloat16") and k > 0 and k % K_STEP == 0
                and (per_row or (group_size >= 16 and group_size == 1 << shift
                                 and groups % 4 == 0))):
            return False
        # each group's integer products summed exactly and scaled once, or each value
        # dequantized as dequant{8,4}
        sms = self.device.compute_units
        tk = token_tile(m, n, sms)
        exact = exact_form(bits, group_size, per_row, offsets is not None, tk)
        kt = k_step(bits, k, group_size, per_row, exact, tk)
        tiles = cdiv(m, tk) * cdiv(n, ROWS)
        chunk = group_size // kt if exact and not per_row else 1  # k steps shared out
        chunks = k // kt // chunk
        grid = share_count(tiles, chunks, chunk, sms, kt)
        if mode == "auto" and not takes(m, tiles, k, grid, tk):
            return False
        shared = shared_bytes(bits, kt, tk)
        if shared > self.device.max_shared_bytes:
            return False
        maps = self._quant_gemm_maps(x, qweight, scales, offsets, m, n, k, bits, groups, kt,
                                     tk)
        if maps is None:
            return False
        kern = self._kernel("quant_gemm",
                            kernel_name(bits, x.dtype, offsets is not None, exact, kt, tk))
        kern.check_threads(384)
        kern.reserve_shared(shared)
        # partial sums of the tiles that groups share (one a group at most), if any
        shared_tiles = (tiles * chunks) % grid or (tiles * chunks // grid) % chunks
        partials = self._workspace(grid * accumulators(tk)) if shared_tiles else out.buffer
        params = QUANT_GEMM.pack(m, n, k, 0 if per_row else shift, _PER_ROW if per_row else 0,
                                 chunk, chunks)
        self.queue.dispatch(kern, (grid, 1, 1), (384, 1, 1),
                            (*packed_buffers((x.buffer,), qweight, scales, offsets, out),
                             partials, self._counters(tiles)),
                            params, shared, raw_args=maps)
        return True

    @staticmethod
    def _quant_gemm_maps(x, qweight, scales, offsets, m, n, k, bits, groups, kt, tk):
        """The kernel's four tensor maps (x in boxes of 64 values, a k step's packed words,
        scales, offsets; the scales' again without offsets), or None where TMA cannot
        describe an operand (an unaligned buffer: the generic form runs)."""
        words = k * bits // 32
        try:
            map_x = matrix_map(x.dtype, address(x), m, k, 1, 0, tk, K_STEP)
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
