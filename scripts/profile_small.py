"""Host time against device time for the small benchmark cases (sums and softmax on 4096²).

A case is host-bound when issuing a call takes longer than the kernel runs: then batching
calls does not hide the host time and the benchmark measures Python, not the GPU.

    python scripts/profile_small.py
"""

from __future__ import annotations

import time

import numpy as np


def main() -> None:
    import needle.backend_ndarray as nd

    dev = nd.cuda()
    be = dev.backend
    x = nd.array(np.random.default_rng(0).standard_normal((4096, 4096), dtype=np.float32),
                 device=dev)
    cases = {"sum rows (axis 1)": lambda: x.sum(axis=1), "sum cols (axis 0)": lambda: x.sum(axis=0),
             "softmax rows": lambda: x.softmax()}
    n = 200
    print(f"{'case':<20} {'issue us/call':>14} {'wall us/call':>13} {'device us':>10}  kernels")
    for name, fn in cases.items():
        for _ in range(10):
            fn()
        be.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        issue = (time.perf_counter() - t) / n
        be.synchronize()
        wall = (time.perf_counter() - t) / n
        with be.profile() as prof:
            for _ in range(20):
                fn()
        kernels = ", ".join(f"{k} {v.mean_us:.1f}" for k, v in prof.totals.items())
        print(f"{name:<20} {issue * 1e6:>14.1f} {wall * 1e6:>13.1f} "
              f"{prof.total_ms / 20 * 1e3:>10.1f}  {kernels}")


if __name__ == "__main__":
    main()
