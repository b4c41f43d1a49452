"""How many slices of K a float32 product with few output tiles is split into.

The SIMT float32 GEMM (matmul.cu) runs one 128 x 128 tile per SM (167 registers a thread:
one group of 256 threads fits), so a product with fewer tiles than SMs leaves SMs idle.
Splitting K over ``s`` groups a tile fills them, at a price: each group writes a float32
slab of the whole output and a column sum (``reduce_wide``) adds the ``s`` slabs. The plan
below picks the ``s`` whose estimated time, whole waves of groups plus the slabs' traffic,
is least. A 4096 x 512 x 512 product (128 tiles on 132 SMs) is then not split: two waves of
half-length groups take as long as one wave of whole ones, and the sum comes on top
(H100: 72.3 us split in two, 58-61 us whole; docs/cuda_notes.md v18).
"""

from __future__ import annotations

from functools import lru_cache

from ..gpu.array import cdiv

K_STEP = 16  # the kernel's k tile: a slice's length is a multiple of it
MIN_SLICE = 256  # shorter slices spend more on the prologue and the slab than they save
# Cost model (H100, the SIMT kernel at ~40 TFLOP/s): one group's time per k step of its
# 128 x 128 tile, and the slabs' memory traffic (written by the groups, read by the sum,
# plus the sum's output) at the copy rate with one more launch.
_US_PER_K = 2 * 128 * 128 / 0.30e6
_BYTES_PER_US = 2.5e6
_SUM_LAUNCH_US = 4.0


def estimated_us(tiles: int, m: int, n: int, p: int, batch: int, splits: int,
                 groups_at_once: int) -> float:
    """The product's estimated time split into ``splits`` slices (1: not split)."""
    chunk = cdiv(cdiv(n, splits), K_STEP) * K_STEP
    waves = cdiv(tiles * splits, groups_at_once)
    us = waves * chunk * _US_PER_K
    if splits > 1:
        us += (2 * splits + 1) * batch * m * p * 4 / _BYTES_PER_US + _SUM_LAUNCH_US
    return us


# kept: a training step asks for the same shapes every step, and a long k tries many splits
# (2^20: 4096 of them, ~2 ms of host time once)
@lru_cache(maxsize=4096)
def split_k_plan(tiles: int, m: int, n: int, p: int, batch: int,
                 groups_at_once: int) -> tuple[int, int]:
    """(splits, chunk): the number of K slices with the least estimated time and each
    slice's length (a multiple of K_STEP; the last may be shorter). (1, n): don't split."""
    best, best_us = 1, estimated_us(tiles, m, n, p, batch, 1, groups_at_once)
    for splits in range(2, max(n // MIN_SLICE, 1) + 1):
        us = estimated_us(tiles, m, n, p, batch, splits, groups_at_once)
        if us < best_us * 0.97:  # a smaller split unless the larger is clearly faster
            best, best_us = splits, us
    if best == 1:
        return 1, n
    chunk = cdiv(cdiv(n, best), K_STEP) * K_STEP
    return cdiv(n, chunk), chunk
