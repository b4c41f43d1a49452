"""Data-parallel training, shared by test_data_parallel.py (the single-process reference)
and, run under `needle run -n 2 --backend mpi ddp_train.py CKPT`, the job itself: each rank
trains a replica (initialized differently on purpose: DDP must broadcast rank 0's) on its
DistributedSampler share, then rank 0 writes the checkpoint."""

import sys

import numpy as np

import needle as ndl
from needle import nn, optim
from needle.data import ArrayDataset, DataLoader

STEPS, SAMPLES, FEATURES, CLASSES = 4, 16, 6, 3


def build_model(seed: int, device=None) -> nn.Module:
    ndl.init.manual_seed(seed)
    device = device or ndl.cpu()
    return nn.Sequential(nn.Linear(FEATURES, 16, device=device), nn.ReLU(),
                         nn.Linear(16, CLASSES, device=device))


def dataset() -> ArrayDataset:
    rng = np.random.default_rng(7)
    return ArrayDataset(rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32),
                        rng.integers(0, CLASSES, SAMPLES).astype(np.int32))


def step(model, opt, x, y) -> None:
    opt.zero_grad()
    loss = nn.SoftmaxLoss()(model(x), y)
    loss.backward()
    opt.step()


def reference() -> nn.Module:
    """One process, the whole dataset as each step's batch."""
    model = build_model(100)  # what rank 0 starts from
    opt = optim.Adam(model.parameters(), lr=0.05)
    loader = DataLoader(dataset(), batch_size=SAMPLES, device=ndl.cpu())
    for _ in range(STEPS):
        for x, y in loader:
            step(model, opt, x, y)
    return model


def main(checkpoint: str) -> None:
    from needle import distributed as dist

    g = dist.init_process_group()
    model = dist.DistributedDataParallel(build_model(100 + g.rank, g.device),
                                         bucket_mb=0.0005)  # several buckets
    assert len(model._buckets()) > 1
    opt = optim.Adam(model.parameters(), lr=0.05)
    sampler = dist.DistributedSampler(dataset(), shuffle=True, seed=3)
    loader = DataLoader(dataset(), batch_size=SAMPLES // 2, sampler=sampler, device=g.device)
    for _ in range(STEPS):
        for x, y in loader:
            opt.zero_grad()
            model.backward(nn.SoftmaxLoss()(model(x), y))
            opt.step()
    dist.save_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict()},
                         checkpoint)
    print(f"trained {dist.get_rank()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
