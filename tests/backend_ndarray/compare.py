"""Run an op on a device and on the reference with the same inputs, and compare.

Conformance tests build inputs in numpy, already rounded to the dtype under test, so that the
device, the reference (``cpu_numpy``) and plain numpy in float64 all see identical values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

import needle.backend_ndarray as nd
from needle.backend_ndarray import dtypes

from ..conftest import assert_close

FLOATS = ("float32", "float16", "bfloat16", "float64")
INTS = ("uint8", "int8", "int32", "int64")
LAYOUTS = ("compact", "transposed", "broadcast", "sliced", "negative_step")


def np_dtype(dtype: str) -> np.dtype:
    return dtypes.to_numpy_dtype(dtype)


def random(rng: np.random.Generator, shape, dtype: str, low: float = -2.0,
           high: float = 2.0) -> np.ndarray:
    """Random data of ``dtype`` (ints in [low, high), bools half true)."""
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype in INTS:
        return rng.integers(int(low), int(high), size=shape).astype(np_dtype(dtype))
    return rng.uniform(low, high, size=shape).astype(np_dtype(dtype))


def grid(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    """Values in {-2, -1.75, ..., 2} (ints: -4..4): exact in every dtype, with many ties, so
    that comparisons, maximum and equality see equal elements."""
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype in INTS:
        return rng.integers(-4, 5, size=shape).astype(np_dtype(dtype))
    return (rng.integers(-8, 9, size=shape) / 4).astype(np_dtype(dtype))


def broadcast(shape: tuple[int, ...]) -> Callable:
    """A view broadcasting numpy arrays and NDArrays alike to ``shape``."""
    return lambda x: (np.broadcast_to(x, shape) if isinstance(x, np.ndarray)
                      else x.broadcast_to(shape))


def layout(shape: tuple[int, ...], kind: str) -> tuple[tuple[int, ...], Callable]:
    """(base shape, view) such that ``view(base)`` has ``shape`` and the layout ``kind``.

    ``view`` works on numpy arrays and NDArrays alike, so a base made on several devices
    gives the same logical view everywhere.
    """
    n = len(shape)
    if kind == "compact":
        return shape, lambda x: x
    if kind == "transposed":
        axes = tuple(reversed(range(n)))
        return tuple(shape[a] for a in axes), lambda x: x.transpose(axes)
    if kind == "broadcast":
        return (1,) + tuple(shape[1:]), broadcast(shape)
    if kind == "sliced":
        return (tuple(2 * d + 1 for d in shape),
                lambda x: x[tuple(slice(1, 2 * d + 1, 2) for d in shape)])
    if kind == "negative_step":
        return shape, lambda x: x[(slice(None, None, -1),) * n]
    raise ValueError(kind)


def on(device: nd.Device, x: np.ndarray) -> nd.NDArray:
    """``x`` on ``device`` with needle's dtype for x's numpy dtype (float64 stays float64)."""
    return nd.array(x, device=device, dtype=dtypes.canonical(x.dtype))


def compare(device: nd.Device, op: Callable, inputs: Sequence[np.ndarray], *,
            views: Sequence[Callable] | None = None, expected: Callable | None = None,
            kind: str = "elementwise", scale: float | None = None, rtol: float | None = None,
            dtype: str | None = None) -> nd.NDArray:
    """Check ``op(*inputs)`` on ``device`` against the reference, and against ``expected``.

    ``views`` (one per input) turn each input, once on the device, into the view to test.
    ``expected`` gets the same views of the inputs as float64 (ints and bools unchanged) and
    returns what the result should be in exact arithmetic. Result dtypes must match the
    reference exactly; values within the tolerance of ``dtype`` (default: the result's).
    Returns the device's result.
    """
    views = views or [lambda x: x] * len(inputs)
    got = op(*[v(on(device, x)) for v, x in zip(views, inputs)])
    ref = op(*[v(on(nd.cpu_numpy(), x)) for v, x in zip(views, inputs)])
    assert got.device == device
    assert got.dtype == ref.dtype, f"dtype {got.dtype} != reference {ref.dtype}"
    assert got.shape == ref.shape, f"shape {got.shape} != reference {ref.shape}"
    dt = dtype or ref.dtype
    assert_close(got, ref, dt, kind, scale, rtol)
    if expected is not None:
        wide = [v(x.astype(np.float64) if x.dtype.kind == "f" or x.dtype == np_dtype("bfloat16")
                  else x) for v, x in zip(views, inputs)]
        with np.errstate(all="ignore"):  # rounded to the result's dtype: exp(100) is inf in f32
            want = np.asarray(expected(*wide)).astype(np_dtype(ref.dtype))
        assert_close(ref, want, dt, kind, scale, rtol)
        assert_close(got, want, dt, kind, scale, rtol)
    return got
