"""DataLoader batching and shuffling, and the batch transforms."""

import numpy as np
import pytest

from needle import data, init
from needle.errors import ArgumentError, ShapeError


def make_dataset(n=10, transforms=None):
    x = np.arange(n * 4, dtype=np.float32).reshape(n, 1, 2, 2)
    return data.ArrayDataset(x, np.arange(n), transforms=transforms)


def test_batches_in_order(device):
    loader = data.DataLoader(make_dataset(), batch_size=4, device=device)
    batches = list(loader)
    assert len(loader) == len(batches) == 3
    x, y = batches[-1]
    assert x.device == device and x.dtype == "float32" and y.dtype == "int64"
    assert x.shape == (2, 1, 2, 2)
    np.testing.assert_array_equal(np.concatenate([b[1].numpy() for b in batches]), np.arange(10))
    assert not x.requires_grad
    dropped = data.DataLoader(make_dataset(), batch_size=4, drop_last=True)
    assert len(dropped) == len(list(dropped)) == 2


def test_shuffle_is_a_permutation_and_seeded():
    def labels(loader):
        return np.concatenate([y.numpy() for _, y in loader])

    loader = data.DataLoader(make_dataset(), batch_size=3, shuffle=True, seed=5)
    first, second = labels(loader), labels(loader)
    assert sorted(first) == list(range(10)) and not (first == second).all()
    other = data.DataLoader(make_dataset(), batch_size=3, shuffle=True, seed=5)
    np.testing.assert_array_equal(labels(other), first)
    other.epoch = 1  # resuming at the second pass reproduces its order
    np.testing.assert_array_equal(labels(other), second)
    init.manual_seed(2)
    unseeded = labels(data.DataLoader(make_dataset(), batch_size=3, shuffle=True))
    init.manual_seed(2)
    np.testing.assert_array_equal(
        labels(data.DataLoader(make_dataset(), batch_size=3, shuffle=True)), unseeded)


def test_plain_sequences_and_custom_datasets():
    samples = [(np.full(2, i, np.float32), i) for i in range(5)]
    x, y = next(iter(data.DataLoader(samples, batch_size=5)))
    np.testing.assert_array_equal(y.numpy(), np.arange(5))

    class Squares(data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.array([i * i], np.float32), i

    (x, y), = list(data.DataLoader(Squares(), batch_size=4))
    np.testing.assert_array_equal(x.numpy()[:, 0], [0, 1, 4, 9])


def test_errors():
    with pytest.raises(ArgumentError, match="batch_size must be >= 1"):
        data.DataLoader(make_dataset(), batch_size=0)
    with pytest.raises(ShapeError, match="length"):
        data.ArrayDataset(np.zeros(3), np.zeros(4))
    with pytest.raises(IndexError):
        make_dataset().get_batch(np.array([10]))


def test_flip():
    images = np.arange(2 * 1 * 2 * 3, dtype=np.float32).reshape(2, 1, 2, 3)
    np.testing.assert_array_equal(data.RandomFlipHorizontal(p=1.0)(images),
                                  images[..., ::-1])
    np.testing.assert_array_equal(data.RandomFlipHorizontal(p=0.0)(images), images)
    out = data.RandomFlipHorizontal(seed=0)(np.repeat(images[:1], 200, axis=0))
    flipped = (out == images[0, ..., ::-1]).all(axis=(1, 2, 3))
    assert 60 < flipped.sum() < 140


def test_crop_shifts_with_zero_fill():
    image = np.arange(1, 26, dtype=np.float32).reshape(1, 1, 5, 5)
    crop = data.RandomCrop(padding=2, seed=1)
    out = crop(np.repeat(image, 50, axis=0))
    assert out.shape == (50, 1, 5, 5)
    padded = np.pad(image[0, 0], 2)
    for o in out[:, 0]:  # each output is a 5x5 window of the zero-padded image
        assert any((padded[dy:dy + 5, dx:dx + 5] == o).all()
                   for dy in range(5) for dx in range(5))
    assert len({o.tobytes() for o in out}) > 5
    np.testing.assert_array_equal(data.RandomCrop(padding=0)(image), image)


def test_normalize_and_dataset_transforms():
    norm = data.Normalize(mean=[1.0, 2.0], std=[2.0, 4.0])
    images = np.ones((3, 2, 2, 2), np.float32) * np.array([3.0, 6.0]).reshape(1, 2, 1, 1)
    np.testing.assert_allclose(norm(images), np.ones_like(images))
    with pytest.raises(ShapeError):
        norm(np.ones((1, 3, 2, 2), np.float32))
    with pytest.raises(ShapeError, match="N, C, H, W"):
        norm(np.ones((3, 2), np.float32))  # (3-D is one (H, W, C) image)
    ds = make_dataset(transforms=[data.Normalize(10.0, 2.0), data.RandomFlipHorizontal(p=1.0)])
    x, _ = ds[0]
    np.testing.assert_allclose(x, ((np.arange(4.0).reshape(1, 2, 2) - 10) / 2)[..., ::-1])
