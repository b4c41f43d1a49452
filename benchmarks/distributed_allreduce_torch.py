"""The peer of distributed_allreduce.py: ``torch.distributed.all_reduce`` (PyTorch's NCCL)
timed the same way, one process a GPU:

    torchrun --nproc_per_node 2 benchmarks/distributed_allreduce_torch.py
    torchrun --nproc_per_node 2 benchmarks/distributed_allreduce_torch.py --max-mib 1  # CPU: gloo

For each size from 1 MiB to 1 GiB: the median of 20 synchronized in-place float32 sums
after two warm-ups, algorithm and bus bandwidth (nccl-tests' busbw = algbw * 2 (n - 1) / n).
Rank 0 prints the table in distributed_allreduce.py's columns. Without a GPU it runs on the
CPU through gloo (a smoke test of the script, not a peer worth quoting).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    import torch
    import torch.distributed as td

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-mib", type=float, default=1)
    p.add_argument("--max-mib", type=float, default=1024)
    p.add_argument("--samples", type=int, default=20)
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    td.init_process_group("nccl" if gpu else "gloo")
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    n, mib, rows = td.get_world_size(), args.min_mib, []

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    while mib <= args.max_mib:
        x = torch.ones(int(mib * 2**20) // 4, dtype=torch.float32,
                       device="cuda" if gpu else "cpu")
        for _ in range(2):
            td.all_reduce(x)
        sync()
        times = []
        for _ in range(args.samples):
            start = time.perf_counter()
            td.all_reduce(x)
            sync()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        algbw = x.numel() * 4 / seconds / 1e9
        rows.append((x.numel() * 4, seconds * 1e6, algbw, algbw * 2 * (n - 1) / n))
        mib *= 2
    if td.get_rank() == 0:
        backend = (f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))}" if gpu
                   else "gloo on cpu")
        print(f"all_reduce float32 sum, {n} ranks, torch {torch.__version__} {backend}")
        print(f"{'bytes':>12} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
        for nbytes, us, algbw, busbw in rows:
            print(f"{nbytes:>12} {us:>10.1f} {algbw:>11.2f} {busbw:>11.2f}")
    td.destroy_process_group()


if __name__ == "__main__":
    main()
