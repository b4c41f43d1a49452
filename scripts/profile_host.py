"""Where the host's time goes per call: cProfile of one benchmark case on a device.

    python scripts/profile_host.py --device cuda --case mlp      # the MLP training step
    python scripts/profile_host.py --device cuda --case sum      # sum over rows of 4096²
    python scripts/profile_host.py --device cuda --case matmul --n 1024 --dtype bfloat16

Prints the wall time per call (the device synchronized once at the end) and the functions
with the most time of their own. On a GPU the kernels run asynchronously, so what the
profile shows is the host's cost of issuing them: Python in autograd, NDArray and the
backend, plus the driver calls.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import operator
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


def _in_turn(pairs: list):
    """A call computing ``a @ b`` of the next (a, b) of ``pairs``, cycling."""
    turn = itertools.count()
    return lambda: operator.matmul(*pairs[next(turn) % len(pairs)])


def _matmul(dev, n: int, dtype: str):
    """``a @ b`` of (n, n) NDArrays, eight input pairs in turn as the benchmark's case."""
    import needle.backend_ndarray as nd

    rng = np.random.default_rng(0)
    return _in_turn([tuple(nd.NDArray(rng.standard_normal((n, n), dtype=np.float32),
                                      device=dev, dtype=dtype) for _ in range(2))
                     for _ in range(8)])


def _torch_matmul(n: int, dtype: str):
    """The same products in PyTorch on the GPU, and its synchronize (None without torch or
    CUDA)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    g = torch.Generator(device="cuda").manual_seed(0)
    pairs = [tuple(torch.randn(n, n, device="cuda", generator=g).to(getattr(torch, dtype))
                   for _ in range(2)) for _ in range(8)]
    return _in_turn(pairs), torch.cuda.synchronize


def _wall(fn, sync, calls: int) -> tuple[float, float]:
    """Seconds a call, ``calls`` back to back and one synchronize at the end, and the
    seconds a call took to issue (the loop before the synchronize: the host's part, while
    the device's queue has room)."""
    for _ in range(10):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    sync()
    return (time.perf_counter() - t) / calls, (issued - t) / calls


def main() -> None:
    import needle.backend_ndarray as nd

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--case", choices=["mlp", "sum", "matmul"], default="mlp")
    ap.add_argument("--n", type=int, default=1024, help="matmul: the square size")
    ap.add_argument("--dtype", default="bfloat16", help="matmul: the dtype")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    dev = getattr(nd, args.device)()
    if args.case == "matmul":
        fn = _matmul(dev, args.n, args.dtype)
    else:
        fn = {"mlp": _mlp, "sum": _sum}[args.case](dev)
    be = dev.backend
    sync = getattr(be, "synchronize", lambda: None)
    peer = _torch_matmul(args.n, args.dtype) if args.case == "matmul" else None
    for _turn in range(3):  # alternate with the peer: the clock drifts between rounds
        wall, issue = _wall(fn, sync, args.calls)
        line = (f"{args.case} on {args.device}: {wall * 1e6:.1f} us per call (wall, no "
                f"profiler; {issue * 1e6:.1f} to issue)")
        if peer is not None:
            wall, issue = _wall(*peer, args.calls)
            line += f"; torch {wall * 1e6:.1f} us ({issue * 1e6:.1f} to issue)"
        print(line)
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
