"""``CudaBackend``: the generic GPU backend plus what only NVIDIA GPUs run.

The generic families (``backends/gpu``) launch the kernels every GPU backend ships; this
subclass adds CUDA's own kernels where they are faster — a tiled transpose for compact(),
in-place half-precision scatter, the matrix products (``cuda/products.py``: the skinny
product, tensor-core GEMMs (mma.sync on sm_80+, warpgroup MMA and the TMA-fed GEMM on
Hopper), the float32 split-K and narrow products), the attention kernels
(``cuda/attention.py``), the decode step's fused projections and sampling — each behind a
switch of its ``CudaTuning``.
"""

from __future__ import annotations

import struct

from ...backend_ndarray.dtypes import ITEMSIZE
from ..gpu import GpuArray, GpuBackend
from ..gpu.array import FUSED_GEMV, MAX_GRID_YZ, SUFFIX, TAKE, TRANSPOSE, aligned16, cdiv, overlap
from .attention import FUSED_DTYPES, HALF, AttentionOps
from .gemv import GemvOps
from .multi_tensor import MultiTensorOps
from .products import ProductOps
from .quant_decode import QuantDecodeOps
from .quant_gemm import QuantGemmOps
from .quant_skinny import QuantSkinnyOps
from .tuning import CudaTuning

_FUSED_GEMVS = {"rmsnorm": "rmsnorm_gemv", "rmsnorm_swiglu": "rmsnorm_gemv_swiglu",
                "add": "gemv_add"}  # decode.cu's kernel for each kind of fused projection

# kernel files by NVRTC time on an H100 host (nn 4.5 s, elementwise 3.9 s, matmul 3.0 s for
# one dtype shard), so the slowest start first
_COMPILE_ORDER = {"nn": 0, "elementwise": 1, "matmul": 2, "reduce": 3}
# sampling.cu's SampleParams: rows, vocab, cached, warp_bins_at
_SAMPLE = struct.Struct("4q")
_SAMPLE_WARP_BINS = 32 * 256 * 8  # the selects' per-warp bins (sampling.cu)
_SAMPLE_THREADS = 1024
_SAMPLE_STATIC = 8192  # sampling.cu's static shared memory (6.7 KiB), rounded up


class CudaBackend(ProductOps, AttentionOps, GemvOps, QuantGemmOps, QuantSkinnyOps,
                  QuantDecodeOps, MultiTensorOps, GpuBackend):
    qmv_staged_x = True  # quant.cu's qmv stages x in shared memory (gpu/quant.py)
    wide_column_reduce = True  # reduce.cu's reduce_wide (gpu/reduce.py)

    def __init__(self, device, tuning: CudaTuning | None = None):
        tuning = tuning or CudaTuning.for_device(device.capability, device.executables.arch,
                                                 model=device.model)
        super().__init__(device, "cuda", tuning)
        device.queue.pdl = tuning.pdl
        caps = set(self.capabilities)
        if tuning.mma:
            caps.add("bf16_tensor_cores")
        caps.add("fused_decode")  # CUDA ships only the one-launch attention_decode
        caps.add("decode_bands")  # its kernel choice depends on the positions read
        if self.tuning.fused_matvec:
            caps.add("fused_matvec")
        caps.add("fused_quant_matvec")
        caps.add("sampling")
        caps.add("precompile")
        caps.add("token_major_attention")
        caps.add("attention_backward")
        caps.add("matmul_swiglu")
        caps.add("matmul_geglu")
        caps.add("multi_tensor_adam")
        if self.tuning.folded_norm:
            caps.add("folded_norm_matvec")
        self.capabilities = frozenset(caps)
        self._tma_plans: dict[tuple, tuple | bool] = {}  # _tma_gemm's launch plans
        self._direct_plans: dict[tuple, tuple] = {}  # products known to take them (matmul)

    def _retuned(self) -> None:
        self.device.queue.pdl = self.tuning.pdl
        self._tma_plans.clear()  # plans and routes follow the tuning
        self._direct_plans.clear()

    # --- layout ----------------------------------------------------------------------------
    def _compact_special(self, a: GpuArray, out: GpuArray, shape, strides, offset) -> bool:
        """Transposed matrices, (count, rows, cols) from (cols, rows) storage, by 32x32
        tiles through shared memory (coalesced on both sides)."""
        if not (self.tuning.transpose and len(shape) in (2, 3)
                and strides[-2] == 1 and strides[-1] == shape[-2]
                and (len(shape) == 2 or shape[0] <= MAX_GRID_YZ)
                and cdiv(shape[-2], 32) <= MAX_GRID_YZ):
            return False
        count, batch_stride = (shape[0], strides[0]) if len(shape) == 3 else (1, 0)
        rows, cols = shape[-2:]
        k = self._kernel("layout", f"transpose_{SUFFIX[a.dtype]}")
        ty = max(1, min(8, k.max_threads // 32))
        self.queue.dispatch(k, (cdiv(cols, 32), cdiv(rows, 32), count), (32, ty, 1),
                            (a.buffer, out.buffer),
                            TRANSPOSE.pack(count, rows, cols, batch_stride, offset))
        return True

    def _scatter_add_special(self, indices, values, out, rows: int, dim: int) -> bool:
        """Few rows of fp16/bf16 (a decode step's keys and values): each distinct row summed
        in float32 and rounded once, in place, without converting all of ``out``."""
        if not (self.tuning.half_scatter and out.dtype in HALF and indices.size <= 64):
            return False
        self._rows_launch("layout", f"scatter_add_{SUFFIX[out.dtype]}_{SUFFIX[indices.dtype]}",
                          indices.size, dim, 1, (indices.buffer, values.buffer, out.buffer),
                          TAKE.pack(indices.size, rows, dim))
        return True

    # --- the decode step's fused projections (kernels/decode.cu) ----------------------------
    def _fused_matvec_special(self, kind, x, w, weight, out, rows, dim, p, eps) -> bool:
        """One row: a warp per output row, 16-byte loads; the norm is summed by each warp
        along with its dot products (decode.cu, tuning ``fused_matvec``). Otherwise
        matvec_add of one row is gemv.py's ``gemv_t_add``."""
        if kind == "add" and not self.tuning.fused_matvec:
            return self._gemv_add(x, weight, out, rows, dim, p)
        dt = x.dtype
        item = ITEMSIZE.get(dt, 0)
        if not (self.tuning.fused_matvec and rows == 1 and dt in FUSED_DTYPES
                and dim % (16 // item) == 0 and not overlap(x.buffer, out.buffer)
                and all(aligned16(a.buffer) for a in (x, weight, out) + ((w,) if w else ()))):
            return False
        kern = self._kernel("decode", f"{_FUSED_GEMVS[kind]}_{SUFFIX[dt]}")
        kern.check_threads(128)
        # one row per warp; flags 1: the L2 prefetch (measured slower, kept as a switch)
        params = FUSED_GEMV.pack(dim, p, 1, eps, int(self.tuning.l2_prefetch))
        buffers = ((x.buffer, weight.buffer, out.buffer) if kind == "add" else
                   (x.buffer, w.buffer, weight.buffer, out.buffer))
        self.queue.dispatch(kern, (cdiv(p, 4), 1, 1), (128, 1, 1), buffers, params)
        return True

    def precompile(self, dtypes, families=None) -> list[str]:
        """Start compiling, in parallel, the kernel shards of ``dtypes`` in ``families``
        (default: those of inference — every family but the optimizer updates in the
        floating dtypes, only elementwise in int32 and int64, the token and position
        arithmetic, as measured on a generation); returns the units started. The costliest
        files go first, so the longest compile starts at once."""
        cache = self.device.executables
        heavy_first = sorted(cache.families(), key=lambda f: _COMPILE_ORDER.get(f, 9))
        started = []
        for dtype in dtypes:
            if families is not None:
                chosen = families
            elif dtype in ("int32", "int64", "uint8", "int8"):
                chosen = ["elementwise"]
            elif dtype == "bool":
                chosen = []
            else:
                chosen = [f for f in heavy_first if f != "optim"]
            started += cache.precompile_async([dtype], chosen)
        return started

    def wait_precompiled(self) -> None:
        self.device.executables.wait_precompiled()

    # --- sampling ----------------------------------------------------------------------------
    def sample(self, logits, params, seeds, positions, seen, out, rows: int,
               vocab: int) -> None:
        """sampling.cu: a cluster of groups of 1024 threads per row (8 on sm_90+, read back
        from the compiled kernel), each group a slice of the vocabulary; a slice's scaled
        logits kept in shared memory when they fit, then the top-k / top-p selects' per-warp
        bins where there is room (else a group's warps share one set)."""
        kern = self._kernel("sampling", f"sample_{SUFFIX[logits.dtype]}")
        kern.check_threads(_SAMPLE_THREADS)
        groups = kern.cluster_width
        room = self.device.max_shared_bytes - _SAMPLE_STATIC
        slice_ = -(-vocab // groups)
        padded = (slice_ + slice_ // 32 + 1) * 4  # one word in 32 of padding (bank conflicts)
        cache = padded if padded <= room else 0
        cache = cache + cache % 8  # the bins after it are 8-byte words
        bins_at = cache // 4 if cache + _SAMPLE_WARP_BINS <= room else -1
        shared = cache + (_SAMPLE_WARP_BINS if bins_at >= 0 else 0)
        if shared:
            kern.reserve_shared(shared)
        self.queue.dispatch(kern, (rows * groups, 1, 1), (_SAMPLE_THREADS, 1, 1),
                            (logits.buffer, params.buffer, seeds.buffer, positions.buffer,
                             seen.buffer, out.buffer),
                            _SAMPLE.pack(rows, vocab, int(cache > 0), bins_at), shared)
