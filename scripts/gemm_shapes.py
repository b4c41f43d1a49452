"""GPU time of needle's bf16 GEMM against cuBLAS (through PyTorch) on square and Llama-1.1B
prefill shapes, each product replayed from a captured graph (so host time is left out),
with the TMA kernel's tile width chosen automatically and, with --widths, forced to each;
with --one-tile, also launched one group per tile instead of the persistent grid.

    python scripts/gemm_shapes.py [--widths] [--one-tile]

Each time is the median of 7 replays of 20 products, cuBLAS and the variants taking turns
at being replayed first. Prints per shape: cuBLAS µs, needle µs (auto width, then each
variant), needle ÷ cuBLAS speed, the kernel that ran, and max |needle - cuBLAS| / max
|cuBLAS|. Needs CUDA and PyTorch.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# (m, k, p, B stored K-major as a Linear layer's weight, else (k, p) as written)
SHAPES = [(1024, 1024, 1024, False), (2048, 2048, 2048, False), (4096, 4096, 4096, False),
          (8192, 8192, 8192, False), (2048, 2048, 2560, True), (2048, 2048, 2048, True),
          (2048, 2048, 11264, True), (2048, 5632, 2048, True), (2048, 2048, 32000, True),
          (512, 2048, 2560, True), (512, 2048, 11264, True), (512, 5632, 2048, True)]
REPS = 20  # products a replay
ROUNDS = 7  # timed replays of each variant, the order turning each round


def _torch_replay(torch, op):
    """``op`` REPS times captured in one CUDA graph by PyTorch; returns its replay."""
    op()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        op()
        with torch.cuda.graph(graph):
            for _ in range(REPS):
                op()
    torch.cuda.synchronize()
    return graph.replay


def _needle_replay(backend, op):
    """``op`` REPS times captured in one needle graph; returns its replay."""
    op()
    with backend.capture() as graph:
        for _ in range(REPS):
            op()
    return graph.replay


def rotated_medians(replays: dict, sync, rounds: int = ROUNDS) -> dict:
    """Median seconds a product of each replay: the benchmarks' interleaved sampling
    (benchmarks.runner.time_impls: the order turns each round, since the first sample after
    a pause can run at a higher GPU clock, docs/cuda_notes.md v28)."""
    from benchmarks.runner import Impl, Settings, time_impls

    impls = {name: Impl(replay, [()]) for name, replay in replays.items()}
    timings, errors = time_impls(impls, {name: sync for name in replays},
                                 Settings(repeat=rounds, min_sample_s=0.0))
    if errors:
        raise RuntimeError(f"replays failed: {errors}")
    return {name: t.median / REPS for name, t in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", action="store_true", help="also force each tile width")
    parser.add_argument("--one-tile", action="store_true",
                        help="also launch one group per tile (not persistent)")
    args = parser.parse_args()

    import torch

    from needle import backend_ndarray as nd

    dev = nd.cuda()
    be = dev.backend
    # (column, tuning overrides); the first is the default tuning
    variants = [("auto", {})] + ([(str(w), {"tma_tile": w}) for w in (256, 128, 64)]
                                 if args.widths else [])
    if args.one_tile:
        variants.append(("1/tile", {"tma_groups": 1 << 30}))
    head = " ".join(f"{name:>7}" for name, _ in variants)
    print(f"{'m, k, p':<18} {'B':<2} {'cuBLAS':>7} {head}  speed   error    kernel")
    for m, k, p, k_major in SHAPES:
        ta = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        tb = torch.randn((p, k) if k_major else (k, p), device="cuda", dtype=torch.bfloat16)
        tb_op = tb.T if k_major else tb
        a = nd.array(ta.float().cpu().numpy(), device=dev, dtype="bfloat16")
        b = nd.array(tb.float().cpu().numpy(), device=dev, dtype="bfloat16")
        b_op = b.transpose() if k_major else b
        want = (ta @ tb_op).float().cpu().numpy()
        replays = {"cuBLAS": _torch_replay(torch, lambda: ta @ tb_op)}  # noqa: B023
        error, kernel = 0.0, ""
        for name, overrides in variants:
            with be.tuned(**overrides):
                with be.profile() as prof:
                    got = (a @ b_op).numpy().astype(np.float32)
                replays[name] = _needle_replay(be, lambda: a @ b_op)  # noqa: B023
            error = max(error, float(np.abs(got - want).max() / np.abs(want).max()))
            if not overrides:
                kernel = ",".join(n for n in prof.totals if n.startswith("matmul"))
        med = rotated_medians(replays, torch.cuda.synchronize)
        cells = " ".join(f"{med[name] * 1e6:7.1f}" for name, _ in variants)
        print(f"{f'{m}, {k}, {p}':<18} {'K' if k_major else 'N':<2} {med['cuBLAS'] * 1e6:7.1f} "
              f"{cells}  {med['cuBLAS'] / med['auto']:5.2f}  {error:.0e}  {kernel}", flush=True)


if __name__ == "__main__":
    main()
