"""How float32 products with few output tiles split K (backends/cuda/split_k.py): the plan
on its own (no GPU needed), and split products against float64 on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backends.cuda.split_k import K_STEP, estimated_us, split_k_plan
from needle.backends.gpu.array import cdiv

SMS = 132  # an H100's; the plan takes the count as an argument
DEV = nd.cuda(0)
gpu = pytest.mark.skipif(not DEV.enabled(), reason=f"cuda disabled: {DEV.reason}")


def _tiles(m: int, p: int, batch: int = 1) -> int:
    return cdiv(m, 128) * cdiv(p, 128) * batch


def test_products_that_fill_the_sms_are_not_split():
    """128 tiles on 132 SMs: two waves of half-length groups cost what one wave of whole ones
    does, plus the slabs' sum (the old rule split these in two: 72 us against 61)."""
    for m, n, p in ((4096, 512, 512), (4096, 2048, 512), (512, 4096, 4096)):
        assert split_k_plan(_tiles(m, p), m, n, p, 1, SMS) == (1, n)


@pytest.mark.parametrize("m, n, p, least", [(512, 4096, 512, 4), (2048, 4096, 512, 2),
                                            (512, 4100, 2048, 2), (128, 8192, 128, 16),
                                            (1024, 1024, 1024, 2)])
def test_few_tiles_split_into_slices_that_cover_k(m, n, p, least):
    splits, chunk = split_k_plan(_tiles(m, p), m, n, p, 1, SMS)
    assert splits >= least
    assert chunk % K_STEP == 0 and chunk >= 256
    assert (splits - 1) * chunk < n <= splits * chunk  # every k in exactly one slice


@pytest.mark.parametrize("m, n, p", [(512, 4096, 512), (2048, 4096, 512), (1000, 1001, 999),
                                     (4096, 512, 512), (256, 640, 256)])
def test_the_plan_is_the_least_estimated_time(m, n, p):
    tiles = _tiles(m, p)
    splits, _ = split_k_plan(tiles, m, n, p, 1, SMS)
    chosen = estimated_us(tiles, m, n, p, 1, splits, SMS)
    others = [estimated_us(tiles, m, n, p, 1, s, SMS) for s in range(1, n // 256 + 1)]
    assert chosen <= min(others) / 0.97  # within the plan's preference for fewer slices
    assert chosen < estimated_us(tiles, m, n, p, 1, 1, SMS) or splits == 1


@gpu
@pytest.mark.parametrize("m, n, p, ta, tb", [(512, 4096, 512, True, False),
                                             (96, 4100, 130, False, True),
                                             (2048, 1536, 512, True, False),
                                             (4096, 512, 512, False, False)])
def test_split_products_match_float64(m, n, p, ta, tb):
    """Products the plan splits (ragged k, partial tiles, transposed operands) and one it
    does not, against float64; the split ones sum their slabs (a reduction runs)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((n, m) if ta else (m, n)).astype(np.float32)
    b = rng.standard_normal((p, n) if tb else (n, p)).astype(np.float32)
    x, y = nd.array(a, device=DEV), nd.array(b, device=DEV)
    x = x.permute((1, 0)) if ta else x
    y = y.permute((1, 0)) if tb else y
    with DEV.backend.profile() as prof:
        got = (x @ y).numpy()
    ref = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.sqrt(n))
    splits, _ = split_k_plan(_tiles(m, p), m, n, p, 1, DEV.backend.device.compute_units)
    summed = any(name.startswith("reduce") for name in prof.totals)
    assert summed == (splits > 1 and _tiles(m, p) < DEV.backend.device.compute_units)
