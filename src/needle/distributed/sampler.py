"""``DistributedSampler``: each rank's share of a dataset, a new order every epoch.

Every rank draws the same permutation (seeded by seed and epoch), pads it by repeating its
start so that it divides evenly (or, with ``drop_last``, cuts the remainder), and takes
every world_size-th index from its rank on: the shares are disjoint, equally long, and
together cover the dataset.
"""

from __future__ import annotations

import math

import numpy as np

from .. import checks
from ..errors import ArgumentError, ArgumentTypeError
from .group import get_rank, get_world_size


class DistributedSampler:
    """Indices of this rank's samples; pass it as ``DataLoader(dataset, sampler=...)``.

    ``num_replicas``/``rank`` default to the process group's (1 and 0 without one).
    """

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        where = "DistributedSampler"
        if not hasattr(dataset, "__len__"):
            raise ArgumentTypeError(f"{where}: dataset must be sized (a Dataset, or anything "
                                    f"with len()), got {type(dataset).__name__}")
        self.num_samples_total = len(dataset)
        self.num_replicas = checks.positive(get_world_size() if num_replicas is None
                                            else num_replicas, "num_replicas", where)
        self.rank = checks.integer(get_rank() if rank is None else rank, "rank", where, 0)
        if self.rank >= self.num_replicas:
            raise ArgumentError(f"{where}: rank {self.rank} is outside 0..{self.num_replicas - 1}")
        self.shuffle, self.seed, self.drop_last = shuffle, checks.integer(seed, "seed", where), \
            drop_last
        n, w = self.num_samples_total, self.num_replicas
        self.num_samples = n // w if drop_last else math.ceil(n / w)
        self.epoch = 0

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use the order of pass ``epoch`` (the DataLoader sets it at each pass)."""
        self.epoch = checks.integer(epoch, "epoch", "DistributedSampler.set_epoch", 0)

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's sample indices for pass ``epoch`` (default ``self.epoch``)."""
        epoch = self.epoch if epoch is None else epoch
        n = self.num_samples_total
        order = (np.random.default_rng((self.seed, epoch)).permutation(n) if self.shuffle
                 else np.arange(n))
        total = self.num_samples * self.num_replicas
        if total > n:  # pad by repeating the start (over and over for tiny datasets)
            order = np.resize(order, total)
        return order[:total][self.rank::self.num_replicas]

    def __iter__(self):
        return iter(self.indices().tolist())
