"""Datasets and the DataLoader that batches them into Tensors.

A dataset gives samples as tuples of numpy arrays (image, label, ...). The DataLoader asks
for a whole batch at once through ``get_batch(indices)``: array-backed datasets answer with
one fancy-indexing operation per array and transform the batch as one array, so loading
costs a few numpy calls per batch instead of a Python call per sample.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .. import checks, init
from ..autograd import Tensor
from ..backend_ndarray import NDArray, as_device, default_device
from ..errors import ArgumentError, ArgumentTypeError, IndexOutOfRangeError, ShapeError


def stack_samples(dataset, indices: np.ndarray) -> tuple[np.ndarray, ...]:
    """Batch any indexable dataset one sample at a time (the fallback for plain sequences)."""
    samples = [dataset[int(i)] for i in indices]
    samples = [s if isinstance(s, tuple) else (s,) for s in samples]
    return tuple(np.stack([np.asarray(x) for x in field]) for field in zip(*samples))


class Dataset:
    """A sized collection of samples. Subclasses define ``__getitem__`` and ``__len__``,
    or ``get_batch`` and ``__len__`` (then ``__getitem__`` comes for free)."""

    def __init__(self, transforms: Sequence | None = None):
        self.transforms = list(transforms or [])

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, index) -> tuple[np.ndarray, ...]:
        """One sample for an int; a batch (arrays with a first sample axis) for a slice or
        a sequence of indices, as the needle course's datasets give."""
        if isinstance(index, slice):
            return self.get_batch(np.arange(len(self))[index])
        if isinstance(index, (list, tuple, np.ndarray)):
            return self.get_batch(np.asarray(index, dtype=np.int64))
        return tuple(a[0] for a in self.get_batch(np.array([index])))

    def get_batch(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
        """The samples at ``indices`` stacked along a new first axis."""
        return stack_samples(self, indices)

    def apply_transforms(self, images: np.ndarray) -> np.ndarray:
        for transform in self.transforms:
            images = transform(images)
        return images


class ArrayDataset(Dataset):
    """Samples are rows of equal-length arrays; transforms apply to the first (the images)."""

    def __init__(self, *arrays: np.ndarray, transforms: Sequence | None = None):
        super().__init__(transforms)
        if not arrays:
            raise ShapeError("ArrayDataset needs at least one array")
        self.arrays = tuple(np.asarray(a) for a in arrays)
        for i, a in enumerate(self.arrays):
            if a.ndim == 0:
                raise ShapeError(f"ArrayDataset: array {i} is a scalar; every array needs a "
                                 "first (sample) axis")
        lengths = {len(a) for a in self.arrays}
        if len(lengths) != 1:
            raise ShapeError(f"ArrayDataset arrays differ in length: "
                             f"{[len(a) for a in self.arrays]}")

    def __len__(self) -> int:
        return len(self.arrays[0])

    def get_batch(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
        try:
            indices = np.asarray(indices, dtype=np.int64)
        except (TypeError, ValueError):
            raise ArgumentTypeError(f"dataset index must be an int or an array of ints, got "
                                    f"{indices!r:.60}") from None
        n = len(self)
        if indices.size and (indices.min() < -n or indices.max() >= n):
            raise IndexOutOfRangeError(f"dataset index out of range for {n} samples")
        first, *rest = (a[indices] for a in self.arrays)
        return (self.apply_transforms(first), *rest) if self.transforms else (first, *rest)


NDArrayDataset = ArrayDataset  # the needle course's name (hw4): rows of equal-length arrays


class DataLoader:
    """Iterate over ``dataset`` in batches of Tensors on ``device``.

    With ``shuffle``, each pass visits the samples in a new order. Given a ``seed``, pass
    number ``epoch`` uses the order seeded by (seed, epoch), so setting ``loader.epoch``
    reproduces the order of any pass (for resuming training); without one, orders come from
    ``needle.init``'s generator. ``drop_last`` leaves out a final short batch.

    ``num_workers=N`` loads batches on N threads, ``prefetch_factor`` batches per thread
    ahead of the training loop; batches still come in order. The shuffling order does not
    depend on the workers, but random transforms then draw from their generator in the
    order the threads reach it, so augmentations repeat exactly only with ``num_workers=0``
    (or a dataset whose transforms have their own per-batch seed).

    A ``sampler`` (``needle.distributed.DistributedSampler``: ``indices(epoch)`` and
    ``len``) chooses the samples and their order of each pass instead.
    """

    def __init__(self, dataset, batch_size: int = 1, shuffle: bool = False,
                 drop_last: bool = False, seed: int | None = None, device=None,
                 num_workers: int = 0, prefetch_factor: int = 2, sampler=None):
        batch_size = checks.positive(batch_size, "batch_size", "DataLoader")
        if sampler is not None and not (hasattr(sampler, "indices") and hasattr(sampler,
                                                                                "__len__")):
            raise ArgumentTypeError(f"DataLoader: sampler must have indices(epoch) and len() "
                                    f"(a DistributedSampler), got {type(sampler).__name__}")
        if sampler is not None and shuffle:
            raise ArgumentError("DataLoader: the sampler orders the samples; pass shuffle to "
                                "the sampler, not the DataLoader")
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ArgumentTypeError(f"DataLoader: dataset must be a Dataset (or any object with "
                                    f"__len__ and __getitem__), got {type(dataset).__name__}")
        if device is not None:
            device = as_device(device)
        if seed is not None:
            checks.integer(seed, "seed", "DataLoader")
        self.num_workers = checks.integer(num_workers, "num_workers", "DataLoader", 0)
        self.prefetch_factor = checks.positive(prefetch_factor, "prefetch_factor", "DataLoader")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.device = device
        self.sampler = sampler
        self.epoch = 0

    def __len__(self) -> int:
        n = len(self.dataset) if self.sampler is None else len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def _order(self) -> np.ndarray:
        if self.sampler is not None:
            return np.asarray(self.sampler.indices(self.epoch))
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        rng = (np.random.default_rng((self.seed, self.epoch)) if self.seed is not None
               else init.default_generator())
        return rng.permutation(n)

    def _load(self, order: np.ndarray, b: int) -> tuple[np.ndarray, ...]:
        """Batch ``b``'s arrays, on the host (what a worker thread does)."""
        indices = order[b * self.batch_size:(b + 1) * self.batch_size]
        get_batch = getattr(self.dataset, "get_batch", None)
        return get_batch(indices) if get_batch else stack_samples(self.dataset, indices)

    def _host_batches(self, order: np.ndarray) -> Iterator[tuple[np.ndarray, ...]]:
        """The batches in order: loaded here, or with ``num_workers`` threads keeping up to
        ``num_workers * prefetch_factor`` batches loading ahead (numpy indexing and most
        transforms release the GIL, so the threads run in parallel)."""
        if self.num_workers == 0:
            for b in range(len(self)):
                yield self._load(order, b)
            return
        ahead = self.num_workers * self.prefetch_factor
        pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="needle-loader")
        try:
            pending: deque[Future] = deque()
            for b in range(len(self)):
                pending.append(pool.submit(self._load, order, b))
                if len(pending) >= ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:  # also when the loop stops early: drop the batches not yet started
            pool.shutdown(wait=True, cancel_futures=True)

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        order = self._order()
        self.epoch += 1
        device = self.device or default_device()
        for arrays in self._host_batches(order):  # copies to the device stay on this thread
            yield tuple(Tensor(NDArray(a, device=device), requires_grad=False) for a in arrays)
