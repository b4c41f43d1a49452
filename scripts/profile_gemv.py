"""In-graph cost of each kernel of the 1.1B decode step, one kind at a time.

Each op is captured 20 times back to back in a CUDA graph and replayed; time per op is what
it costs inside the decode step's graph (launch gap included), so the step's time can be
split into matrix-vector products (against bytes / copy bandwidth) and small kernels.

    python scripts/profile_gemv.py
"""

from __future__ import annotations

import time

import numpy as np


def per_op(be, body, reps: int = 20, replays: int = 20) -> float:
    with be.capture() as graph:
        for _ in range(reps):
            body()
    graph.replay()
    be.synchronize()
    t = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    be.synchronize()
    return (time.perf_counter() - t) / (replays * reps)


def main() -> None:
    import needle.backend_ndarray as nd

    dev = nd.cuda()
    be = dev.backend
    rng = np.random.default_rng(0)

    def arr(shape, dtype="bfloat16"):
        return nd.array(rng.standard_normal(shape, dtype=np.float32) * 0.02, device=dev,
                        dtype=dtype)

    print(f"{'op':<34} {'us/op':>8} {'GB/s':>8}")
    for name, (out_f, in_f) in {"qkv 2560x2048": (2560, 2048), "o 2048x2048": (2048, 2048),
                                "gate_up 11264x2048": (11264, 2048),
                                "down 2048x5632": (2048, 5632),
                                "lm_head 32000x2048": (32000, 2048)}.items():
        w = arr((out_f, in_f)).transpose()
        x = arr((1, 1, in_f))
        t = per_op(be, lambda x=x, w=w: x @ w)
        print(f"gemv {name:<29} {t * 1e6:>8.2f} {out_f * in_f * 2 / t / 1e9:>8.0f}")
    x, d, w = arr((1, 2048)), arr((1, 2048)), arr((2048,))
    for name, (out_f, in_f, kind) in {"qkv": (2560, 2048, None), "gate_up": (5632, 2048, "swiglu"),
                                      "lm_head": (32000, 2048, None)}.items():
        rows = out_f * (2 if kind else 1)
        wt = arr((rows, in_f))
        t = per_op(be, lambda wt=wt, kind=kind: nd.rmsnorm_matvec(x, w, wt, 1e-5, kind))
        print(f"{'rmsnorm_matvec ' + name:<34} {t * 1e6:>8.2f} {rows * in_f * 2 / t / 1e9:>8.0f}")
    for name, (out_f, in_f) in {"o": (2048, 2048), "down": (2048, 5632)}.items():
        wt, a = arr((out_f, in_f)), arr((1, in_f))
        t = per_op(be, lambda wt=wt, a=a: nd.matvec_add(a, wt, d))
        print(f"{'matvec_add ' + name:<34} {t * 1e6:>8.2f} {out_f * in_f * 2 / t / 1e9:>8.0f}")
    t = per_op(be, lambda: nd.add_rmsnorm(x, d, w, 1e-5, inplace=True))
    print(f"{'add_rmsnorm 2048':<34} {t * 1e6:>8.2f}")
    gu = arr((1, 11264))
    t = per_op(be, lambda: gu.swiglu())
    print(f"{'swiglu 5632':<34} {t * 1e6:>8.2f}")
    qkv = arr((2560,))
    cos, sin = arr((8192, 32)), arr((8192, 32))
    keys, values = arr((1, 4, 8192, 64)), arr((1, 4, 8192, 64))
    for label, positions, tuning in (("", (128, 640, 1152, 4000, 8000), {}),
                                     ("flash ", (128, 1152, 8000), {"decode_attention": "flash"}),
                                     ("tc ", (128, 1152, 8000), {"decode_attention": "tc"}),
                                     ("64 splits ", (1152, 8000), {"decode_splits": 64}),
                                     ("split ", (128, 1152, 8000), {"decode_attention": "split"})):
        with be.tuned(**tuning):
            for p in positions:
                pos = nd.array(np.array([p], np.int32), device=dev)
                t = per_op(be, lambda pos=pos: nd.attention_decode(qkv, cos, sin, pos, keys,
                                                                   values, 32))
                print(f"{'attention_decode ' + label + 'p=' + str(p):<34} {t * 1e6:>8.2f}")
    tok = nd.zeros((1, 1), "int32", dev)
    t = per_op(be, lambda: tok.fill(3))
    print(f"{'fill (a near-empty kernel)':<34} {t * 1e6:>8.2f}")


if __name__ == "__main__":
    main()
