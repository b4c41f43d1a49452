"""A few eager ``attention_decode`` calls at the 1.1B model's shapes, for Nsight Compute.

    ncu --clock-control none --kernel-name regex:attention_decode --launch-skip 2 \
        --launch-count 2 --section WarpStateStats python scripts/ncu_attention.py 128 8000

Each position on the command line gets three calls (a cache of capacity 8192).
"""

from __future__ import annotations

import sys

import numpy as np


def main(positions: list[int]) -> None:
    import needle.backend_ndarray as nd

    dev = nd.cuda()
    rng = np.random.default_rng(0)

    def arr(shape):
        return nd.array(rng.standard_normal(shape, dtype=np.float32) * 0.5, device=dev,
                        dtype="bfloat16")

    qkv = arr((2560,))
    cos, sin = arr((8192, 32)), arr((8192, 32))
    keys, values = arr((1, 4, 8192, 64)), arr((1, 4, 8192, 64))
    for p in positions:
        pos = nd.array(np.array([p], np.int32), device=dev)
        for _ in range(3):
            nd.attention_decode(qkv, cos, sin, pos, keys, values, 32)
    dev.backend.synchronize()


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [128])
