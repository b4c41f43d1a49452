"""The decode step's fused projections: ``nd.rmsnorm_matvec`` (pre-norm + projection, and with
``activation="swiglu"`` + SiLU·mul of gate and up rows) and ``nd.matvec_add`` (projection +
residual add, in place), on every device (the ``device`` fixture).

Each result is checked twice: against the composed ops on the same device
(``x.rmsnorm(w) @ W.T``, ``.swiglu()``, ``t + a @ W.T``), which round at the same points, and
against a float64 numpy computation that rounds to the dtype where the definition
(``numpy_ref/decode.py``) does. Sizes cover one row (a decode step) and several, a GEMM-sized
batch of rows (the native CPU backend's many-row path), dims that are and are not multiples of
8, and output widths below and above a thread's block.
"""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backends.api import has
from needle.errors import (
    ArgumentError,
    ArgumentTypeError,
    DeviceError,
    DTypeError,
    NeedleError,
    ShapeError,
)

from ..conftest import assert_close, assert_equal, check_unsupported_dtype, tolerance
from .compare import FLOATS, np_dtype, on, random

EPS = 1e-6
DIMS = (64, 203)   # a multiple of 8 (vector loads) and one that is not
OUTS = (24, 517)   # p: one thread's block, and several blocks with a ragged tail
ROWS = (1, 3)


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded to ``dtype`` and widened back."""
    return x.astype(np_dtype(dtype)).astype(np.float64)


def _normed(x: np.ndarray, w: np.ndarray, eps: float, dtype: str) -> np.ndarray:
    """rmsnorm(x) * w in float64, rounded to dtype (as rmsnorm stores it)."""
    v = x.astype(np.float64)
    h = v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w.astype(np.float64)
    return _rounded(h, dtype)


def _silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    return g / (1 + np.exp(-g)) * u


def _inputs(rng, lead: tuple[int, ...], dim: int, out_rows: int, dtype: str):
    """x, the norm's weight and a projection scaled so that products are O(1)."""
    x = random(rng, lead + (dim,), dtype, -2, 2)
    w = random(rng, (dim,), dtype, 0.5, 1.5)
    weight = (rng.uniform(-1, 1, (out_rows, dim)) * np.sqrt(3 / dim)).astype(np_dtype(dtype))
    return x, w, weight


def every_size(test):
    """Parametrize a test over FLOATS x ROWS x DIMS x OUTS (dtype, rows, dim, p)."""
    for name, values in (("p", OUTS), ("dim", DIMS), ("rows", ROWS), ("dtype", FLOATS)):
        test = pytest.mark.parametrize(name, values)(test)
    return test


# --- rmsnorm_matvec ------------------------------------------------------------------------

@every_size
@pytest.mark.parametrize("swiglu", [False, True])
def test_a_norm_folded_into_the_weight(device, dtype, rows, dim, p, swiglu, rng):
    """norm_weight=None: the norm's scale is in weight's columns (as a model folds it at
    load): r * (W' x) against float64 with the normed vector unrounded (the definition:
    numpy_ref's folded_rmsnorm_matvec, one kernel on CUDA for one row) and against the
    unfolded call with W, which rounds the normed vector and W's product with the scale at
    other points (so: within a few times the product's tolerance)."""
    if check_unsupported_dtype(device, dtype):
        return
    x, w, weight = _inputs(rng, (rows,), dim, 2 * p if swiglu else p, dtype)
    folded = _rounded(weight.astype(np.float64) * w.astype(np.float64), dtype)
    X, Wn, W = on(device, x), on(device, w), on(device, weight)
    F = on(device, folded.astype(np_dtype(dtype)))
    activation = "swiglu" if swiglu else None
    got = nd.rmsnorm_matvec(X, None, F, EPS, activation=activation)
    assert (got.shape, got.dtype, got.device) == ((rows, p), dtype, device)
    v = x.astype(np.float64)
    want = v / np.sqrt((v * v).mean(-1, keepdims=True) + EPS) @ folded.T
    if swiglu:
        want = _rounded(want, dtype)
        want = _silu_mul(want[:, :p], want[:, p:])
    # one pass where the backend has it; elsewhere rmsnorm (rounded) then the product, which
    # round the normed vector too: a few units in the last place more
    native = rows == 1 and has(device.backend, "folded_norm_matvec")
    rtol = tolerance(dtype, "matmul") * (1 if native else 4)
    assert_close(got, want, dtype, rtol=rtol)
    unfolded = nd.rmsnorm_matvec(X, Wn, W, EPS, activation=activation)
    assert_close(got, unfolded, dtype, rtol=4 * tolerance(dtype, "matmul"))


def test_a_folded_norm_needs_a_dense_weight(device, rng):
    x = on(device, random(rng, (1, 64), "float32", -2, 2))
    packed = nd.QuantizedMatrix.quantize(rng.standard_normal((8, 64)).astype(np.float32), 8,
                                         None, True, device=device)
    with pytest.raises(ArgumentError, match="dense weight"):
        nd.rmsnorm_matvec(x, None, packed)


@every_size
def test_rmsnorm_matvec(device, dtype, rows, dim, p, rng):
    if check_unsupported_dtype(device, dtype):
        return
    x, w, weight = _inputs(rng, (rows,), dim, p, dtype)
    X, Wn, W = on(device, x), on(device, w), on(device, weight)
    got = nd.rmsnorm_matvec(X, Wn, W, EPS)
    assert (got.shape, got.dtype, got.device) == ((rows, p), dtype, device)
    assert_close(got, X.rmsnorm(Wn, EPS) @ W.transpose(), dtype, "matmul")
    want = _normed(x, w, EPS, dtype) @ weight.astype(np.float64).T
    assert_close(got, want, dtype, "matmul")
    assert_equal(X, x)  # inputs untouched
    assert_equal(W, weight)


@every_size
def test_rmsnorm_matvec_swiglu(device, dtype, rows, dim, p, rng):
    if check_unsupported_dtype(device, dtype):
        return
    x, w, weight = _inputs(rng, (rows,), dim, 2 * p, dtype)
    X, Wn, W = on(device, x), on(device, w), on(device, weight)
    got = nd.rmsnorm_matvec(X, Wn, W, EPS, activation="swiglu")
    assert (got.shape, got.dtype, got.device) == ((rows, p), dtype, device)
    assert_close(got, (X.rmsnorm(Wn, EPS) @ W.transpose()).swiglu(), dtype, "matmul")
    gate_up = _rounded(_normed(x, w, EPS, dtype) @ weight.astype(np.float64).T, dtype)
    assert_close(got, _silu_mul(gate_up[:, :p], gate_up[:, p:]), dtype, "matmul")


@every_size
def test_matvec_add(device, dtype, rows, dim, p, rng):
    if check_unsupported_dtype(device, dtype):
        return
    a, _, weight = _inputs(rng, (rows,), dim, p, dtype)
    t0 = random(rng, (rows, p), dtype, -2, 2)
    A, W, T = on(device, a), on(device, weight), on(device, t0)
    composed = on(device, t0) + A @ W.transpose()
    got = nd.matvec_add(A, W, T)
    assert got is T  # in place: total is updated and returned
    assert (T.shape, T.dtype, T.device) == ((rows, p), dtype, device)
    assert_close(T, composed, dtype, "matmul")
    y = _rounded(a.astype(np.float64) @ weight.astype(np.float64).T, dtype)
    assert_close(T, t0.astype(np.float64) + y, dtype, "matmul")
    assert_equal(A, a)


# --- many rows, leading axes, views ---------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_many_rows_and_leading_axes(device, dtype, rng):
    """(4, 6, dim): 24 rows (a prefill, the CPU backend's GEMM path) with leading axes
    kept in the result's shape."""
    dim, p = 96, 40
    x, w, weight = _inputs(rng, (4, 6), dim, 2 * p, dtype)
    X, Wn, W = on(device, x), on(device, w), on(device, weight)
    h = _normed(x, w, EPS, dtype)
    plain = nd.rmsnorm_matvec(X, Wn, on(device, weight[:p]), EPS)
    assert plain.shape == (4, 6, p)
    assert_close(plain, h @ weight[:p].astype(np.float64).T, dtype, "matmul")
    act = nd.rmsnorm_matvec(X, Wn, W, EPS, activation="swiglu")
    gu = _rounded(h @ weight.astype(np.float64).T, dtype)
    assert act.shape == (4, 6, p)
    assert_close(act, _silu_mul(gu[..., :p], gu[..., p:]), dtype, "matmul")
    t0 = random(rng, (4, 6, p), dtype)
    T = on(device, t0)
    assert nd.matvec_add(X, on(device, weight[:p]), T) is T
    y = _rounded(x.astype(np.float64) @ weight[:p].astype(np.float64).T, dtype)
    assert_close(T, t0.astype(np.float64) + y, dtype, "matmul")


def test_one_dimensional_x_and_non_compact_inputs(device, rng):
    """x of shape (dim,) gives (p,); a transposed x, a transposed weight and a float64 norm
    weight (cast to x's dtype, as rmsnorm casts it) give the compact inputs' results."""
    dim, p = 40, 12
    x, w, weight = _inputs(rng, (3,), dim, p, "float32")
    one = nd.rmsnorm_matvec(on(device, x[0]), on(device, w), on(device, weight))
    assert one.shape == (p,)
    assert_close(one, _normed(x[:1], w, EPS, "float32")[0] @ weight.astype(np.float64).T,
                 "float32", "matmul")
    Xv = on(device, np.ascontiguousarray(x.T)).transpose()           # (3, dim), non-compact
    Wv = on(device, np.ascontiguousarray(weight.T)).transpose()      # (p, dim), non-compact
    assert not Xv.is_compact() and not Wv.is_compact()
    nw = nd.array(w.astype(np.float64), device=device, dtype="float32")
    got = nd.rmsnorm_matvec(Xv, nw, Wv)
    assert_close(got, nd.rmsnorm_matvec(on(device, x), on(device, w), on(device, weight)),
                 "float32", "matmul")
    t0 = random(rng, (3, p), "float32")
    T = on(device, t0)
    nd.matvec_add(Xv, Wv, T)
    assert_close(T, t0.astype(np.float64) + x.astype(np.float64) @ weight.astype(np.float64).T,
                 "float32", "matmul")


@pytest.mark.parametrize("rows", [2, 20])
def test_matvec_add_into_its_own_input(device, rows, rng):
    """total may be a itself (p == dim): the product reads a's old values, as ``t += t @ W.T``
    computed out of place would."""
    dim = 48
    t0 = random(rng, (rows, dim), "float32")
    weight = (rng.uniform(-1, 1, (dim, dim)) / dim).astype(np.float32)
    T = on(device, t0)
    assert nd.matvec_add(T, on(device, weight), T) is T
    want = t0.astype(np.float64) + t0.astype(np.float64) @ weight.astype(np.float64).T
    assert_close(T, want, "float32", "matmul")


def test_eps_reaches_the_norm(device, rng):
    """A large eps changes the result by the expected factor (it is passed, not dropped)."""
    x, w, weight = _inputs(rng, (2,), 32, 8, "float32")
    X, Wn, W = on(device, x), on(device, w), on(device, weight)
    for eps in (1e-6, 3.0):
        want = _normed(x, w, eps, "float32") @ weight.astype(np.float64).T
        assert_close(nd.rmsnorm_matvec(X, Wn, W, eps), want, "float32", "matmul")


# --- zero sizes ------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_zero_sizes(device, activation):
    f32 = "float32"
    factor = 2 if activation else 1

    def run(lead, dim, p):
        x = nd.array(np.ones(lead + (dim,), np.float32), device=device)
        w = nd.array(np.ones((dim,), np.float32), device=device)
        weight = nd.array(np.ones((factor * p, dim), np.float32), device=device)
        return nd.rmsnorm_matvec(x, w, weight, activation=activation)

    assert run((0,), 16, 5).shape == (0, 5)            # no rows
    assert run((3,), 16, 0).shape == (3, 0)            # no outputs
    empty_dim = run((3,), 0, 5)                        # nothing to sum: zeros
    assert empty_dim.shape == (3, 5) and empty_dim.dtype == f32
    assert_equal(empty_dim, np.zeros((3, 5), np.float32))

    t0 = np.arange(6, dtype=np.float32).reshape(2, 3)
    T = nd.array(t0, device=device)
    a = nd.array(np.ones((2, 0), np.float32), device=device)
    assert nd.matvec_add(a, nd.array(np.ones((3, 0), np.float32), device=device), T) is T
    assert_equal(T, t0)                                # adds nothing
    E = nd.array(np.ones((0, 3), np.float32), device=device)
    assert nd.matvec_add(nd.array(np.ones((0, 4), np.float32), device=device),
                         nd.array(np.ones((3, 4), np.float32), device=device), E).shape == (0, 3)


# --- bad inputs ---------------------------------------------------------------------------------

def _other_device(device):
    """Another enabled device than ``device`` (cpu_numpy is always enabled)."""
    return nd.cpu() if device == nd.cpu_numpy() and nd.cpu().enabled() else nd.cpu_numpy()


def test_bad_inputs_name_the_argument(device, rng):
    x = on(device, random(rng, (2, 8), "float32"))
    w = on(device, random(rng, (8,), "float32"))
    weight = on(device, random(rng, (6, 8), "float32"))
    t0 = random(rng, (2, 6), "float32")
    total = on(device, t0)
    cases = [
        (ShapeError, "weight", lambda: nd.rmsnorm_matvec(x, w, weight.transpose())),
        (ShapeError, "weight", lambda: nd.rmsnorm_matvec(x, w, w)),
        (ShapeError, "weight", lambda: nd.rmsnorm_matvec(x, w, weight[:5],
                                                         activation="swiglu")),
        (ShapeError, "norm_weight", lambda: nd.rmsnorm_matvec(x, w[:7], weight)),
        (DTypeError, "weight", lambda: nd.rmsnorm_matvec(x, w, weight.astype("float16"))),
        (DTypeError, "x", lambda: nd.rmsnorm_matvec(x.astype("int32"), w, weight)),
        (ArgumentError, "activation", lambda: nd.rmsnorm_matvec(x, w, weight,
                                                                activation="gelu")),
        (ArgumentTypeError, "weight", lambda: nd.rmsnorm_matvec(x, w, np.ones((6, 8)))),
        (ArgumentTypeError, "norm_weight", lambda: nd.rmsnorm_matvec(x, "ones", weight)),
        (ArgumentTypeError, "x", lambda: nd.rmsnorm_matvec([1.0] * 8, w, weight)),
        (ArgumentTypeError, "eps", lambda: nd.rmsnorm_matvec(x, w, weight, eps="small")),
        (ShapeError, "total", lambda: nd.matvec_add(x, weight, total.transpose())),
        (ShapeError, "total", lambda: nd.matvec_add(x, weight, total[:, :5])),
        (ShapeError, "total", lambda: nd.matvec_add(
            x, weight, on(device, random(rng, (2, 12), "float32"))[:, ::2])),  # non-compact
        (DTypeError, "total", lambda: nd.matvec_add(x, weight, total.astype("float16"))),
        (ShapeError, "weight", lambda: nd.matvec_add(x, weight[:, :7], total)),
        (ArgumentTypeError, "total", lambda: nd.matvec_add(x, weight, 0.0)),
    ]
    other = _other_device(device)
    if other != device:
        cases += [
            (DeviceError, "weight", lambda: nd.rmsnorm_matvec(x, w, weight.to(other))),
            (DeviceError, "norm_weight", lambda: nd.rmsnorm_matvec(x, w.to(other), weight)),
            (DeviceError, "total", lambda: nd.matvec_add(x, weight, total.to(other))),
        ]
    for error, name, call in cases:
        with pytest.raises(error, match=name) as info:
            call()
        assert isinstance(info.value, NeedleError)
    assert_equal(total, t0)  # nothing half-written by a refused call


def test_native_cpu_kernels_exist_and_check_their_buffers():
    """The native backend registers a kernel per float dtype and refuses inconsistent buffers
    itself (the array layer is not the only guard)."""
    cpu = nd.cpu()
    assert cpu.enabled(), cpu.reason  # the native extension is part of the install
    be = cpu.backend
    names = set(be.kernels())
    for op in ("rmsnorm_matvec", "rmsnorm_matvec_swiglu", "matvec_add"):
        for dt in ("f32", "f16", "bf16", "f64"):
            assert f"{op}_{dt}" in names
        assert f"{op}_i32" not in names
    f32 = lambda n: be.Array(n, "float32")  # noqa: E731
    with pytest.raises(ShapeError, match="weight"):
        be.rmsnorm_matvec(f32(8), f32(8), f32(7), f32(1), 1, 8, 1, 1e-6)
    with pytest.raises(ShapeError, match="weight"):
        be.rmsnorm_matvec_swiglu(f32(8), f32(8), f32(8), f32(1), 1, 8, 1, 1e-6)
    with pytest.raises(ShapeError, match="total"):
        be.matvec_add(f32(8), f32(8), f32(2), 1, 8, 1)
    with pytest.raises(ShapeError, match=">= 0"):
        be.matvec_add(f32(8), f32(8), f32(1), -1, 8, 1)
    with pytest.raises(DTypeError):
        be.matvec_add(f32(8), be.Array(8, "float16"), f32(1), 1, 8, 1)
    with pytest.raises(DTypeError, match="int32"):
        i32 = lambda n: be.Array(n, "int32")  # noqa: E731
        be.rmsnorm_matvec(i32(8), i32(8), i32(8), i32(1), 1, 8, 1, 1e-6)
    for rows in (2, 20):  # dim 0 on both paths: nothing to sum, zeros (as numpy_ref)
        out = nd.full((rows, 3), 7.0, device=cpu)
        be.rmsnorm_matvec(f32(0), f32(0), f32(0), out._handle, rows, 0, 3, 1e-6)
        assert_equal(out, np.zeros((rows, 3), np.float32))
