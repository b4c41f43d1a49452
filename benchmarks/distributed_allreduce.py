"""all_reduce bandwidth, reported as nccl-tests reports it, for every rank of a job:

    needle run -n 2 --backend nccl benchmarks/distributed_allreduce.py      # 2 GPUs
    needle run -n 2 --backend mpi benchmarks/distributed_allreduce.py --max-mib 16

For each size: the median time of an in-place float32 sum over the ranks (each sample
synchronized: ``dist.synchronize()`` on the nccl stream), algorithm bandwidth
(bytes / time) and bus bandwidth = algbw * 2 (n - 1) / n, nccl-tests' definition, which is
what `all_reduce_perf` prints in its busbw column on the same machine. Rank 0 prints the
table and, with --json, writes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from needle import backend_ndarray as nd
from needle import distributed as dist


def measure(x, samples: int) -> float:
    """Median seconds of one all_reduce of x (after two warm-up calls)."""
    for _ in range(2):
        dist.all_reduce(x)
    dist.synchronize()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        dist.all_reduce(x)
        dist.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-mib", type=float, default=1)
    p.add_argument("--max-mib", type=float, default=1024)
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    g = dist.init_process_group()
    n, rows, mib = g.world_size, [], args.min_mib
    while mib <= args.max_mib:
        count = int(mib * 2**20) // 4
        x = nd.full((count,), 1.0, "float32", g.device)
        seconds = measure(x, args.samples)
        algbw = count * 4 / seconds / 1e9
        rows.append({"bytes": count * 4, "us": seconds * 1e6, "algbw_gbs": algbw,
                     "busbw_gbs": algbw * 2 * (n - 1) / n})
        expected = float(n) ** (2 + args.samples)  # every call doubled (n = 2) the ones
        assert abs(x[:1].numpy()[0] - expected) <= 1e-3 * expected or n == 1
        mib *= 2
    if g.rank == 0:
        print(f"all_reduce float32 sum, {n} ranks, {g.backend.name} on {g.device.name}")
        print(f"{'bytes':>12} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
        for r in rows:
            print(f"{r['bytes']:>12} {r['us']:>10.1f} {r['algbw_gbs']:>11.2f} "
                  f"{r['busbw_gbs']:>11.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": n, "backend": g.backend.name, "rows": rows}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
