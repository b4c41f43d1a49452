"""Image datasets read from local files: scikit-learn's digits, MNIST and CIFAR-10.

Nothing is downloaded: each reader takes files the user already has. Images come out as
float32 in [0, 1] shaped (N, C, H, W) and labels as int64, ready for ``nn.Conv``.
"""

from __future__ import annotations

import gzip
import io
import pickle
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import DataFormatError
from .dataset import ArrayDataset


class DigitsDataset(ArrayDataset):
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes).

    The train/test split is a permutation seeded by ``split_seed``, so it is the same on
    every machine; ``test_fraction`` of the images are held out.
    """

    def __init__(self, train: bool = True, test_fraction: float = 0.2, split_seed: int = 0,
                 transforms: Sequence | None = None):
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise DataFormatError("DigitsDataset reads scikit-learn's bundled digits; install "
                                  "it with `pip install scikit-learn`") from None
        if not 0 < test_fraction < 1:
            raise DataFormatError(f"test_fraction must be in (0, 1), got {test_fraction}")
        digits = load_digits()
        images = (digits.images / 16.0).astype(np.float32)[:, None]  # values are 0..16
        labels = digits.target.astype(np.int64)
        order = np.random.default_rng(split_seed).permutation(len(labels))
        n_test = round(len(labels) * test_fraction)
        chosen = order[n_test:] if train else order[:n_test]
        super().__init__(images[chosen], labels[chosen], transforms=transforms)


def _read_maybe_gzip(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataFormatError(f"dataset file {path} does not exist") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise DataFormatError(f"{path}: corrupt gzip data ({e})") from None
    return raw


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file of unsigned bytes (the MNIST format), gzipped or not, as a uint8 array."""
    path = Path(path)
    raw = _read_maybe_gzip(path)
    if len(raw) < 4 or raw[:2] != b"\0\0":
        raise DataFormatError(f"{path} is not an IDX file (bad magic number)")
    kind, ndim = raw[2], raw[3]
    if kind != 0x08:
        raise DataFormatError(f"{path}: IDX element type {kind:#x} is not unsigned byte (0x08)")
    if len(raw) < 4 + 4 * ndim:
        raise DataFormatError(f"{path}: truncated IDX header")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, offset=4))
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise DataFormatError(f"{path}: header says shape {shape} ({int(np.prod(shape))} "
                              f"bytes) but the file holds {data.size} bytes of data")
    return data.reshape(shape)


class MNISTDataset(ArrayDataset):
    """MNIST-format images and labels from local IDX files (``.gz`` or not)."""

    def __init__(self, image_filename: str | Path, label_filename: str | Path,
                 transforms: Sequence | None = None):
        images = read_idx(image_filename)
        labels = read_idx(label_filename)
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataFormatError(f"MNIST files disagree: images {images.shape} (need N, H, W) "
                                  f"and labels {labels.shape} (need N)")
        super().__init__((images.astype(np.float32) / 255)[:, None], labels.astype(np.int64),
                         transforms=transforms)


class _ArrayUnpickler(pickle.Unpickler):
    """Rebuilds only numpy arrays and builtin containers: a pickle naming any other callable
    (the way a malicious file runs code) is refused."""

    _ALLOWED = frozenset({
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    })

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a data file")
        return super().find_class(module, name)


def load_array_pickle(path: str | Path):
    """Unpickle a file made of numpy arrays, numbers, strings, lists and dicts only."""
    path = Path(path)
    raw = _read_maybe_gzip(path)
    try:
        return _ArrayUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise DataFormatError(f"{path}: not a pickle of plain arrays ({e})") from None


def _field(batch: dict, name: str, path: Path):
    for key in (name, name.encode()):
        if key in batch:
            return batch[key]
    raise DataFormatError(f"{path}: CIFAR-10 batch has no {name!r} entry")


class CIFAR10Dataset(ArrayDataset):
    """CIFAR-10 from the "python version" batches (``data_batch_1`` .. ``data_batch_5`` and
    ``test_batch``) in ``base_folder``; images are (N, 3, 32, 32)."""

    def __init__(self, base_folder: str | Path, train: bool = True,
                 transforms: Sequence | None = None):
        folder = Path(base_folder)
        files = sorted(folder.glob("data_batch_*")) if train else [folder / "test_batch"]
        if not files or not all(f.is_file() for f in files):
            raise DataFormatError(f"no CIFAR-10 {'data_batch_*' if train else 'test_batch'} "
                                  f"file in {folder}")
        images, labels = [], []
        for path in files:
            batch = load_array_pickle(path)
            if not isinstance(batch, dict):
                raise DataFormatError(f"{path}: a CIFAR-10 batch is a dict, got "
                                      f"{type(batch).__name__}")
            data = np.asarray(_field(batch, "data", path))
            label = np.asarray(_field(batch, "labels", path), dtype=np.int64)
            if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(label):
                raise DataFormatError(f"{path}: data {data.shape} should be (N, 3072) with one "
                                      f"label each ({len(label)} labels)")
            images.append(data.reshape(-1, 3, 32, 32))
            labels.append(label)
        super().__init__(np.concatenate(images).astype(np.float32) / 255,
                         np.concatenate(labels), transforms=transforms)
