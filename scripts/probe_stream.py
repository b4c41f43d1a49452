"""How fast can one launch read a 1.1B model's layer weights, by access pattern (CUDA).

The persistent decode kernel (kernels/decode_mega.cu) streams its weights at ~2.3 TB/s
whatever feeds it (docs/cuda_notes.md v22), where the gemv kernels reach more. This probe
reads the same 88 arrays (22 layers' QKV, O, gate/up and down, bf16, one allocation each)
with scripts/probe_stream.cu's patterns and group sizes, and a device-to-device copy for
scale, and prints GB/s (bytes read; the copy counts read + write). v24 has the figures.

    python scripts/probe_stream.py [--reps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

SHAPES = [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]  # per layer, TinyLlama
LAYERS = 22
MODES = {0: "flat (whole grid, array by array)", 1: "slice a group, threads interleaved",
         2: "slice a group, a sub-slice a warp", 3: "chunks dealt to groups in turn",
         4: "2 + group sync an array", 5: "2 + group sync, next loads ahead",
         6: "2 + grid barrier an array", 7: "2 + grid barrier, next loads ahead",
         8: "grid barrier, on demand", 9: "grid barrier, on demand, next ahead",
         10: "2 + grid barrier, next slice prefetched to L2", 11: "the 88 grid barriers alone",
         12: "88 counted barriers alone", 13: "2 + counted barrier an array"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=20, help="launches a timing")
    args = ap.parse_args()

    from cuda.bindings import driver as cu

    import needle.backend_ndarray as nd
    from needle.backends.cuda import compiler

    dev = nd.cuda()
    be = dev.backend
    sms = int(cu.cuDeviceGetAttribute(
        cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0)[1])
    arch, ptx = be.device.executables.arch, be.device.executables.ptx
    source = Path(__file__).with_suffix(".cu").read_text()
    image = compiler.compile_source(source, "probe_stream", arch, ptx)
    module = compiler.CudaExecutable("probe_stream", image, sms, be.device.executables.context)

    arrays = [nd.empty(shape, "bfloat16", dev) for _ in range(LAYERS) for shape in SHAPES]
    nbytes = sum(int(np.prod(a.shape)) * 2 for a in arrays)
    table = nd.NDArray(np.array([[a._handle.buffer.handle + a._handle.buffer.offset,
                                  int(np.prod(a.shape)) * 2 // 16] for a in arrays],
                                np.int64), device=dev)
    # [0:2] the grid barrier's words, [2:4] the counted barrier's, [4:256] the on-demand
    # counters (zero between launches)
    out = nd.zeros((256 + 1024 * 160,), "int32", dev)

    def timed(run) -> float:
        """Median ms a launch over 3 timings of args.reps launches (events on the stream)."""
        q = be.queue
        times = []
        run()
        for _ in range(3):
            start, end = q.event(), q.event()
            start.record()
            for _ in range(args.reps):
                run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_ms(end) / args.reps)
        return statistics.median(times)

    rows = []
    src = nd.empty((1 << 29,), "bfloat16", dev)  # 1 GiB
    dst = nd.empty((1 << 29,), "bfloat16", dev)
    q = be.queue
    ms = timed(lambda: q.copy(src._handle.buffer, 0, dst._handle.buffer, 0, 1 << 30))
    rows.append(("device-to-device copy 1 GiB (read + write)", ms, 2 * (1 << 30) / ms / 1e6))
    configs = [(0, 2 * sms, 256), (0, 4 * sms, 256), (0, 8 * sms, 256)]
    configs += [(mode, sms, threads) for mode in (1, 2, 3) for threads in (512, 640, 1024)]
    configs += [(mode, sms, threads) for mode in (4, 5, 6, 7) for threads in (512, 1024)]
    configs = [(m, g, t, 0) for m, g, t in configs]
    configs += [(mode, sms, threads, 0) for mode in (10, 11, 12, 13)
                for threads in (512, 1024)]
    configs += [(mode, sms, threads, rep) for mode in (8, 9) for threads in (512, 1024)
                for rep in (1, 4)]
    bufs = [table._handle.buffer, out._handle.buffer]
    for u in (4, 8):
        kernel = module.kernel(f"stream{u}")
        for mode, groups, threads, rep in configs:
            chunk = 32 * u * rep  # 16-byte units a claim (modes 8, 9)
            params = struct.pack("iiq", len(arrays), mode, chunk)
            ms = timed(lambda k=kernel, g=groups, t=threads, p=params: be.queue.dispatch(
                k, (g, 1, 1), (t, 1, 1), bufs, p))
            claims = f", {chunk * 16 // 1024} KiB claims" if mode in (8, 9) else ""
            rows.append((f"U={u} {MODES[mode]}, {groups} x {threads // 32} warps{claims}", ms,
                         nbytes / ms / 1e6))
    print(f"{len(arrays)} arrays, {nbytes / 1e9:.3f} GB; {sms} multiprocessors; "
          f"median of 3 x {args.reps} launches")
    for name, ms, gbs in rows:
        print(f"{name:70s} {ms:8.4f} ms {gbs:7.0f} GB/s")


if __name__ == "__main__":
    main()
