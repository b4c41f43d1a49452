"""Data-parallel scaling of a transformer training step (weak scaling: the same batch per
rank, so N ranks process N times the samples):

    needle run -n 1 --backend nccl benchmarks/distributed_dp_step.py    # one GPU
    needle run -n 2 --backend nccl benchmarks/distributed_dp_step.py    # two
    needle run -n 2 --backend mpi benchmarks/distributed_dp_step.py --preset tiny

Rank 0 prints the median step time (forward, backward, gradient all-reduce, Adam step;
synchronized) and samples/s. Scaling efficiency = step time on 1 rank / step time on N
ranks; the issue's target is >= 90% on 2 GPUs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from needle import Tensor, nn, optim
from needle import backend_ndarray as nd
from needle import distributed as dist

PRESETS = {  # dim, layers, heads, mlp width, sequence, batch per rank
    "medium": (1024, 8, 16, 4096, 256, 16),
    "tiny": (32, 2, 4, 64, 16, 4),
}


class Model(nn.Module):
    def __init__(self, dim, layers, heads, width, seq, device):
        super().__init__()
        self.body = nn.Transformer(dim, width, layers, heads, max_len=seq, batch_first=True,
                                   device=device)
        self.head = nn.Linear(dim, dim, device=device)

    def forward(self, x):
        return self.head(self.body(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="medium", choices=PRESETS)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    g = dist.init_process_group()
    dim, layers, heads, width, seq, batch = PRESETS[args.preset]
    model = dist.DistributedDataParallel(Model(dim, layers, heads, width, seq, g.device))
    opt = optim.Adam(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(g.rank)
    x = Tensor(nd.array(rng.standard_normal((batch, seq, dim)).astype(np.float32),
                        device=g.device), requires_grad=False)
    target = Tensor(nd.array(rng.standard_normal((batch, seq, dim)).astype(np.float32),
                             device=g.device), requires_grad=False)
    times = []
    for step in range(args.steps + 2):  # two warm-up steps
        start = time.perf_counter()
        opt.zero_grad()
        diff = model(x) - target
        model.backward((diff * diff).sum() / diff.size)
        opt.step()
        dist.barrier()  # waits for this rank's queued work and for the others
        if step >= 2:
            times.append(time.perf_counter() - start)
    if g.rank == 0:
        median = statistics.median(times)
        print(f"DP={g.world_size} {args.preset} on {g.device.name} ({g.backend.name}): step "
              f"{median * 1e3:.1f} ms, {batch * g.world_size / median:.1f} samples/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
