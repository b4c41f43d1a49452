"""Reductions over the middle axis of a compact (outer, reduce_size, inner) array (kernel
file ``reduce``): rows when inner == 1, columns otherwise, split over more groups (and
combined by a second launch) when few groups would each walk a long reduction; a few rows
of many columns (split-K slabs, summed gradients) a thread per output where the kernel file
has it (``reduce_wide``)."""

from __future__ import annotations

from ...errors import DTypeError
from .array import ALL, MAX_GRID_YZ, REDUCE, SMALL_INTS, SUFFIX, GpuArray, cdiv
from .base import GpuBase

# bytes of one accumulator per (op, dtype) (float64 and integer sums accumulate in 8 bytes)
_ACC_BYTES = {}
for _dt in ALL:
    _ACC_BYTES[("sum", _dt)] = 8 if _dt in ("float64", "int32", "int64", "bool") else 4
    for _op in ("max", "min", "argmax"):
        _ACC_BYTES[(_op, _dt)] = 8 if _dt in ("float64", "int64") else 4

# values a warp takes of a long row split over groups: 512 are 2 rounds of 16-byte loads for
# 2-byte values, so a 32k-token row of logits is 63 warps. H100, one (1, 32000) bfloat16 row
# in a graph, argmax / sum: 13.3 / 3.9 us with 4096, 6.8 / 2.9 with 1024, 4.1 / 2.5 with 512
_ROW_CHUNK = 512
# rows of a column a warp takes at least, when a short, wide sum is split over groups: a
# training step's bias gradients, (4096, 512) summed over its rows, were 16 groups on 16 of
# 132 multiprocessors (splits needed 256 rows a warp)
_COL_ROWS = 16
# columns of at most _WIDE_ROWS rows and at least _WIDE_OUTPUTS outputs take reduce_wide
_WIDE_ROWS = 64
_WIDE_OUTPUTS = 1 << 16


class ReduceOps(GpuBase):
    # whether the kernel file has reduce_wide_* (a thread per output: reduce.cu and
    # reduce.metal do)
    wide_column_reduce = False

    def _reduce(self, op: str, a: GpuArray, out: GpuArray, outer: int, reduce_size: int,
                inner: int) -> None:
        if a.dtype in SMALL_INTS:
            self._reduce_small(op, a, out, outer, reduce_size, inner)
            return
        if op != "sum" and op != "argmax" and a.dtype == "bool":
            raise DTypeError(f"reduce_{op} is not defined for bool arrays on the GPU")
        sfx = SUFFIX[a.dtype]
        acc = _ACC_BYTES[(op, a.dtype)]
        cu = self.device.compute_units
        if inner == 1:
            k = self._kernel("reduce", f"reduce_rows_{op}_{sfx}")
            ty = max(1, min(8, k.max_threads // 32, outer))  # (no idle warps for one row)
            splits = 1  # split only long rows that too few warps share (one launch otherwise)
            if outer < cu * 16 and reduce_size >= 8192:
                splits = min(cdiv(cu * 32, outer), cdiv(reduce_size, _ROW_CHUNK), MAX_GRID_YZ)
            chunk = cdiv(cdiv(reduce_size, splits), 16) * 16  # keeps 16-byte alignment
            splits = cdiv(reduce_size, chunk)
            groups, shared = (cdiv(outer, ty), splits, 1), 0
        elif (self.wide_column_reduce and reduce_size <= _WIDE_ROWS
              and outer * inner >= _WIDE_OUTPUTS):
            params = REDUCE.pack(outer, reduce_size, inner, 1, reduce_size)
            self._launch_1d(f"reduce_wide_{op}_{sfx}", outer * inner, (a.buffer, out.buffer),
                            params, "reduce")
            return
        else:
            k = self._kernel("reduce", f"reduce_cols_{op}_{sfx}")
            ty = max(1, min(32, k.max_threads // 32, reduce_size))  # no idle rows of threads
            blocks = cdiv(inner, 32) * outer
            splits = 1  # split only when few groups each walk a long column
            if blocks * ty < cu * 16 and reduce_size >= _COL_ROWS * ty:
                splits = min(cdiv(cu * 16, blocks * ty), cdiv(reduce_size, _COL_ROWS * ty),
                             MAX_GRID_YZ)
            chunk = cdiv(reduce_size, splits)
            splits = cdiv(reduce_size, chunk)
            groups, shared = (blocks, splits, 1), 32 * ty * (acc + 8)
        part_val = part_idx = out.buffer
        if splits > 1:
            part_val = self._workspace(outer * splits * inner * acc)
            part_idx = self._workspace(outer * splits * inner * 8) if op == "argmax" else part_val
        params = REDUCE.pack(outer, reduce_size, inner, splits, chunk)
        self.queue.dispatch(k, groups, (32, ty, 1), (a.buffer, out.buffer, part_val, part_idx),
                            params, shared)
        if splits > 1:
            kc = self._kernel("reduce", f"reduce_combine_{op}_{sfx}")
            tyc = max(1, min(8, kc.max_threads // 32))
            self.queue.dispatch(kc, (cdiv(outer * inner, tyc), 1, 1), (32, tyc, 1),
                                (part_val, part_idx, out.buffer), params)

    def _reduce_small(self, op: str, a: GpuArray, out: GpuArray, outer: int,
                      reduce_size: int, inner: int) -> None:
        """uint8/int8 reduce through a widened copy (there are no 8-bit reduce kernels): sums
        in int64 (the sum's dtype), max/min/argmax in int32 (exact for every 8-bit value)."""
        wide = self._new_array(a.size, "int64" if op == "sum" else "int32")
        self.ewise_cast(a, wide)
        if op in ("sum", "argmax"):
            self._reduce(op, wide, out, outer, reduce_size, inner)
            return
        result = self._new_array(out.size, "int32")
        self._reduce(op, wide, result, outer, reduce_size, inner)
        self.ewise_cast(result, out)

    def reduce_sum(self, a, out, outer: int, reduce_size: int, inner: int = 1) -> None:
        self._reduce("sum", a, out, outer, reduce_size, inner)

    def reduce_max(self, a, out, outer: int, reduce_size: int, inner: int = 1) -> None:
        self._reduce("max", a, out, outer, reduce_size, inner)

    def reduce_min(self, a, out, outer: int, reduce_size: int, inner: int = 1) -> None:
        self._reduce("min", a, out, outer, reduce_size, inner)

    def reduce_argmax(self, a, out, outer: int, reduce_size: int, inner: int = 1) -> None:
        """Index of the first maximum (NaN counts as the maximum); ``out`` is int64."""
        self._reduce("argmax", a, out, outer, reduce_size, inner)
