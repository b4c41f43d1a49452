"""Word-level text corpora for language models: a local text file to token ids, and the
batching that truncated backpropagation through time needs."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from .. import checks
from ..autograd import Tensor
from ..backend_ndarray import NDArray, default_device
from ..backend_ndarray.dtypes import canonical, to_numpy_dtype
from ..errors import ArgumentError, DataFormatError, ShapeError

EOS = "<eos>"


class Dictionary:
    """A two-way map between words and ids; ids are given in order of first appearance."""

    def __init__(self):
        self.word2idx: dict[str, int] = {}
        self.idx2word: list[str] = []

    def add_word(self, word: str) -> int:
        if word not in self.word2idx:
            self.word2idx[word] = len(self.idx2word)
            self.idx2word.append(word)
        return self.word2idx[word]

    def __len__(self) -> int:
        return len(self.idx2word)


class TextCorpus:
    """The words of a text file as ids, one ``<eos>`` after each line.

    Pass the ``dictionary`` of a training corpus when reading its validation or test file,
    so the same word gets the same id; new words are added to it.
    """

    def __init__(self, path: str | Path, dictionary: Dictionary | None = None,
                 max_lines: int | None = None):
        path = Path(path)
        if max_lines is not None:
            max_lines = checks.integer(max_lines, "max_lines", "TextCorpus", 0)
        self.dictionary = dictionary if dictionary is not None else Dictionary()
        try:
            with open(path, encoding="utf-8") as f:
                lines = list(itertools.islice(f, max_lines))
        except FileNotFoundError:
            raise DataFormatError(f"text file {path} does not exist") from None
        except IsADirectoryError:
            raise DataFormatError(f"path {path} is a directory; pass a text file") from None
        except UnicodeDecodeError as e:
            raise DataFormatError(f"{path} is not UTF-8 text ({e})") from None
        add = self.dictionary.add_word
        self.ids = np.array([add(w) for line in lines for w in line.split() + [EOS]],
                            dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)


class Corpus:
    """The needle course's corpus (hw4): ``base_dir/train.txt`` and ``base_dir/test.txt`` read
    with one shared ``dictionary``; ``train`` and ``test`` are their id streams."""

    def __init__(self, base_dir: str | Path, max_lines: int | None = None):
        self.dictionary = Dictionary()
        self.train = self.tokenize(Path(base_dir) / "train.txt", max_lines)
        self.test = self.tokenize(Path(base_dir) / "test.txt", max_lines)

    def tokenize(self, path: str | Path, max_lines: int | None = None) -> np.ndarray:
        """The ids of ``path``'s words (new words join the dictionary)."""
        return TextCorpus(path, self.dictionary, max_lines).ids


def batchify(ids: np.ndarray, batch_size: int, device=None, dtype=None) -> np.ndarray:
    """Cut the id stream into ``batch_size`` equal columns: shape (n // batch_size, batch_size).

    Column j continues the text of column j in the previous row, so a model's hidden state
    can be carried from one ``get_batch`` to the next. Leftover ids are dropped. The result
    is a numpy array (of ``dtype`` when given); ``device`` is accepted for the course's
    signature and used by ``get_batch``, which makes the Tensors.
    """
    batch_size = checks.positive(batch_size, "batch_size", "batchify")
    rows = len(ids) // batch_size
    if rows == 0:
        raise ArgumentError(f"batchify: batch_size {batch_size} is larger than the {len(ids)} "
                            "ids to cut; use a smaller batch_size")
    out = np.asarray(ids[:rows * batch_size]).reshape(batch_size, rows).T.copy()
    return out if dtype is None else out.astype(to_numpy_dtype(canonical(dtype)))


def get_batch(batches: np.ndarray, i: int, bptt: int, device=None,
              dtype=None) -> tuple[Tensor, Tensor]:
    """Inputs rows ``i .. i+bptt`` (shape (seq, batch)) and the next ids as targets
    (shape (seq * batch,)), as Tensors on ``device`` (int64 unless ``dtype`` says otherwise:
    the course passes float32 ids)."""
    i = checks.integer(i, "i", "get_batch")
    bptt = checks.positive(bptt, "bptt", "get_batch")
    if not 0 <= i < len(batches) - 1:
        raise ShapeError(f"get_batch: row {i} leaves no target in {len(batches)} rows")
    seq = min(bptt, len(batches) - 1 - i)
    device = device or default_device()
    dtype = "int64" if dtype is None else canonical(dtype)
    data = NDArray(batches[i:i + seq], device=device, dtype=dtype)
    target = NDArray(batches[i + 1:i + 1 + seq].reshape(-1), device=device, dtype=dtype)
    return Tensor(data, requires_grad=False), Tensor(target, requires_grad=False)
