"""CUDA's float32 products of at most 64 columns on 128 x 64 tiles (matmul_*64_f32), alone
and split over K, every layout, batched and ragged, against float64 through the backend's
matmul (so the transposed layouts are the ones asked for)."""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd

DEV = nd.cuda(0)
pytestmark = pytest.mark.skipif(not DEV.enabled(), reason=f"cuda disabled: {DEV.reason}")

CASES = [  # m, k, p, batch, transpose a, transpose b
    (256, 256, 64, 8, True, False),    # the attention backward's dK / dV
    (256, 256, 64, 8, False, False),   # its dQ
    (300, 70, 33, 3, False, True),     # ragged everything
    (130, 1000, 64, 1, True, True),    # two tiles: split over K as well
    (129, 2048, 17, 1, False, False),  # split, p far from the tile
]


@pytest.mark.parametrize("m, k, p, batch, ta, tb", CASES)
def test_narrow_products_match_float64(m, k, p, batch, ta, tb):
    rng = np.random.default_rng(m + k + p)
    a = rng.standard_normal((batch, k, m) if ta else (batch, m, k)).astype(np.float32)
    b = rng.standard_normal((batch, p, k) if tb else (batch, k, p)).astype(np.float32)
    x, y = nd.array(a, device=DEV), nd.array(b, device=DEV)
    out = nd.array(np.full((batch, m, p), np.nan, np.float32), device=DEV)
    with DEV.backend.profile() as prof:
        DEV.backend.matmul(x.handle, y.handle, out.handle, m, k, p, batch=batch,
                           transpose_a=ta, transpose_b=tb)
    layout = f"{'t' if ta else 'n'}{'t' if tb else 'n'}"
    assert f"matmul_{layout}64_f32" in prof.totals
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = np.matmul(a64.transpose(0, 2, 1) if ta else a64, b64.transpose(0, 2, 1) if tb else b64)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_switched_off_the_wide_tiles_agree():
    rng = np.random.default_rng(5)
    a = rng.standard_normal((8, 256, 256)).astype(np.float32)
    b = rng.standard_normal((8, 256, 64)).astype(np.float32)
    x, y = nd.array(a, device=DEV), nd.array(b, device=DEV)
    narrow = (x @ y).numpy()
    with DEV.backend.tuned(narrow_f32=False):
        with DEV.backend.profile() as prof:
            wide = (x @ y).numpy()
    assert "matmul_nn_f32" in prof.totals and "matmul_nn64_f32" not in prof.totals
    np.testing.assert_allclose(narrow, wide, rtol=1e-5, atol=1e-4)
