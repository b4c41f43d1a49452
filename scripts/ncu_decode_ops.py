"""Eager calls of the decode step's ops at the 1.1B model's shapes, for Nsight Compute.

    ncu --clock-control none --kernel-name regex:'rmsnorm_gemv|gemv_t' --launch-skip 2 \
        --launch-count 2 --section LaunchStats python scripts/ncu_decode_ops.py gemv rmsnorm

Ops: attention (p = 128 and 8000), gemv (qkv shape), rmsnorm (rmsnorm_matvec, qkv shape),
swiglu (rmsnorm_matvec with SwiGLU, gate/up shape), add (matvec_add, down shape); each
three times.
"""

from __future__ import annotations

import sys

import numpy as np


def main(ops: list[str]) -> None:
    import needle.backend_ndarray as nd

    dev = nd.cuda()
    rng = np.random.default_rng(0)

    def arr(shape):
        return nd.array(rng.standard_normal(shape, dtype=np.float32) * 0.05, device=dev,
                        dtype="bfloat16")

    x, w = arr((1, 2048)), arr((2048,))
    w_qkv, w_gu = arr((2560, 2048)), arr((11264, 2048))
    w_down, a = arr((2048, 5632)), arr((1, 5632))
    calls = {
        "gemv": lambda: x @ w_qkv.transpose(),
        "rmsnorm": lambda: nd.rmsnorm_matvec(x, w, w_qkv, 1e-5),
        "swiglu": lambda: nd.rmsnorm_matvec(x, w, w_gu, 1e-5, "swiglu"),
        "add": lambda: nd.matvec_add(a, w_down, x),
    }
    if "attention" in ops:
        qkv, cos, sin = arr((2560,)), arr((8192, 32)), arr((8192, 32))
        keys, values = arr((1, 4, 8192, 64)), arr((1, 4, 8192, 64))
        for p in (128, 8000):
            pos = nd.array(np.array([p], np.int32), device=dev)
            for _ in range(3):
                nd.attention_decode(qkv, cos, sin, pos, keys, values, 32)
    for op in ops:
        if op in calls:
            for _ in range(3):
                calls[op]()
    dev.backend.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:] or ["gemv", "rmsnorm"])
