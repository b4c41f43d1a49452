"""uint8 and int8 on every device (docs/dtypes.md): inputs keep their dtype, promotion,
arithmetic wrapping modulo 2^8, sums counting in int64, the float -> int rule, scalars that
must fit, and the course's use (uint8 images normalized to float)."""

from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
import needle.backend_ndarray as nd
from needle.errors import DTypeError

from ..conftest import assert_equal

SMALL = ("uint8", "int8")


@pytest.mark.parametrize("dtype", SMALL)
def test_numpy_8bit_data_keeps_its_dtype(device, dtype):
    x = np.arange(-3, 5).astype(dtype)
    a = nd.array(x, device=device)
    assert a.dtype == dtype and a.numpy().dtype == np.dtype(dtype)
    assert_equal(a.numpy(), x)
    assert ndl.Tensor(x, device=device).dtype == dtype


def test_promotion_between_8bit_and_other_dtypes(device):
    u = nd.array(np.array([200, 1], np.uint8), device=device)
    i = nd.array(np.array([-100, 1], np.int8), device=device)
    b = nd.array(np.array([True, False]), device=device)
    both = u + i  # uint8 with int8 holds both ranges in int32 (needle has no int16)
    assert both.dtype == "int32"
    assert_equal(both.numpy(), np.array([100, 2], np.int32))
    assert (u + b).dtype == "uint8" and (i + b).dtype == "int8"
    assert (u + nd.array(np.array([1, 2], np.int32), device=device)).dtype == "int32"
    assert (i * nd.array(np.array([1, 2], np.int64), device=device)).dtype == "int64"
    assert (u * nd.array(np.array([1, 2], np.float32), device=device)).dtype == "float32"
    assert (u + 1).dtype == "uint8" and (u * 0.5).dtype == "float32"
    assert (u / 2).dtype == "float32"
    assert_equal((u / 2).numpy(), np.array([100.0, 0.5], np.float32))
    assert (u < 3).dtype == "bool" and u.exp().dtype == "float32"


def test_arithmetic_wraps_modulo_256(device):
    u = nd.array(np.array([250, 255, 0, 16], np.uint8), device=device)
    assert_equal((u + 10).numpy(), np.array([4, 9, 10, 26], np.uint8))
    assert_equal((u - 1).numpy(), np.array([249, 254, 255, 15], np.uint8))
    assert_equal((u * u).numpy(), np.array([36, 1, 0, 0], np.uint8))
    assert_equal((-u).numpy(), np.array([6, 1, 0, 240], np.uint8))
    assert_equal((u ** 2).numpy(), np.array([36, 1, 0, 0], np.uint8))
    i = nd.array(np.array([127, -128, -1, 100], np.int8), device=device)
    assert_equal((i + 1).numpy(), np.array([-128, -127, 0, 101], np.int8))
    assert_equal((i * 2).numpy(), np.array([-2, 0, -2, -56], np.int8))
    assert_equal((-i).numpy(), np.array([-127, -128, 1, -100], np.int8))
    assert_equal(i.abs().numpy(), np.array([127, -128, 1, 100], np.int8))  # as numpy
    u += 10  # in place keeps the dtype and wraps the same way
    assert u.dtype == "uint8"
    assert_equal(u.numpy(), np.array([4, 9, 10, 26], np.uint8))


@pytest.mark.parametrize("dtype", SMALL)
def test_sums_count_in_int64_without_wrapping(device, dtype):
    x = np.full((3, 300), 100 if dtype == "uint8" else -100, dtype)
    a = nd.array(x, device=device)
    total = a.sum()
    assert total.dtype == "int64"
    assert int(total.numpy()) == int(x.astype(np.int64).sum())
    rows = a.sum(axis=1)
    assert rows.dtype == "int64"
    assert_equal(rows.numpy(), x.astype(np.int64).sum(axis=1))
    assert a.max().dtype == dtype and a.mean().dtype == "float32"
    assert float(a.mean().numpy()) == float(x[0, 0])


@pytest.mark.parametrize("dtype", SMALL)
def test_matmul_wraps_like_numpy(device, dtype):
    rng = np.random.default_rng(0)
    x = rng.integers(-128 if dtype == "int8" else 0, 128, (5, 7)).astype(dtype)
    y = rng.integers(-128 if dtype == "int8" else 0, 128, (7, 3)).astype(dtype)
    got = nd.array(x, device=device) @ nd.array(y, device=device)
    assert got.dtype == dtype
    assert_equal(got.numpy(), x @ y)  # numpy's 8-bit matmul wraps as well


def test_float_to_8bit_truncates_saturates_and_maps_nan_to_zero(device):
    x = nd.array(np.array([2.7, -2.7, 300.0, -300.0, np.inf, -np.inf, np.nan, 255.9, -0.9],
                          np.float32), device=device)
    assert_equal(x.astype("uint8").numpy(), np.array([2, 0, 255, 0, 255, 0, 0, 255, 0],
                                                     np.uint8))
    assert_equal(x.astype("int8").numpy(), np.array([2, -2, 127, -128, 127, -128, 0, 127, 0],
                                                    np.int8))


def test_wider_integers_to_8bit_wrap_as_numpy(device):
    x = np.array([300, -1, 256, -129, 127], np.int32)
    a = nd.array(x, device=device)
    assert_equal(a.astype("uint8").numpy(), x.astype(np.uint8))
    assert_equal(a.astype("int8").numpy(), x.astype(np.int8))
    assert_equal(a.astype("bool").astype("uint8").numpy(), (x != 0).astype(np.uint8))


@pytest.mark.parametrize("dtype,bad", [("uint8", -1), ("uint8", 256), ("int8", 128),
                                       ("int8", -129)])
def test_python_ints_must_fit_8bit_arrays(device, dtype, bad):
    a = nd.array(np.array([1, 2], dtype), device=device)
    with pytest.raises(DTypeError, match=f"does not fit {dtype}"):
        a + bad
    with pytest.raises(DTypeError, match=f"does not fit {dtype}"):
        a += bad
    with pytest.raises(DTypeError, match=f"does not fit {dtype}"):
        nd.full((2,), bad, dtype, device)
    assert (a + 0.5).dtype == "float32"  # a float scalar promotes instead


def test_views_take_and_where_on_8bit(device):
    x = np.arange(24, dtype=np.uint8).reshape(4, 6) * 10
    a = nd.array(x, device=device)
    assert_equal(a.permute((1, 0)).compact().numpy(), x.T)
    assert_equal(a[1:3, ::-2].compact().numpy(), x[1:3, ::-2])
    a[0, :] = 7
    x[0, :] = 7
    assert_equal(a.numpy(), x)
    i = nd.array(np.array([3, 0], np.int32), device=device)
    assert_equal(a.take(i).numpy(), x[[3, 0]])
    w = nd.where(a > 100, a, nd.array(np.zeros_like(x), device=device))
    assert w.dtype == "uint8"
    assert_equal(w.numpy(), np.where(x > 100, x, 0).astype(np.uint8))


def test_course_style_uint8_images_normalize_to_float(device):
    """The course's data pipeline: uint8 images (N, H, W, C) scaled to float32 in [0, 1]."""
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (2, 4, 4, 3)).astype(np.uint8)
    t = ndl.Tensor(images, device=device)
    assert t.dtype == "uint8"
    scaled = t.realize_cached_data().astype("float32") / 255
    np.testing.assert_allclose(scaled.numpy(), images.astype(np.float32) / 255, rtol=1e-6)
    flipped = nd.array(images, device=device)[:, :, ::-1, :].compact()
    assert_equal(flipped.numpy(), images[:, :, ::-1, :])
