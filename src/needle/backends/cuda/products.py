"""The CUDA backend's matrix products (``ProductOps``, a mixin of ``CudaBackend``): which
kernel takes a product — the skinny product, the float32 split-K and narrow products, the
FP64-tensor-core and SIMT float32 GEMMs, TF32, warpgroup MMA and the TMA-fed GEMM on Hopper
(with its launch plans and the routes ``matmul`` remembers) — each behind a switch of
``CudaTuning``. ``CudaBackend.__init__`` makes the plan caches (``_tma_plans``,
``_direct_plans``); ``_retuned`` empties them.
"""

from __future__ import annotations

from ...backend_ndarray.dtypes import ITEMSIZE
from ...errors import DeviceError, ShapeError
from ..gpu import GpuArray
from ..gpu.array import MATMUL, MAX_GRID_YZ, SUFFIX, aligned16, cdiv
from ..precision import tf32_allowed
from .attention import HALF
from .gemv import GEMV_DTYPES
from .memory import address
from .split_k import split_k_plan
from .tensor_map import matrix_map
from .tuning import K_MAJOR_WIDTHS, TMA_WIDTHS, tma_stages, tma_width

SKINNY_STRIDE = 128 + 32  # skinny.cu's shared-memory row of X, in elements
DMMA_SHARED = 3 * 2 * 64 * 136 * 4  # sgemm_dmma.cuh's SHARED_BYTES: 3 stages of A and B
_TMA_PLANS = 256  # launch plans kept by _tma_gemm and routes by matmul (emptied when full)
_NO_MAP = bytes(128)  # gemm_tma.cu's map of C where C cannot have one (values stored singly)


def _values_params(params: bytes) -> bytes:
    """A TMA GEMM launch's params with chunk = 1: store C's values one by one."""
    return MATMUL.pack(*MATMUL.unpack(params)[:-1], 1)


def _product_key(a, b, m, n, p, batch, stride_a, stride_b, tb, glu=False) -> tuple:
    return (address(a), address(b), a.dtype, m, n, p, batch, stride_a, stride_b, tb, glu)


class ProductOps:
    """Mixed into CudaBackend (which holds the plan caches and the tuning)."""

    def matmul(self, a, b, out, m, n, p, *, batch=1, stride_a=None, stride_b=None,
               transpose_a=False, transpose_b=False) -> None:
        """gpu/matmul.py's product. One that took the TMA GEMM on these very operands before
        (an eager loop, a training step: ``_wgmma`` records it) goes straight to its launch:
        the route through the kernel choices depends only on the key and the tuning, and a
        change of tuning forgets the routes."""
        if not transpose_a and a.dtype in HALF:  # the only products _wgmma records
            stride_a = m * n if stride_a is None else stride_a
            stride_b = n * p if stride_b is None else stride_b
            plan = self._direct_plans.get(_product_key(a, b, m, n, p, batch, stride_a,
                                                       stride_b, transpose_b))
            if plan is not None:
                self._launch_tma(plan, a, b, out, m, p, stride_a, stride_b)
                return
        super().matmul(a, b, out, m, n, p, batch=batch, stride_a=stride_a, stride_b=stride_b,
                       transpose_a=transpose_a, transpose_b=transpose_b)


    def _matmul_special(self, a, b, out, m, n, p, batch, stride_a, stride_b, ta, tb) -> bool:
        dt = a.dtype
        width = 16 // ITEMSIZE[dt]
        if (m <= 8 and not ta and not tb and self.tuning.skinny
                and dt in ("float16", "bfloat16", "float32") and p % width == 0
                and stride_b % width == 0 and aligned16(b.buffer)):
            self._skinny(a, b, out, m, n, p, batch, stride_a, stride_b)
            return True
        if (tb and not ta and 2 <= m <= self.tuning.skinny_tc and dt in HALF and n % 8 == 0
                and stride_a % 8 == 0 and stride_b % 8 == 0
                and aligned16(a.buffer) and aligned16(b.buffer)):
            return self._skinny_tc(a, b, out, m, n, p, batch, stride_a, stride_b)
        tc = (self.tuning.mma and dt in HALF and n % 8 == 0 and p % 8 == 0
              and (batch == 1 or stride_a % 8 == 0 and stride_b % 8 == 0)
              # the tensor-core pipeline's stages must fit in shared memory
              and self.tuning.tc_stages * (128 * 32 + 32 * 128) * 2
              <= self.device.max_shared_bytes
              and aligned16(a.buffer) and aligned16(b.buffer))
        if dt == "float32" and self._tf32(a, b, out, m, n, p, batch, stride_a, stride_b, ta,
                                          tb):
            return True
        if dt == "float32" and self._f32_on_f64(a, b, out, m, n, p, batch, stride_a, stride_b,
                                                ta, tb):
            return True
        if not tc:
            return dt == "float32" and (
                self._split_k_f32(a, b, out, m, n, p, batch, stride_a, stride_b, ta, tb)
                or self._narrow_f32(a, b, out, m, n, p, batch, stride_a, stride_b, ta, tb))
        if self.tuning.wgmma:
            self._wgmma(a, b, out, m, n, p, batch, stride_a, stride_b, ta, tb)
            return True
        # the mma.sync kernel reads both operands untransposed: transpose on the device
        a, stride_a = self._untranspose(a, m, n, batch, stride_a, ta)
        b, stride_b = self._untranspose(b, n, p, batch, stride_b, tb)
        bn = self.tuning.tc_tile
        name = f"matmul_tc{'256' if bn == 256 else ''}_{SUFFIX[dt]}"
        shared = self.tuning.tc_stages * (128 * 32 + 32 * bn) * 2
        self._matmul_tiles("matmul", name, a, b, out, m, n, p, batch, stride_a, stride_b,
                           (128, bn), 256, shared, False, False)
        return True

    def _tf32(self, a, b, out, m, n, p, batch, stride_a, stride_b, ta, tb) -> bool:
        """float32 on TF32 tensor cores where ``set_float32_matmul_precision("high")`` allows
        it: the TMA GEMM with float operands, both K-major (wgmma's TF32 form has no
        transposed operand), so A stored transposed or B stored as written (n, p) is copied
        first. False (nothing launched) where the TMA kernel does not apply."""
        if not (self.tuning.tma and tf32_allowed() and m >= 128 and p >= 64 and n >= 32
                and n % 4 == 0 and p % 2 == 0 and aligned16(a.buffer) and aligned16(b.buffer)
                and (batch == 1 or stride_a >= m * n and stride_b >= n * p)):
            return False
        a, stride_a = self._untranspose(a, m, n, batch, stride_a, ta)
        b, stride_b = self._untranspose(b, p, n, batch, stride_b, not tb)
        return bool(self._tma_gemm(a, b, out, m, n, p, batch, stride_a, stride_b, True))

    def _f32_on_f64(self, a, b, out, m, n, p, batch, stride_a, stride_b, ta, tb) -> bool:
        """A float32 product on FP64 tensor cores (sgemm_dmma.cuh: exact products, float64
        sums, one rounding; faster than the SIMT kernel on the H100) where its 128 x 128 x
        64 tiles divide the product and fill the SMs at least twice over (fewer tiles leave
        the tensor cores idle: 1024^3 runs at 0.67x cuBLAS's SGEMM there, the SIMT kernel
        at ~1.05x)."""
        if not (self.tuning.f32_on_f64 and m % 128 == 0 and p % 128 == 0 and n % 64 == 0
                and DMMA_SHARED <= self.device.max_shared_bytes
                and (m // 128) * (p // 128) * batch >= 2 * self.device.compute_units
                and (batch == 1 or stride_a % 4 == 0 and stride_b % 4 == 0)
                and aligned16(a.buffer) and aligned16(b.buffer) and aligned16(out.buffer)):
            return False
        name = f"matmul_{'t' if ta else 'n'}{'t' if tb else 'n'}_dmma_f32"
        self._matmul_tiles("matmul", name, a, b, out, m, n, p, batch, stride_a, stride_b,
                           (128, 128), 256, DMMA_SHARED, ta, tb)
        return True

    def _sgemm_f32(self, ta: bool, tb: bool, p: int) -> tuple[str, int]:
        """The SIMT float32 GEMM's name for a product of ``p`` columns, and its tile width:
        128 x 64 tiles (matmul_*64_f32: 101 registers, two groups an SM) for at most 64
        columns, where a 128-wide tile would compute half in vain (tuning ``narrow_f32``)."""
        width = 64 if p <= 64 and self.tuning.narrow_f32 else 128
        name = f"matmul_{'t' if ta else 'n'}{'t' if tb else 'n'}{'64' if width == 64 else ''}_f32"
        return name, width

    def _narrow_f32(self, a, b, out, m, n, p, batch, stride_a, stride_b, ta, tb) -> bool:
        """A float32 product of at most 64 columns on the narrow tiles (_sgemm_f32)."""
        if p > 64 or not self.tuning.narrow_f32:
            return False
        name, width = self._sgemm_f32(ta, tb, p)
        self._matmul_tiles("matmul", name, a, b, out, m, n, p, batch, stride_a, stride_b,
                           (128, width), 256, 0, ta, tb)
        return True

    def _split_k_f32(self, a, b, out, m, n, p, batch, stride_a, stride_b, ta, tb) -> bool:
        """A float32 product whose output tiles alone would leave most SMs idle (a 512x1024
        product has 32 tiles of 128x128 for 132 SMs): groups also split K, each writing its
        partial product to a float32 slab, and a column sum adds the slabs."""
        if not self.tuning.split_k or n < 512:
            return False
        name, width = self._sgemm_f32(ta, tb, p)
        tiles = cdiv(m, 128) * cdiv(p, width) * batch
        if tiles >= self.device.compute_units:
            return False
        splits, chunk = split_k_plan(tiles, m, n, p, batch, self.device.compute_units)
        if splits == 1 or batch > MAX_GRID_YZ // splits:
            return False
        part = GpuArray(self._workspace(splits * batch * m * p * 4), splits * batch * m * p,
                        "float32")
        k = self._kernel("matmul", name)
        params = MATMUL.pack(m, n, p, batch, stride_a, stride_b, int(ta), int(tb), splits, chunk)
        self.queue.dispatch(k, (cdiv(p, width), cdiv(m, 128), splits * batch), (256, 1, 1),
                            (a.buffer, b.buffer, part.buffer), params)
        self._reduce("sum", part, out, 1, splits, batch * m * p)
        return True

    def _wgmma(self, a, b, out, m, n, p, batch, stride_a, stride_b, ta, tb) -> None:
        """Hopper warpgroup MMA: A as (m, n) row-major; B as (p, n) row-major (K-major), or,
        for the TMA kernel only, as (n, p) row-major (N-major: A @ B needs no copy of B)."""
        a, stride_a = self._untranspose(a, m, n, batch, stride_a, ta)
        # TMA: operands at least one box (128 x 64 of A, tile-wide x 64 of B) large, so no
        # box overhangs a whole dimension
        if (self.tuning.tma and self.tuning.gemm == "tma"
                and m >= 128 and p >= 64 and n >= 64
                and (batch == 1 or stride_a >= m * n and stride_b >= p * n)
                and aligned16(a.buffer) and aligned16(b.buffer)):
            plan = self._tma_gemm(a, b, out, m, n, p, batch, stride_a, stride_b, tb)
            if plan and not ta:  # the operands as given: the next such product skips here
                if len(self._direct_plans) >= _TMA_PLANS:
                    self._direct_plans.clear()
                self._direct_plans[_product_key(a, b, m, n, p, batch, stride_a, stride_b,
                                                tb)] = plan
            if plan:
                return
        b, stride_b = self._untranspose(b, p, n, batch, stride_b, not tb)
        tile = self.tuning.wgmma_tile
        wide = cdiv(m, 128) * cdiv(p, 256) * batch >= self.device.compute_units
        nsub = 2 if tile == "256" or (tile is None and wide) else 1  # small: more groups
        name = f"matmul_wgmma{'128' if nsub == 1 else ''}_{SUFFIX[a.dtype]}"
        shared = self.tuning.wg_stages * (128 + 128 * nsub) * 64 * 2 + 1024
        self._matmul_tiles("matmul", name, a, b, out, m, n, p, batch, stride_a, stride_b,
                           (128, 128 * nsub), 256, shared, False, True)

    def _tma_gemm(self, a, b, out, m, n, p, batch, stride_a, stride_b, tb: bool,
                  glu: bool = False):
        """gemm_tma.cu: 128 x W tiles (W = 256, 176, 160, 128, 80 or 64: tma_width), a TMA
        producer warpgroup and two wgmma consumer warpgroups; A (m, n) row-major, B (p, n)
        row-major when ``tb`` (K-major: matmul_tma) or (n, p) row-major (N-major: matmul_tma_nn),
        described by tensor maps; with ``glu``, B is a fused gate/up weight (2p, n) and out
        (m, p) its SwiGLU (matmul_tma_glu). Returns the launch plan, or False (nothing
        launched) when the operands cannot be described or the tile does not fit: use
        another kernel.

        The launches' plan (kernel, grids, params, tensor maps) depends only on the operands'
        addresses, the product's shape and the tuning, so it is kept until the tuning changes:
        an eager loop or a training step repeats the same products on the same buffers and
        pays for the plan once."""
        key = _product_key(a, b, m, n, p, batch, stride_a, stride_b, tb, glu)  # retuning clears
        plan = self._tma_plans.get(key)
        if plan is None:
            if len(self._tma_plans) >= _TMA_PLANS:
                self._tma_plans.clear()
            plan = self._tma_plans[key] = self._tma_plan(a, b, m, n, p, batch, stride_a,
                                                         stride_b, tb, glu) or False
        if plan:
            self._launch_tma(plan, a, b, out, m, p, stride_a, stride_b)
        return plan

    def matmul_swiglu(self, a, w, out, m: int, n: int, p: int) -> None:
        """numpy_ref.matmul_swiglu: on Hopper the TMA GEMM's GLU form (a tile's B stage holds
        128 gate rows and the same outputs' 128 up rows; the epilogue writes silu(gate) * up),
        elsewhere the product into a workspace and swiglu; one row (a decode step) by
        ``gemv_glu``, gate and up rows in one warp (gemv.py)."""
        if m == 1 and a.dtype in GEMV_DTYPES:
            self._gemv_glu(a, w, out, n, p)
            return
        if (self.tuning.tma and self.tuning.gemm == "tma" and a.dtype in HALF
                and m >= 128 and p >= 128 and n >= 64 and n % 8 == 0 and p % 8 == 0
                and aligned16(a.buffer) and aligned16(w.buffer)
                and self._tma_gemm(a, w, out, m, n, p, 1, 0, 0, True, glu=True)):
            return
        self._product_then(self.swiglu, a, w, out, m, n, p)

    def matmul_geglu(self, a, w, out, m: int, n: int, p: int) -> None:
        """numpy_ref.matmul_geglu: one row (a decode step) by ``gemv_geglu``, gate and up rows
        in a pair of warps as gemv_glu; more rows the product into a workspace and geglu."""
        if m == 1 and a.dtype in GEMV_DTYPES:
            self._gemv_glu(a, w, out, n, p, "gemv_geglu")
            return
        self._product_then(self.geglu, a, w, out, m, n, p)

    def _product_then(self, gated, a, w, out, m: int, n: int, p: int) -> None:
        """The (m, 2p) gate/up product into a workspace, then ``gated`` (swiglu, geglu)."""
        product = self._new_array(m * 2 * p, a.dtype)
        self.matmul(a, w, product, m, n, 2 * p, transpose_b=True)
        gated(product, out, p)

    def _launch_tma(self, plan, a, b, out, m: int, p: int, stride_a: int,
                    stride_b: int) -> None:
        """Launch a plan of ``_tma_gemm`` into ``out``. The kernel stores C by TMA through a
        map of ``out`` made here (cached per address); an output whose rows are not 16-byte
        multiples, or that starts unaligned, has none and its values are stored one by one
        (params chunk = 1)."""
        k, shared, launches = plan
        item = ITEMSIZE[a.dtype]
        out_at = address(out)
        counter = self._counters(2)  # the groups' tile claims (gemm_tma.cu run())
        for z0, nb, grid, params, maps in launches:
            c_map = self._c_map(out.dtype, out_at + z0 * m * p * item, m, p, nb)
            if c_map is None:
                c_map, params = _NO_MAP, _values_params(params)
            bufs = ((a.buffer, b.buffer, out.buffer, counter) if z0 == 0 else
                    (a.buffer.view(z0 * stride_a * item, 0),
                     b.buffer.view(z0 * stride_b * item, 0), out.buffer.view(z0 * m * p * item, 0),
                     counter))
            self.queue.dispatch(k, grid, (384, 1, 1), bufs, params, shared,
                                raw_args=(*maps, c_map))

    @staticmethod
    def _c_map(dtype: str, address: int, m: int, p: int, batch: int) -> bytes | None:
        """The TMA GEMM's map of C (boxes of 64 rows x 128 bytes), or None where TMA cannot
        store it: a start not 16-byte aligned or rows not 16-byte multiples."""
        item = ITEMSIZE[dtype]
        if address % 16 or (p * item) % 16:
            return None
        try:
            return matrix_map(dtype, address, m, p, batch, m * p, 64, 128 // item)
        except DeviceError:  # any other limit of the map's: the values path still works
            return None

    def _tma_plan(self, a, b, m, n, p, batch, stride_a, stride_b, tb: bool, glu: bool):
        """(kernel, shared bytes, launches) of ``_tma_gemm``, a launch being (first matrix,
        matrices, grid, params, A's and B's tensor maps) per MAX_GRID_YZ matrices (C's map
        follows the output: ``_launch_tma`` makes it); None when the operands cannot
        be described or the tile does not fit. A GLU tile is 256 wide: 128 gate and 128 up
        rows of B (two boxes a stage) for 128 outputs."""
        if glu:
            width = 256
        else:  # 176 / 160 / 80-wide tiles: K-major fp16 / bf16 B only (no N-major boxes, TF32)
            widths = K_MAJOR_WIDTHS if tb and a.dtype in HALF else TMA_WIDTHS
            width = (self.tuning.tma_tile if self.tuning.tma_tile in widths
                     else tma_width(m, p, batch, self.device.compute_units, widths))
        out_w = width // 2 if glu else width  # the output columns a tile writes
        if p < out_w:
            return None
        stages = tma_stages(width, self.tuning.tma_stages)
        # stages, the consumers' four 8 KiB staging buffers, two barriers and a tile id a
        # stage, alignment
        shared = stages * (128 + width) * 64 * 2 + 4 * 8192 + 20 * stages + 1024
        item = ITEMSIZE[a.dtype]
        if shared > self.device.max_shared_bytes:
            return None
        k_box = 128 // item  # a box row is 128 bytes (the swizzle): 64 halves, 32 floats
        tiles = cdiv(m, 128) * cdiv(p, out_w)  # the kernel orders each matrix's tiles
        groups = self.tuning.tma_groups or self.device.compute_units  # persistent: <= 1 an SM
        launches = []
        try:
            # tile ids are 32-bit: a launch numbers fewer than 2^31 tiles
            per_launch = min(MAX_GRID_YZ, (2**31 - 1) // tiles)
            if per_launch == 0:
                return None
            for z0 in range(0, batch, per_launch):
                nb = min(per_launch, batch - z0)
                a_at = address(a) + z0 * stride_a * item
                b_at = address(b) + z0 * stride_b * item
                b_map = (matrix_map(b.dtype, b_at, 2 * p if glu else p, n, nb, stride_b, out_w,
                                    k_box) if tb
                         # N-major (halves only): boxes of 64 k-rows x 64 columns
                         else matrix_map(b.dtype, b_at, n, p, nb, stride_b, 64))
                maps = (matrix_map(a.dtype, a_at, m, n, nb, stride_a, 128, k_box), b_map)
                params = MATMUL.pack(m, n, p, nb, stride_a, stride_b, 0, int(tb), 1, 0)
                launches.append((z0, nb, (min(tiles * nb, groups), 1, 1), params, maps))
        except DeviceError:
            return None
        kind = "glu_" if glu else "tf32_" if a.dtype == "float32" else "" if tb else "nn_"
        name = f"matmul_tma{'' if width == 256 else width}_{kind}"
        k = self._kernel("gemm_tma", name + SUFFIX[a.dtype])
        k.check_threads(384)
        k.reserve_shared(shared)
        return k, shared, launches

    def _skinny(self, a, b, out, m: int, n: int, p: int, batch: int, stride_a: int,
                stride_b: int) -> None:
        """A few rows times (n, p) matrices: bandwidth-bound, so B is read once, by groups
        of 256 threads over 8 column groups of 16 bytes and a slice of k; the slices'
        float32 partial sums are added by ``gemv_combine``."""
        sfx = SUFFIX[a.dtype]
        k = self._kernel("matmul", f"matmul_skinny_{sfx}")
        k.check_threads(256)
        gx = cdiv(p // (16 // ITEMSIZE[a.dtype]), 8)
        if batch > MAX_GRID_YZ:
            raise ShapeError(f"matmul with a batch of {batch} exceeds the GPU grid")
        # about two groups per SM, each thread at least one round of 8 loads (256 rows of k)
        splits = max(1, min(cdiv(2 * self.device.compute_units, gx * batch), cdiv(n, 256),
                            MAX_GRID_YZ))
        chunk = cdiv(n, splits)
        splits = cdiv(n, chunk)
        part = self._workspace(splits * batch * m * p * 4) if splits > 1 else out.buffer
        params = MATMUL.pack(m, n, p, batch, stride_a, stride_b, 0, 0, splits, chunk)
        self.queue.dispatch(k, (gx, splits, batch), (256, 1, 1),
                            (a.buffer, b.buffer, out.buffer, part), params)
        if splits > 1:
            combine = MATMUL.pack(1, n, batch * m * p, 1, 0, 0, 0, 0, splits, chunk)
            self._launch_1d(f"gemv_combine_{sfx}", batch * m * p, (part, out.buffer), combine,
                            "matmul")

    def _skinny_tc(self, a, b, out, m: int, n: int, p: int, batch: int, stride_a: int,
                   stride_b: int) -> bool:
        """X (m, n) @ W^T, W stored (p, n), for a few rows of X on tensor cores (skinny.cu):
        groups of 64 rows of W and a slice of k, about one group per SM, W read once; the
        slices' float32 partials are added by ``gemv_combine``."""
        rows = next(r for r in (8, 16, 32, 64, 128) if r >= m)
        shared = 2 * rows * SKINNY_STRIDE * 2  # two stages of X
        if shared > self.device.max_shared_bytes or batch > MAX_GRID_YZ:
            return False
        sfx = SUFFIX[a.dtype]
        k = self._kernel("skinny", f"matmul_skinny_tc{rows}_{sfx}")
        k.check_threads(128)
        k.reserve_shared(shared)
        groups = cdiv(p, 64) * batch
        # about one group per SM (measured against two, four and eight: docs/cuda_notes.md)
        splits = max(1, min(cdiv(self.device.compute_units, groups), cdiv(n, 256),
                            MAX_GRID_YZ))
        chunk = cdiv(cdiv(n, splits), 64) * 64
        splits = cdiv(n, chunk)
        part = self._workspace(splits * batch * m * p * 4) if splits > 1 else out.buffer
        params = MATMUL.pack(m, n, p, batch, stride_a, stride_b, 0, 1, splits, chunk)
        self.queue.dispatch(k, (cdiv(p, 64), splits, batch), (128, 1, 1),
                            (a.buffer, b.buffer, out.buffer, part), params, shared)
        if splits > 1:
            combine = MATMUL.pack(1, n, batch * m * p, 1, 0, 0, 0, 0, splits, chunk)
            self._launch_1d(f"gemv_combine_{sfx}", batch * m * p, (part, out.buffer), combine,
                            "matmul")
        return True
