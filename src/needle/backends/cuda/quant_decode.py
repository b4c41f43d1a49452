"""The decode step's projections with packed weights as one kernel each
(``kernels/quant_decode.cu``): ``quant_rmsnorm_matvec`` and ``quant_matvec_add`` of one row,
where k and the group are whole 16-byte chunks; other calls take the generic composition
(``gpu/quant.py``). docs/quantization.md describes the kernels, docs/cuda_notes.md v12 how
they were measured.
"""

from __future__ import annotations

import struct

from ..gpu.array import SUFFIX, GpuArray, aligned16, cdiv, overlap
from ..gpu.quant import ACTIVATIONS, group_shift, packed_buffers
from .quant_stream import QuantStreamOps, decode_inputs

# QDecodeParams (kernels/quant.cuh): k, p, words, groups, rows_per_warp, group_shift,
# per_group, eps (and the struct's padding)
QDECODE = struct.Struct("7qf4x")
WARPS = 4  # a group's warps
# outputs a warp takes a step (the kernels' NR): 2, or 1 gate and up pair with SwiGLU
STEP = {"rmsnorm_qmv": 2, "rmsnorm_qmv_swiglu": 1, "qmv_add": 2}


class QuantDecodeOps(QuantStreamOps):
    def _quant_matvec_special(self, kind: str, x: GpuArray, w: GpuArray | None,
                              qweight: GpuArray, scales: GpuArray, offsets: GpuArray | None,
                              out: GpuArray, rows: int, dim: int, p: int, eps: float,
                              bits: int, group_size: int) -> bool:
        chunk = 128 // bits  # values in a 16-byte chunk
        # shared memory, then warp sums: float32 x staged as floats with each chunk's sum of
        # them (with offsets); 16-bit x as integers, 2 bytes a value, with each chunk's scale
        # and sum (kernels/quant_intx.cuh)
        if x.dtype == "float32":
            shared = 4 * (dim + (dim // chunk if offsets is not None else 0) + WARPS)
        else:
            shared = 2 * dim + 8 * (dim // chunk) + 4 * WARPS
        if not (rows == 1 and x.dtype in ACTIVATIONS and dim % chunk == 0
                and group_size % chunk == 0 and shared <= self.device.max_shared_bytes
                and not overlap(x.buffer, out.buffer)
                and all(aligned16(a.buffer) for a in (x, qweight, out) + ((w,) if w else ()))):
            return False
        n = 2 * p if kind == "rmsnorm_qmv_swiglu" else p
        words, groups = dim // (32 // bits), cdiv(dim, group_size)
        if qweight.size != n * words or scales.size != n * groups:
            return False  # the composed form's checks name the mismatch
        per_group = group_size // chunk

        def params(per: int) -> bytes:  # per: outputs a warp (quant_decode), a group (stream)
            return QDECODE.pack(dim, p, words, groups, per, group_shift(groups, per_group),
                                per_group, eps)

        if self._quant_stream_special(kind, x, w, qweight, scales, offsets, out, dim, p, words,
                                      groups, bits, params):
            return True
        # suffix o: the kernel for offsets (int4 with zero points)
        o = "o" if offsets is not None else ""
        kern = self._kernel("quant_decode", f"{kind}{bits}{o}_{SUFFIX[x.dtype]}")
        kern.check_threads(32 * WARPS)
        kern.reserve_shared(shared)
        # a warp's outputs: whole steps, spread over one wave of warps
        step = STEP[kind]
        warps = kern.resident_groups(32 * WARPS, shared) * WARPS
        per_warp = step * cdiv(cdiv(p, step), warps)
        self.queue.dispatch(kern, (cdiv(p, per_warp * WARPS), 1, 1), (32 * WARPS, 1, 1),
                            packed_buffers(decode_inputs(x, w), qweight, scales, offsets, out),
                            params(per_warp), shared)
        return True
