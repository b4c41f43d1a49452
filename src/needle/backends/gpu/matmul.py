"""Matrix products (kernel file ``matmul``): a matrix-vector path for one row (decode), and
tiled products of every dtype. Device backends add faster paths through ``_matmul_special``.
"""

from __future__ import annotations

from ...backend_ndarray.dtypes import ITEMSIZE
from ...errors import DTypeError, ShapeError
from .array import MATMUL, MAX_GRID_YZ, SMALL_INTS, SUFFIX, GpuArray, cdiv
from .base import GpuBase

GEMV_DTYPES = ("float16", "bfloat16", "float32")  # the one-row (gemv) kernels' dtypes


class MatmulOps(GpuBase):
    def matmul(self, a: GpuArray, b: GpuArray, out: GpuArray, m: int, n: int, p: int, *,
               batch: int = 1, stride_a: int | None = None, stride_b: int | None = None,
               transpose_a: bool = False, transpose_b: bool = False) -> None:
        """out[i] = A[i] @ B[i] (see numpy_ref.matmul for the layout of a, b and out)."""
        if out.size == 0:
            return
        dt = a.dtype
        if dt == "bool":
            raise DTypeError("matmul is not defined for bool arrays")
        stride_a = m * n if stride_a is None else stride_a
        stride_b = n * p if stride_b is None else stride_b
        if n == 0:
            self.fill(out, 0)
            return
        if dt in SMALL_INTS:
            self._matmul_small(a, b, out, m, n, p, batch, stride_a, stride_b, transpose_a,
                               transpose_b)
            return
        if m == 1 and batch == 1 and dt in GEMV_DTYPES:
            self._gemv(a, b, out, n, p, transpose_b)
            return
        if self._matmul_special(a, b, out, m, n, p, batch, stride_a, stride_b, transpose_a,
                                transpose_b):
            return
        if dt == "float32":
            name = f"matmul_{'t' if transpose_a else 'n'}{'t' if transpose_b else 'n'}_f32"
            self._matmul_tiles("matmul", name, a, b, out, m, n, p, batch, stride_a, stride_b,
                               (128, 128), 256, 0, transpose_a, transpose_b)
        else:
            self._matmul_tiles("matmul", f"matmul_{SUFFIX[dt]}", a, b, out, m, n, p, batch,
                               stride_a, stride_b, (16, 16), (16, 16), 0, transpose_a,
                               transpose_b)

    def _matmul_small(self, a, b, out, m, n, p, batch, stride_a, stride_b, ta, tb) -> None:
        """uint8/int8 products through int32 copies (no 8-bit matmul kernels): int32 sums
        wrap modulo 2^32, so the result cast back is the product modulo 2^8, as numpy's."""
        wa, wb = self._new_array(a.size, "int32"), self._new_array(b.size, "int32")
        self.ewise_cast(a, wa)
        self.ewise_cast(b, wb)
        result = self._new_array(out.size, "int32")
        self.matmul(wa, wb, result, m, n, p, batch=batch, stride_a=stride_a, stride_b=stride_b,
                    transpose_a=ta, transpose_b=tb)
        self.ewise_cast(result, out)

    def _matmul_special(self, a, b, out, m, n, p, batch, stride_a, stride_b, ta, tb) -> bool:
        """A device's own kernels for the products they suit; True when one ran."""
        return False

    def _untranspose(self, x: GpuArray, rows: int, cols: int, batch: int, stride: int,
                     transposed: bool) -> tuple[GpuArray, int]:
        """The (rows, cols) row-major copies of matrices stored transposed (cols, rows)."""
        if not transposed:
            return x, stride
        count = 1 if stride == 0 else batch
        out = self._new_array(count * rows * cols, x.dtype)
        shape, strides = (count, rows, cols), (stride, 1, rows)
        self.compact(x, out, shape, strides, 0)
        return out, (0 if stride == 0 else rows * cols)

    def _matmul_tiles(self, family, name, a, b, out, m, n, p, batch, stride_a, stride_b,
                      tile, threads, shared, ta, tb) -> None:
        k = self._kernel(family, name)
        threads = (threads, 1, 1) if isinstance(threads, int) else (*threads, 1)
        k.check_threads(threads[0] * threads[1])
        if shared:
            k.reserve_shared(shared)
        item = ITEMSIZE[a.dtype]
        gx, gy = cdiv(p, tile[1]), cdiv(m, tile[0])
        if gy > MAX_GRID_YZ:
            raise ShapeError(f"matmul with {m} rows exceeds the GPU grid; split the batch")
        for z0 in range(0, batch, MAX_GRID_YZ):
            nb = min(MAX_GRID_YZ, batch - z0)
            av = a.buffer if z0 == 0 else a.buffer.view(z0 * stride_a * item, 0)
            bv = b.buffer if z0 == 0 else b.buffer.view(z0 * stride_b * item, 0)
            ov = out.buffer if z0 == 0 else out.buffer.view(z0 * m * p * item, 0)
            params = MATMUL.pack(m, n, p, nb, stride_a, stride_b, int(ta), int(tb), 1, 0)
            self.queue.dispatch(k, (gx, gy, nb), threads, (av, bv, ov), params, shared)

    def _gemv_rows(self, name: str, a: GpuArray, b: GpuArray, out: GpuArray, p: int,
                   params: bytes) -> None:
        """Kernel ``name`` (gemv_t or one of its forms) over the p rows of B (p, n): a warp a
        row, small groups (256 rows still span 64 SMs)."""
        k = self._kernel("matmul", f"{name}_{SUFFIX[a.dtype]}")
        ty = max(1, min(4, k.max_threads // 32))
        self.queue.dispatch(k, (cdiv(p, ty), 1, 1), (32, ty, 1),
                            (a.buffer, b.buffer, out.buffer), params)

    def _gemv(self, a: GpuArray, b: GpuArray, out: GpuArray, n: int, p: int,
              transpose_b: bool) -> None:
        if transpose_b:
            self._gemv_rows("gemv_t", a, b, out, p, MATMUL.pack(1, n, p, 1, 0, 0, 0, 1, 1, n))
            return
        sfx = SUFFIX[a.dtype]
        k = self._kernel("matmul", f"gemv_n_{sfx}")
        ty = max(1, min(8, k.max_threads // 32))
        width = 16 // ITEMSIZE[a.dtype]
        gx = cdiv(p, 32 * width)
        splits = max(1, min(cdiv(self.device.compute_units * 4, gx), cdiv(n, 8 * ty),
                            MAX_GRID_YZ))
        chunk = cdiv(n, splits)
        splits = cdiv(n, chunk)
        part = self._workspace(splits * p * 4)
        params = MATMUL.pack(1, n, p, 1, 0, 0, 0, 0, splits, chunk)
        self.queue.dispatch(k, (gx, splits, 1), (32, ty, 1), (a.buffer, b.buffer, part),
                            params, ty * 32 * width * 4)
        self._launch_1d(f"gemv_combine_{sfx}", p, (part, out.buffer), params, "matmul")
