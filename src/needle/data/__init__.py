"""Datasets, transforms and the DataLoader (``from needle import data``)."""

from .dataset import ArrayDataset, DataLoader, Dataset, NDArrayDataset
from .datasets import CIFAR10Dataset, DigitsDataset, MNISTDataset, load_array_pickle, read_idx
from .text import Corpus, Dictionary, TextCorpus, batchify, get_batch
from .transforms import Normalize, RandomCrop, RandomFlipHorizontal, Transform

__all__ = [
    "ArrayDataset", "CIFAR10Dataset", "Corpus", "DataLoader", "Dataset", "Dictionary",
    "DigitsDataset", "MNISTDataset", "NDArrayDataset", "Normalize", "RandomCrop",
    "RandomFlipHorizontal", "TextCorpus", "Transform", "batchify", "get_batch",
    "load_array_pickle", "read_idx",
]
