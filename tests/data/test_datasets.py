"""Dataset readers on tiny files written in each format."""

import gzip
import os
import pickle
import struct

import numpy as np
import pytest

from needle import data
from needle.errors import DataFormatError


def write_idx(path, array: np.ndarray, compress: bool = False):
    raw = bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    raw += array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)


@pytest.mark.parametrize("compress", [False, True])
def test_mnist(tmp_path, compress):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, 28, 28), dtype=np.uint8)
    labels = np.array([3, 1, 4, 1, 5], np.uint8)
    write_idx(tmp_path / "img", images, compress)
    write_idx(tmp_path / "lbl", labels, compress)
    ds = data.MNISTDataset(tmp_path / "img", tmp_path / "lbl")
    assert len(ds) == 5
    x, y = ds[2]
    assert x.shape == (1, 28, 28) and x.dtype == np.float32
    np.testing.assert_allclose(x[0], images[2] / 255, rtol=1e-6)
    assert y == 4
    xb, yb = ds.get_batch(np.array([4, 0]))
    assert xb.shape == (2, 1, 28, 28)
    np.testing.assert_array_equal(yb, [5, 3])


def test_mnist_errors(tmp_path):
    write_idx(tmp_path / "img", np.zeros((3, 2, 2)))
    write_idx(tmp_path / "lbl", np.zeros(4))
    with pytest.raises(DataFormatError, match="disagree"):
        data.MNISTDataset(tmp_path / "img", tmp_path / "lbl")
    (tmp_path / "short").write_bytes((tmp_path / "img").read_bytes()[:-1])
    with pytest.raises(DataFormatError, match="holds 11 bytes"):
        data.read_idx(tmp_path / "short")
    (tmp_path / "junk").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataFormatError, match="magic"):
        data.read_idx(tmp_path / "junk")
    with pytest.raises(DataFormatError, match="does not exist"):
        data.read_idx(tmp_path / "nope")


def write_cifar_batch(path, n, seed, bytes_keys: bool, protocol: int):
    rng = np.random.default_rng(seed)
    batch = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
             "labels": [int(v) for v in rng.integers(0, 10, n)]}
    if bytes_keys:  # the real files were pickled by Python 2: keys are bytes
        batch = {k.encode(): v for k, v in batch.items()}
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=protocol)
    return batch


@pytest.mark.parametrize("bytes_keys,protocol", [(True, 2), (False, 4), (False, 5)])
def test_cifar10(tmp_path, bytes_keys, protocol):
    b1 = write_cifar_batch(tmp_path / "data_batch_1", 3, 0, bytes_keys, protocol)
    b2 = write_cifar_batch(tmp_path / "data_batch_2", 2, 1, bytes_keys, protocol)
    bt = write_cifar_batch(tmp_path / "test_batch", 4, 2, bytes_keys, protocol)
    key = (lambda k: k.encode()) if bytes_keys else (lambda k: k)
    train = data.CIFAR10Dataset(tmp_path, train=True)
    assert len(train) == 5
    x, y = train.get_batch(np.arange(5))
    assert x.shape == (5, 3, 32, 32) and x.dtype == np.float32
    expected = np.concatenate([b1[key("data")], b2[key("data")]]).reshape(5, 3, 32, 32) / 255
    np.testing.assert_allclose(x, expected, rtol=1e-6)
    np.testing.assert_array_equal(y, b1[key("labels")] + b2[key("labels")])
    assert len(data.CIFAR10Dataset(tmp_path, train=False)) == 4
    assert bt is not None


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_cifar10_refuses_code_in_pickles(tmp_path):
    with open(tmp_path / "test_batch", "wb") as f:
        pickle.dump({"data": Exploit(), "labels": []}, f)
    with pytest.raises(DataFormatError, match="not allowed"):
        data.CIFAR10Dataset(tmp_path, train=False)
    with pytest.raises(DataFormatError, match="data_batch"):
        data.CIFAR10Dataset(tmp_path, train=True)


def test_digits_split_is_deterministic_and_disjoint():
    train, test = data.DigitsDataset(train=True), data.DigitsDataset(train=False)
    assert len(train) + len(test) == 1797 and len(test) == 359
    x, y = train.get_batch(np.arange(len(train)))
    assert x.shape == (len(train), 1, 8, 8) and 0 <= x.min() and x.max() <= 1
    assert set(np.unique(y)) == set(range(10))
    again, _ = data.DigitsDataset(train=True).get_batch(np.arange(len(train)))
    np.testing.assert_array_equal(x, again)
    tx, _ = test.get_batch(np.arange(len(test)))
    rows = {r.tobytes() for r in x.reshape(len(x), -1)}
    overlap = sum(r.tobytes() in rows for r in tx.reshape(len(tx), -1))
    assert overlap < 10  # the digits set has a few duplicate images, nothing more


def test_text_corpus(tmp_path):
    (tmp_path / "train.txt").write_text("the cat sat\nthe dog\n")
    (tmp_path / "test.txt").write_text("the bird\n")
    train = data.TextCorpus(tmp_path / "train.txt")
    assert train.dictionary.idx2word == ["the", "cat", "sat", "<eos>", "dog"]
    np.testing.assert_array_equal(train.ids, [0, 1, 2, 3, 0, 4, 3])
    test = data.TextCorpus(tmp_path / "test.txt", dictionary=train.dictionary)
    np.testing.assert_array_equal(test.ids, [0, 5, 3])
    assert len(data.TextCorpus(tmp_path / "train.txt", max_lines=1)) == 4
    with pytest.raises(DataFormatError, match="does not exist"):
        data.TextCorpus(tmp_path / "nope.txt")


def test_batchify_and_get_batch(device):
    ids = np.arange(11)
    batches = data.batchify(ids, 2)
    np.testing.assert_array_equal(batches, [[0, 5], [1, 6], [2, 7], [3, 8], [4, 9]])
    x, y = data.get_batch(batches, 1, bptt=3, device=device)
    assert x.device == device and x.dtype == "int64"
    np.testing.assert_array_equal(x.numpy(), [[1, 6], [2, 7], [3, 8]])
    np.testing.assert_array_equal(y.numpy(), [2, 7, 3, 8, 4, 9])
    x, y = data.get_batch(batches, 3, bptt=3, device=device)  # cut short at the end
    assert x.shape == (1, 2) and y.shape == (2,)
