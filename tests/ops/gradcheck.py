"""Check a function's autograd gradients against central finite differences.

The function maps Tensors to one Tensor. It is reduced to a scalar with a fixed random
projection ``r`` (so every output element matters), and the gradient autograd gives for
``sum(f(x) · r)`` is compared with (L(x + h e_i) - L(x - h e_i)) / 2h, element by element.

In float64 the step is 1e-6 and the tolerance tight; devices without float64 (Metal) check
in float32 with a larger step and a looser tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

import needle as ndl
from needle import backend_ndarray as nd

from ..conftest import supports

# elements per input probed by finite differences (chosen at random); fewer where float64
# is missing, which is the emulated Metal device in CI, where every kernel launch is slow
MAX_CHECKED = {"float64": 30, "float32": 10}


def grad_dtype(device: nd.Device) -> str:
    return "float64" if supports(device, "float64") else "float32"


def _settings(dtype: str) -> tuple[float, float, float]:
    """(finite-difference step, rtol, atol) for ``dtype``."""
    return (1e-6, 1e-5, 1e-6) if dtype == "float64" else (1e-2, 5e-2, 5e-3)


def _tensors(arrays, device, dtype, wrt) -> list[ndl.Tensor]:
    return [ndl.Tensor(a, device=device, dtype=dtype if a.dtype.kind == "f" else None,
                       requires_grad=i in wrt) for i, a in enumerate(arrays)]


def check_gradients(fn: Callable[..., ndl.Tensor], arrays: Sequence[np.ndarray],
                    device: nd.Device, wrt: Sequence[int] | None = None,
                    seed: int = 0) -> None:
    """Assert autograd matches finite differences for ``fn`` at ``arrays``.

    ``arrays`` are numpy inputs (floats become the check dtype, ints stay ints); ``wrt``
    lists the inputs to differentiate (default: every floating input).
    """
    dtype = grad_dtype(device)
    step, rtol, atol = _settings(dtype)
    rng = np.random.default_rng(seed)
    arrays = [np.asarray(a, dtype=np.float64) if np.asarray(a).dtype.kind == "f"
              else np.asarray(a) for a in arrays]
    wrt = [i for i, a in enumerate(arrays) if a.dtype.kind == "f"] if wrt is None else list(wrt)

    tensors = _tensors(arrays, device, dtype, wrt)
    out = fn(*tensors)
    r = rng.standard_normal(out.shape)
    out.backward(ndl.Tensor(r, device=device, dtype=out.dtype, requires_grad=False))

    def loss_at(values) -> float:
        y = fn(*_tensors(values, device, dtype, wrt))  # with grad: fn may differentiate
        return float((y.numpy().astype(np.float64) * r).sum())

    for i in wrt:
        got = tensors[i].grad
        assert got is not None, f"input {i} got no gradient"
        assert got.shape == arrays[i].shape, f"input {i}: grad shape {got.shape}"
        assert got.dtype == dtype, f"input {i}: grad dtype {got.dtype}, expected {dtype}"
        got = got.numpy().astype(np.float64)
        flat = range(arrays[i].size)
        if arrays[i].size > MAX_CHECKED[dtype]:
            flat = rng.choice(arrays[i].size, MAX_CHECKED[dtype], replace=False)
        for j in flat:
            idx = np.unravel_index(j, arrays[i].shape)
            plus = [a.copy() for a in arrays]
            minus = [a.copy() for a in arrays]
            plus[i][idx] += step
            minus[i][idx] -= step
            expected = (loss_at(plus) - loss_at(minus)) / (2 * step)
            assert abs(got[idx] - expected) <= atol + rtol * abs(expected), (
                f"input {i} element {idx}: autograd {got[idx]!r}, finite difference "
                f"{expected!r} ({dtype})")


def check_second_order(fn: Callable[[ndl.Tensor], ndl.Tensor], x: np.ndarray,
                       device: nd.Device, seed: int = 1) -> None:
    """Check the gradient of the gradient: d/dx [∇(f(x)·r) · s] against finite differences
    of the first gradient (which ``check_gradients`` validates separately)."""
    rng = np.random.default_rng(seed)
    dtype = grad_dtype(device)
    probe = ndl.Tensor(np.asarray(x, np.float64), device=device, dtype=dtype)
    shape_out = fn(probe).shape
    r = ndl.Tensor(rng.standard_normal(shape_out), device=device, dtype=dtype,
                   requires_grad=False)
    s = ndl.Tensor(rng.standard_normal(np.shape(x)), device=device, dtype=dtype,
                   requires_grad=False)

    def first_grad_dot_s(xt: ndl.Tensor) -> ndl.Tensor:
        (g,) = ndl.grad(fn(xt), [xt], out_grad=r, create_graph=True)
        return (g * s).sum()

    check_gradients(first_grad_dot_s, [x], device, seed=seed)
