"""Where the host's time goes per call: cProfile of one benchmark case on a device.

    python scripts/profile_host.py --device cuda --case mlp      # the MLP training step
    python scripts/profile_host.py --device cuda --case sum      # sum over rows of 4096²

Prints the wall time per call (the device synchronized once at the end) and the functions
with the most time of their own. On a GPU the kernels run asynchronously, so what the
profile shows is the host's cost of issuing them: Python in autograd, NDArray and the
backend, plus the driver calls.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np


def _mlp(dev):
    from needle import nn, optim
    from needle.autograd import Tensor

    rng = np.random.default_rng(0)
    widths = [784, 1024, 1024, 10]
    model = nn.Sequential(nn.Linear(784, 1024, device=dev), nn.ReLU(),
                          nn.Linear(1024, 1024, device=dev), nn.ReLU(),
                          nn.Linear(1024, 10, device=dev))
    loss_fn = nn.SoftmaxLoss()
    opt = optim.Adam(model.parameters(), lr=1e-3)
    x = Tensor(rng.standard_normal((512, widths[0]), dtype=np.float32), device=dev)
    y = Tensor(rng.integers(0, 10, size=512).astype(np.int64), device=dev)

    def step():
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    return step


def _sum(dev):
    import needle.backend_ndarray as nd

    x = nd.array(np.random.default_rng(0).standard_normal((4096, 4096), dtype=np.float32),
                 device=dev)
    return lambda: x.sum(axis=1)


def main() -> None:
    import needle.backend_ndarray as nd

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--case", choices=["mlp", "sum"], default="mlp")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    dev = getattr(nd, args.device)()
    fn = {"mlp": _mlp, "sum": _sum}[args.case](dev)
    be = dev.backend
    sync = getattr(be, "synchronize", lambda: None)
    for _ in range(10):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(args.calls):
        fn()
    sync()
    wall = (time.perf_counter() - t) / args.calls
    print(f"{args.case} on {args.device}: {wall * 1e6:.1f} us per call (wall, no profiler)")
    if hasattr(dev.backend, "profile"):  # GPUs: the kernels' own time, from events
        with dev.backend.profile() as kernels:
            for _ in range(20):
                fn()
        print(f"device {kernels.total_ms / 20 * 1e3:.1f} us per call, "
              f"{sum(t.calls for t in kernels.totals.values()) / 20:.0f} kernels per call")
        print(kernels.table(15))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        fn()
    sync()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
