"""The decode step's quantized projections with the weights streamed into shared memory
(``kernels/quant_stream.cu``, sm_90): one group a multiprocessor owns a run of output rows
and asks for all of their packed bytes at once by bulk copies, so a projection's bytes are in
flight from its start rather than a warp's round of registers at a time. bf16 / f16 x; the
same calls as ``quant_decode.py``'s kernels, which take float32 x and whatever does not fit
one wave of groups in shared memory (an 8B model's larger matrices). docs/quantization.md
describes it, docs/cuda_notes.md v49 how it was measured.
"""

from __future__ import annotations

from ..gpu.array import SUFFIX, GpuArray, cdiv
from ..gpu.quant import QuantOps, packed_buffers

# kernels/quant_stream.cu's qs:: constants: a group's warps, its most stages (a stage is a
# step of each warp), and the widest x whose chunks a lane holds in registers
WARPS, STAGES, MAX_DIM = 8, 16, 6144
BARRIERS = 8 * STAGES  # bytes of mbarriers at the start of shared memory
AUTO_CHUNKS = 5 * 32  # "auto" takes rows of at least this many 16-byte chunks
# the kernel's name and outputs a step (NR) for each fused projection
KERNELS = {"rmsnorm_qmv": ("qstream_norm", 2), "rmsnorm_qmv_swiglu": ("qstream_swiglu", 1),
           "qmv_add": ("qstream_add", 2)}


def decode_inputs(x: GpuArray, w: GpuArray | None) -> tuple:
    """A decode projection kernel's inputs before the packed matrix: x, and the norm's
    weight where the projection has a norm (quant_decode.cu, quant_stream.cu)."""
    return (x.buffer,) if w is None else (x.buffer, w.buffer)


def stream_shared_bytes(rows: int, dim: int, words: int, groups: int, bits: int,
                        offsets: bool) -> int:
    """Shared memory of a group holding ``rows`` packed rows (quant_stream.cu's layout)."""
    chunks = dim // (128 // bits)
    tables = 4 * rows * groups * (2 if offsets else 1)
    # (+ 16: the tables start on a 16-byte boundary, where bulk copies may write them)
    return BARRIERS + 4 * rows * words + 2 * dim + 8 * chunks + 4 * WARPS + 16 + tables


class QuantStreamOps(QuantOps):
    def _quant_stream_special(self, kind: str, x: GpuArray, w: GpuArray | None,
                              qweight: GpuArray, scales: GpuArray, offsets: GpuArray | None,
                              out: GpuArray, dim: int, p: int, words: int, groups: int,
                              bits: int, params) -> bool:
        """One projection of one row as a quant_stream.cu kernel where the tuning takes it
        and each group's rows fit its shared memory in one wave; ``params`` packs the
        QDecodeParams for a given number of outputs a group. The caller has checked the
        shapes, the alignment and that x and out do not overlap."""
        choice = self.tuning.quant_stream
        if not (choice != "off" and x.dtype in ("float16", "bfloat16") and dim <= MAX_DIM):
            return False
        name, step = KERNELS[kind]
        per_group = cdiv(p, self.device.compute_units)  # outputs a group: one a multiprocessor
        stages = cdiv(cdiv(per_group, step), WARPS)
        if stages > STAGES:
            return False
        # by default where each warp has one step, or rows of at least 5 chunks a lane: there
        # a warp's dot products keep up with the stream and the bytes all in flight win (an
        # H200: 1.1B down int4 5.9 -> 5.0 us, int8 7.2 -> 5.8; 8B q/k/v int8 11.2 -> 10.0).
        # With several steps of rows of 2-4 chunks a lane the warp's fixed work a step (its
        # sums, the store) makes the dot products fall behind (1.1B gate/up int4 7.7 -> 8.9
        # us, int8 9.1 -> 11.0). docs/cuda_notes.md v49
        if choice == "auto" and stages > 1 and dim // (128 // bits) < AUTO_CHUNKS:
            return False
        rows = 2 * per_group if kind == "rmsnorm_qmv_swiglu" else per_group
        shared = stream_shared_bytes(rows, dim, words, groups, bits, offsets is not None)
        if shared > self.device.max_shared_bytes:
            return False
        o = "o" if offsets is not None else ""
        kern = self._kernel("quant_stream", f"{name}{bits}{o}_{SUFFIX[x.dtype]}")
        kern.check_threads(32 * WARPS)
        kern.reserve_shared(shared)
        grid = cdiv(p, per_group)
        if grid > kern.resident_groups(32 * WARPS, shared):
            return False  # a second wave would wait for the first's bytes
        self.queue.dispatch(kern, (grid, 1, 1), (32 * WARPS, 1, 1),
                            packed_buffers(decode_inputs(x, w), qweight, scales, offsets, out),
                            params(per_group), shared)
        return True
