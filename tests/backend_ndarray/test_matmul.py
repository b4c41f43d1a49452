"""matmul: 2-d, batched, broadcast batches, transposed and strided operands, vectors, m = 1
(decode), odd and empty sizes, every numeric dtype."""

from __future__ import annotations

import math

import numpy as np
import pytest

import needle.backend_ndarray as nd

from ..conftest import check_unsupported_dtype
from .compare import INTS, broadcast, compare, random

NUMERIC = ("float32", "float16", "bfloat16", "float64", "int32", "int64")


def _data(rng, shape, dtype):
    return random(rng, shape, dtype, -3, 4) if dtype in INTS else random(rng, shape, dtype, -1, 1)


def _check(device, x, y, views=None, dtype=None):
    n = x.shape[-1] if views is None else views[0](x).shape[-1]
    return compare(device, lambda a, b: a @ b, [x, y], views=views, expected=np.matmul,
                   kind="matmul", scale=math.sqrt(max(n, 1)), dtype=dtype)


@pytest.mark.parametrize("dtype", NUMERIC)
@pytest.mark.parametrize("mnp", [(1, 1, 1), (7, 33, 5), (33, 7, 64), (64, 64, 64),
                                 (65, 129, 33), (1, 256, 1000), (1000, 3, 1), (2, 1, 2)],
                         ids=str)
def test_matmul_2d(device, dtype, mnp, rng):
    if check_unsupported_dtype(device, dtype):
        return
    m, n, p = mnp
    got = _check(device, _data(rng, (m, n), dtype), _data(rng, (n, p), dtype))
    assert got.dtype == dtype and got.shape == (m, p)


@pytest.mark.parametrize("shapes", [
    ((0, 3), (3, 4)), ((3, 0), (0, 4)), ((3, 4), (4, 0)), ((2, 0, 3), (2, 3, 5)),
    ((0, 2, 3), (3, 5)),
], ids=str)
def test_matmul_empty(device, shapes, rng):
    """Empty operands give empty results, or zeros when the inner dimension is 0."""
    _check(device, _data(rng, shapes[0], "float32"), _data(rng, shapes[1], "float32"))


@pytest.mark.parametrize("dtype", NUMERIC)
@pytest.mark.parametrize("shapes", [
    ((4, 7, 9), (4, 9, 5)),  # batched
    ((2, 1, 7, 9), (3, 9, 5)),  # broadcast batch on both sides
    ((5, 7, 9), (9, 5)),  # a stack of matrices times one matrix
    ((7, 9), (5, 9, 3)),  # one matrix times a stack
    ((1, 7, 9), (4, 9, 3)),
    ((3, 1, 33), (3, 33, 17)),  # m = 1 in a batch (decode with a batch of sequences)
], ids=str)
def test_matmul_batched(device, dtype, shapes, rng):
    if check_unsupported_dtype(device, dtype):
        return
    x, y = _data(rng, shapes[0], dtype), _data(rng, shapes[1], dtype)
    got = _check(device, x, y)
    assert got.shape == np.matmul(x.astype(np.float32), y.astype(np.float32)).shape


def _t(a):
    """Swap the last two axes (a view on both numpy and NDArray)."""
    axes = tuple(range(a.ndim - 2)) + (a.ndim - 1, a.ndim - 2)
    return a.transpose(axes)


def _operand(kind: str, shape: tuple[int, ...]):
    """(base shape, view) giving an operand of ``shape`` laid out as ``kind``."""
    if kind == "compact":
        return shape, lambda a: a
    if kind == "transposed":
        return shape[:-2] + (shape[-1], shape[-2]), _t
    if kind == "column_slice":
        return shape[:-1] + (2 * shape[-1],), lambda a: a[..., ::2]
    if kind == "row_slice":
        return shape[:-2] + (shape[-2] + 3, shape[-1]), lambda a: a[..., 1:-2, :]
    if kind == "reversed":
        return shape, lambda a: a[..., ::-1, :]
    if kind == "broadcast_rows":
        return shape[:-2] + (1, shape[-1]), broadcast(shape)
    if kind == "broadcast_batch":
        return (1,) * (len(shape) - 2) + shape[-2:], broadcast(shape)
    if kind == "batch_inner":  # stored (rows, batch, cols), viewed (batch, rows, cols)
        return (shape[-2], shape[0], shape[-1]), lambda a: a.transpose((1, 0, 2))
    raise ValueError(kind)


KINDS = ["compact", "transposed", "column_slice", "row_slice", "reversed", "broadcast_rows"]


@pytest.mark.parametrize("left", KINDS + ["broadcast_batch", "batch_inner"])
@pytest.mark.parametrize("right", KINDS + ["broadcast_batch", "batch_inner"])
@pytest.mark.parametrize("batch", [(), (3,)], ids=str)
def test_matmul_non_compact_operands(device, left, right, batch, rng):
    if not batch and (left not in KINDS or right not in KINDS):
        return  # batch layouts need a batch
    (xs, xv), (ys, yv) = _operand(left, batch + (6, 9)), _operand(right, batch + (9, 5))
    _check(device, _data(rng, xs, "float32"), _data(rng, ys, "float32"), views=[xv, yv])


@pytest.mark.parametrize("shapes", [
    ((9,), (9, 5)), ((7, 9), (9,)), ((9,), (9,)), ((4, 7, 9), (9,)), ((9,), (4, 9, 5)),
    ((1,), (1, 3)), ((1000,), (1000, 33)),
], ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
def test_matmul_vectors(device, shapes, dtype, rng):
    x, y = _data(rng, shapes[0], dtype), _data(rng, shapes[1], dtype)
    got = _check(device, x, y)
    assert got.shape == np.matmul(x.astype(np.float32), y.astype(np.float32)).shape


def test_matmul_matrix_vector_decode_path(device, rng):
    """m = 1 against a transposed weight, as a linear layer computes x @ W.T when decoding."""
    w = _data(rng, (1000, 256), "float32")
    x = _data(rng, (1, 256), "float32")
    _check(device, x, w, views=[lambda a: a, _t])
    xh, wh = x.astype(np.float16), w.astype(np.float16)
    _check(device, xh, wh, views=[lambda a: a, _t])


@pytest.mark.parametrize("dtypes", [("int32", "float32"), ("float16", "bfloat16"),
                                    ("int64", "float16"), ("float32", "float64")], ids=str)
def test_matmul_mixed_dtypes_promote(device, dtypes, rng):
    if any(check_unsupported_dtype(device, d) for d in dtypes):
        return
    x, y = _data(rng, (5, 6), dtypes[0]), _data(rng, (6, 4), dtypes[1])
    got = _check(device, x, y)
    assert got.dtype == nd.promote(*dtypes)


def test_matmul_special_values(device):
    x = np.array([[np.inf, 1.0], [np.nan, 0.0], [1.0, 2.0]], np.float32)
    y = np.array([[1.0, 0.0], [2.0, -1.0]], np.float32)
    _check(device, x, y)


def test_matmul_large_k_precision(device, rng):
    """A long inner dimension of positive values: the fp32 sum must stay within 1e-4."""
    x, y = random(rng, (3, 20000), "float32", 0, 1), random(rng, (20000, 2), "float32", 0, 1)
    compare(device, lambda a, b: a @ b, [x, y], expected=np.matmul, kind="matmul")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int32", "int64"])
@pytest.mark.parametrize("mkn", [(2, 64, 72), (9, 520, 200), (33, 200, 130), (64, 2048, 320),
                                 (3, 37, 9), (16, 300, 130),
                                 (128, 1032, 96), (100, 40, 17000)], ids=str)
def test_matmul_few_rows_times_transposed_weight(device, dtype, mkn, rng):
    """x (m, k) @ W.T, W stored (n, k), for 2..128 rows: a batched decode step's projections
    (CUDA: skinny.cu; ragged n, k not a multiple of its chunks, one k slice or several
    merged; CPU: dot products up to 16 rows, two rows and four columns a pass, odd m and n)."""
    if check_unsupported_dtype(device, dtype):
        return
    m, k, n = mkn
    x, w = _data(rng, (m, k), dtype), _data(rng, (n, k), dtype)
    got = _check(device, x, w, views=[lambda a: a, _t])
    assert got.shape == (m, n)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_matmul_few_rows_take_the_skinny_kernel_on_cuda(dtype, rng):
    """The route is part of the contract of speed: a batched decode step's projections must
    reach skinny.cu, with k split (merged by gemv_combine) and not; and a batch of them."""
    dev = nd.cuda()
    if not dev.enabled():
        pytest.skip(f"cuda disabled: {dev.reason}")
    for m, k, n, batch in ((64, 2048, 2048, 1), (16, 64, 70000, 1), (24, 512, 300, 3)):
        x = _data(rng, (batch, m, k), dtype)
        w = _data(rng, (batch, n, k), dtype)
        with dev.backend.profile() as prof:
            got = nd.array(x, device=dev) @ nd.array(w, device=dev).permute((0, 2, 1))
        rows = next(r for r in (8, 16, 32, 64, 128) if r >= m)
        names = set(prof.totals)
        assert any(name.startswith(f"matmul_skinny_tc{rows}_") for name in names), names
        want = np.matmul(x.astype(np.float64), w.astype(np.float64).transpose(0, 2, 1))
        np.testing.assert_allclose(got.numpy().astype(np.float64), want, rtol=2e-2,
                                   atol=2e-2 * math.sqrt(k))
