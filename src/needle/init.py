"""Tensor initializers: random, constant and the fan-scaled schemes layers start from.

Random numbers are drawn on the host by a numpy ``Generator`` and copied to the device once,
so a seed gives the same values on every device. Each function takes ``generator=`` (a
``np.random.Generator``) or ``seed=``; with neither it draws from the module's generator,
which ``manual_seed`` resets, so one call makes a whole program (initial weights, dropout
masks, data shuffling, augmentation) repeatable.
"""

from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from . import checks
from .autograd import Tensor
from .backend_ndarray import NDArray, default_device
from .backend_ndarray.dtypes import canonical
from .errors import NeedleError, ShapeError

__all__ = [
    "constant", "default_generator", "kaiming_normal", "kaiming_uniform", "manual_seed",
    "one_hot", "ones", "ones_like", "rand", "randb", "randn", "xavier_normal",
    "xavier_uniform", "zeros", "zeros_like",
]

_generator = np.random.default_rng()


def manual_seed(seed: int) -> None:
    """Reset the module's generator: every later draw without ``generator``/``seed`` repeats."""
    global _generator
    _generator = np.random.default_rng(checks.integer(seed, "seed", "manual_seed", 0))


def default_generator() -> np.random.Generator:
    """The generator used when none is passed (modules such as Dropout draw from it too)."""
    return _generator


def _rng(generator: np.random.Generator | None, seed: int | None) -> np.random.Generator:
    if generator is not None and seed is not None:
        raise NeedleError("pass either generator= or seed=, not both")
    if seed is not None:
        return np.random.default_rng(seed)
    return generator if generator is not None else _generator


def _shape(shape) -> tuple[int, ...]:
    """Accept ``f(2, 3)`` as well as ``f((2, 3))``."""
    if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
        shape = tuple(shape[0])
    if not all(isinstance(d, numbers.Integral) and d >= 0 for d in shape):
        raise ShapeError(f"a shape is a sequence of non-negative ints, got {shape!r}")
    return tuple(int(d) for d in shape)


def _tensor(host: np.ndarray, device, dtype, requires_grad: bool) -> Tensor:
    array = NDArray(host, device=device or default_device(), dtype=canonical(dtype))
    return Tensor(array, requires_grad=requires_grad)


def _host_float(dtype) -> type:
    """Draw float64 only for float64 tensors; everything else is drawn in float32."""
    return np.float64 if canonical(dtype) == "float64" else np.float32


def rand(*shape, low: float = 0.0, high: float = 1.0, device=None, dtype="float32",
         requires_grad: bool = False, generator=None, seed=None) -> Tensor:
    """Uniform samples in [low, high)."""
    x = _rng(generator, seed).random(_shape(shape), dtype=_host_float(dtype))
    return _tensor(low + (high - low) * x, device, dtype, requires_grad)


def randn(*shape, mean: float = 0.0, std: float = 1.0, device=None, dtype="float32",
          requires_grad: bool = False, generator=None, seed=None) -> Tensor:
    """Normal samples with the given mean and standard deviation."""
    x = _rng(generator, seed).standard_normal(_shape(shape), dtype=_host_float(dtype))
    return _tensor(mean + std * x, device, dtype, requires_grad)


def randb(*shape, p: float = 0.5, device=None, dtype="bool", requires_grad: bool = False,
          generator=None, seed=None) -> Tensor:
    """Bernoulli samples: true (1) with probability ``p``."""
    x = _rng(generator, seed).random(_shape(shape), dtype=np.float32) < p
    return _tensor(x, device, dtype, requires_grad)


def constant(*shape, c: float = 1.0, device=None, dtype="float32",
             requires_grad: bool = False) -> Tensor:
    device = device or default_device()
    array = device.full(_shape(shape), c, canonical(dtype))
    return Tensor(array, requires_grad=requires_grad)


def ones(*shape, device=None, dtype="float32", requires_grad: bool = False) -> Tensor:
    return constant(*shape, c=1.0, device=device, dtype=dtype, requires_grad=requires_grad)


def zeros(*shape, device=None, dtype="float32", requires_grad: bool = False) -> Tensor:
    return constant(*shape, c=0.0, device=device, dtype=dtype, requires_grad=requires_grad)


def zeros_like(t: Tensor, *, device=None, requires_grad: bool = False) -> Tensor:
    return zeros(*t.shape, dtype=t.dtype, device=device or t.device, requires_grad=requires_grad)


def ones_like(t: Tensor, *, device=None, requires_grad: bool = False) -> Tensor:
    return ones(*t.shape, dtype=t.dtype, device=device or t.device, requires_grad=requires_grad)


def one_hot(n: int, i, device=None, dtype="float32", requires_grad: bool = False) -> Tensor:
    """Rows of the n x n identity picked by the integer labels ``i`` (any shape).

    Labels already on a device are compared on that device, so no host round trip (and no
    wait for the device) is needed.
    """
    if isinstance(i, Tensor):
        i = i.realize_cached_data()
    if isinstance(i, NDArray):
        device = device or i.device
        hot = i.to(device).reshape(i.shape + (1,)) == _class_ids(n, device, i.dtype)
        return Tensor(hot.astype(canonical(dtype)), requires_grad=requires_grad)
    labels = np.asarray(i)
    if labels.size and (labels.min() < 0 or labels.max() >= n):
        raise ShapeError(f"one_hot: labels must lie in [0, {n}), got values "
                         f"{labels.min()}..{labels.max()}")
    return _tensor(np.eye(n, dtype=np.float32)[labels], device, dtype, requires_grad)


@functools.lru_cache(maxsize=32)
def _class_ids(n: int, device, dtype: str) -> NDArray:
    """0..n-1 on ``device``, made once per (n, device, dtype): a training loop's loss calls
    one_hot every step, and each new copy from the host cost an upload (and on CUDA a wait
    for the stream). Never written to: one_hot only compares against it."""
    return NDArray(np.arange(n, dtype=np.int64), device=device, dtype=dtype)


def _fan_shape(fan_in: int, fan_out: int, shape) -> tuple[int, ...]:
    return (fan_in, fan_out) if shape is None else tuple(shape)


def xavier_uniform(fan_in: int, fan_out: int, gain: float = 1.0, shape=None, **kwargs) -> Tensor:
    """U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)) (Glorot and Bengio, 2010)."""
    a = gain * math.sqrt(6 / (fan_in + fan_out))
    return rand(_fan_shape(fan_in, fan_out, shape), low=-a, high=a, **kwargs)


def xavier_normal(fan_in: int, fan_out: int, gain: float = 1.0, shape=None, **kwargs) -> Tensor:
    """N(0, std²) with std = gain * sqrt(2 / (fan_in + fan_out))."""
    std = gain * math.sqrt(2 / (fan_in + fan_out))
    return randn(_fan_shape(fan_in, fan_out, shape), std=std, **kwargs)


def _gain(nonlinearity: str) -> float:
    gains = {"relu": math.sqrt(2), "linear": 1.0, "tanh": 5 / 3, "sigmoid": 1.0}
    if nonlinearity not in gains:
        raise NeedleError(f"unknown nonlinearity {nonlinearity!r}; use one of {', '.join(gains)}")
    return gains[nonlinearity]


def kaiming_uniform(fan_in: int, fan_out: int, nonlinearity: str = "relu", shape=None,
                    **kwargs) -> Tensor:
    """U(-b, b) with b = gain * sqrt(3 / fan_in) (He et al., 2015)."""
    bound = _gain(nonlinearity) * math.sqrt(3 / fan_in)
    return rand(_fan_shape(fan_in, fan_out, shape), low=-bound, high=bound, **kwargs)


def kaiming_normal(fan_in: int, fan_out: int, nonlinearity: str = "relu", shape=None,
                   **kwargs) -> Tensor:
    """N(0, std²) with std = gain / sqrt(fan_in)."""
    std = _gain(nonlinearity) / math.sqrt(fan_in)
    return randn(_fan_shape(fan_in, fan_out, shape), std=std, **kwargs)
