"""Image transforms applied by datasets to batches of images.

Transforms take and return a batch of images shaped (N, C, H, W) as numpy arrays (the layout
``nn.Conv`` takes), so a DataLoader batch is transformed in a few array operations rather
than one Python call per image. Given one image shaped (H, W, C) (the needle course's
convention), a transform returns one image of that shape. Random transforms draw from their
own generator (``seed=``) or from ``needle.init``'s, which ``needle.init.manual_seed`` resets.
"""

from __future__ import annotations

import numpy as np

from .. import checks, init
from ..errors import ArgumentError, ArgumentTypeError, ShapeError


def _check_images(x: np.ndarray, name: str) -> None:
    if x.ndim != 4:
        raise ShapeError(f"{name} takes a batch of images shaped (N, C, H, W) or one image "
                         f"shaped (H, W, C), got {x.shape}")


class Transform:
    """A function of a batch of images; random ones keep a generator. Subclasses define
    ``batch`` on (N, C, H, W); calling a transform also takes one (H, W, C) image."""

    def __init__(self, seed: int | None = None):
        self._generator = np.random.default_rng(seed) if seed is not None else None

    @property
    def rng(self) -> np.random.Generator:
        return self._generator or init.default_generator()

    def __call__(self, images: np.ndarray) -> np.ndarray:
        images = np.asarray(images)
        if images.ndim == 3:  # one (H, W, C) image: a batch of one in (N, C, H, W)
            return self.batch(images.transpose(2, 0, 1)[None])[0].transpose(1, 2, 0)
        _check_images(images, type(self).__name__)
        return self.batch(images)

    def batch(self, images: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class RandomFlipHorizontal(Transform):
    """Mirror each image left-right with probability ``p``."""

    def __init__(self, p: float = 0.5, seed: int | None = None):
        super().__init__(seed)
        self.p = checks.probability(p, "p", "RandomFlipHorizontal")

    def batch(self, images: np.ndarray) -> np.ndarray:
        flip = self.rng.random(len(images)) < self.p
        out = images.copy()
        out[flip] = images[flip][..., ::-1]
        return out


class RandomCrop(Transform):
    """Shift each image by up to ``padding`` pixels each way, filling with zeros.

    This is a random crop of the zero-padded image back to its original size.
    """

    def __init__(self, padding: int = 3, seed: int | None = None):
        super().__init__(seed)
        checks.integer(padding, "padding", "RandomCrop", 0)
        self.padding = padding

    def batch(self, images: np.ndarray) -> np.ndarray:
        n, _, h, w = images.shape
        p = self.padding
        padded = np.pad(images, ((0, 0), (0, 0), (p, p), (p, p)))
        shifts = self.rng.integers(-p, p + 1, size=(n, 2))
        out = np.empty_like(images)
        for k, (dy, dx) in enumerate(shifts):
            out[k] = padded[k, :, p + dy:p + dy + h, p + dx:p + dx + w]
        return out


class Normalize(Transform):
    """(x - mean) / std per channel; ``mean`` and ``std`` are scalars or one value per channel."""

    def __init__(self, mean, std):
        super().__init__()
        self.mean = _floats(mean, "mean").reshape(-1, 1, 1)
        self.std = _floats(std, "std").reshape(-1, 1, 1)
        if not (self.std > 0).all():
            raise ArgumentError(f"Normalize: std must be positive, got {std}")

    def batch(self, images: np.ndarray) -> np.ndarray:
        channels = images.shape[1]
        if len(self.mean) not in (1, channels) or len(self.std) not in (1, channels):
            raise ShapeError(f"Normalize has {len(self.mean)} means and {len(self.std)} stds "
                             f"for images of {channels} channels")
        return ((images - self.mean) / self.std).astype(images.dtype, copy=False)


def _floats(value, name: str) -> np.ndarray:
    """A scalar or per-channel list of finite numbers as float32."""
    try:
        out = np.asarray(value, np.float32)
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"Normalize: {name} must be a number or one number per channel, "
                                f"got {value!r}") from None
    if not np.isfinite(out).all():
        raise ArgumentError(f"Normalize: {name} must be finite, got {value!r}")
    return out
