"""The float32 SIMT products' two ways of bringing tiles in (kernels/sgemm.cuh): groups whose
tiles lie wholly inside aligned matrices copy them (cp.async) or load them through
pointers worked out once, the others load with bounds. Each output sums its k's in the
same order either way, so a product and the same product with one zero k appended (which
sends every group down the bounded path) agree to the bit; both against float64."""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd

DEV = nd.cuda(0)
pytestmark = pytest.mark.skipif(not DEV.enabled(), reason=f"cuda disabled: {DEV.reason}")


def _operands(rng, batch, m, k, p, ta, tb, extra_k=0):
    """Stored operands (transposed where ta / tb) with extra_k zero k's appended."""
    a = rng.standard_normal((batch, m, k)).astype(np.float32)
    b = rng.standard_normal((batch, k, p)).astype(np.float32)
    a = np.concatenate([a, np.zeros((batch, m, extra_k), np.float32)], axis=2)
    b = np.concatenate([b, np.zeros((batch, extra_k, p), np.float32)], axis=1)
    sa = np.ascontiguousarray(a.transpose(0, 2, 1)) if ta else a
    sb = np.ascontiguousarray(b.transpose(0, 2, 1)) if tb else b
    return a, b, sa, sb


def _product(sa, sb, ta, tb, batch):
    x, y = nd.array(sa, device=DEV), nd.array(sb, device=DEV)
    x = x.permute((0, 2, 1)) if ta else x
    y = y.permute((0, 2, 1)) if tb else y
    if batch == 1:
        x, y = x.reshape(x.shape[1:]), y.reshape(y.shape[1:])
    return (x @ y).numpy().reshape(batch, x.shape[-2], y.shape[-1])


@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("batch, m, k, p", [(1, 256, 64, 384),    # every group inside
                                            (1, 300, 64, 260),    # inside and edge groups
                                            (2, 128, 48, 256),    # batched
                                            (1, 256, 64, 64)])    # the 64-wide tiles
def test_inside_and_bounded_paths_agree_to_the_bit(batch, m, k, p, ta, tb):
    rng = np.random.default_rng(11)
    a, b, sa, sb = _operands(rng, batch, m, k, p, ta, tb)
    got = _product(sa, sb, ta, tb, batch)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    rng = np.random.default_rng(11)
    _, _, sa1, sb1 = _operands(rng, batch, m, k, p, ta, tb, extra_k=1)
    bounded = _product(sa1, sb1, ta, tb, batch)
    np.testing.assert_array_equal(got, bounded)


@pytest.mark.parametrize("ta", [False, True])
def test_split_k_slices_inside_match_float64(ta):
    """Few output tiles: groups also split k (slices of whole k tiles, so inside)."""
    rng = np.random.default_rng(7)
    a, b, sa, sb = _operands(rng, 1, 256, 4096, 128, ta, False)
    got = _product(sa, sb, ta, False, 1)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.sqrt(4096))


def test_an_operand_starting_one_float_into_its_buffer():
    """A view one float into its buffer: not 16-byte aligned, whichever path reads it."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((128 * 128 + 1,)).astype(np.float32)
    b = rng.standard_normal((128, 128)).astype(np.float32)
    x = nd.array(a, device=DEV)[1:].reshape((128, 128))
    got = (x @ nd.array(b, device=DEV)).numpy()
    ref = a[1:].reshape(128, 128).astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.sqrt(128))
