"""The latency of small all-reduces as a tensor-parallel decode step makes them (a bf16
residual of 4-512 KiB, summed in place), on ordinary arrays and on ``symmetric_empty``'s:

    needle run -n 2 --backend nccl benchmarks/distributed_allreduce_latency.py
    needle run -n 2 --backend mpi benchmarks/distributed_allreduce_latency.py --repeat 4

Where the backend records device work (nccl) the all-reduces are recorded ``--repeat`` at a
time into one graph, as in a captured decode step, and the graph replayed (each replay
synchronized): µs = the median replay / repeat. Elsewhere they are called one after
another. With NCCL >= 2.27 the symmetric column is NCCL's symmetric kernels. Rank 0 prints
the table.
"""

from __future__ import annotations

import argparse
import statistics
import time

from needle import backend_ndarray as nd
from needle import distributed as dist


def per_call_us(x: nd.NDArray, repeat: int, samples: int) -> float:
    """Median µs of one in-place all_reduce of x, ``repeat`` queued back to back."""
    recorded = x.device.kind == "cuda"  # the nccl backend's collectives record into graphs

    def run_all() -> None:
        for _ in range(repeat):
            dist.all_reduce(x)

    graph = None
    if recorded:
        with x.device.backend.capture() as graph:
            run_all()
    run = graph.replay if graph is not None else run_all
    for _ in range(3):
        run()
    dist.synchronize()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        run()
        dist.synchronize()
        times.append(time.perf_counter() - start)
    if graph is not None:
        graph.close()
    return statistics.median(times) / repeat * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-kib", type=int, default=4)
    p.add_argument("--max-kib", type=int, default=512)
    p.add_argument("--repeat", type=int, default=64, help="all-reduces a graph")
    p.add_argument("--samples", type=int, default=30)
    args = p.parse_args()
    g = dist.init_process_group()
    rows, kib = [], args.min_kib
    while kib <= args.max_kib:
        count = kib * 1024 // 2
        times = []
        for x in (nd.empty((count,), "bfloat16", g.device),
                  dist.symmetric_empty((count,), "bfloat16")):
            x.fill(0.0)  # sums of zeros stay zero however many calls run
            times.append(per_call_us(x, args.repeat, args.samples))
        rows.append((count * 2, *times))
        kib *= 2
    if g.rank == 0:
        print(f"all_reduce bfloat16 sum latency, {g.world_size} ranks, {g.backend.name} on "
              f"{g.device.name}, µs a call ({args.repeat} back to back)")
        print(f"{'bytes':>10} {'ordinary':>9} {'symmetric':>10}")
        for nbytes, plain, symmetric in rows:
            print(f"{nbytes:>10} {plain:>9.2f} {symmetric:>10.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
