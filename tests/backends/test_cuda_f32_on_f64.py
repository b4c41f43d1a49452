"""float32 products on FP64 tensor cores (kernels/sgemm_dmma.cuh, tuning ``f32_on_f64``):
every layout, batched, the stage prologue with fewer k tiles than stages; the route taken
(and not taken where the tiles do not divide the product or fill the SMs twice); and the
accuracy claim: exact products and float64 sums leave only the final rounding, so each
output is within half a float32 ulp of the float64 product (plus float64's own error) and
no further from it than the SIMT kernel's."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import needle.backend_ndarray as nd

DEV = nd.cuda(0)
pytestmark = pytest.mark.skipif(not DEV.enabled(), reason=f"cuda disabled: {DEV.reason}")


def _on():
    if not DEV.backend.tuning.f32_on_f64:
        pytest.skip(f"{DEV.backend.device.model}: no full-rate FP64 tensor cores "
                    "(tuning f32_on_f64 is off)")


def _operands(rng, m, k, p, ta, tb, batch):
    a = rng.standard_normal((batch, k, m) if ta else (batch, m, k)).astype(np.float32)
    b = rng.standard_normal((batch, p, k) if tb else (batch, k, p)).astype(np.float32)
    return a, b


def _product(a, b, ta, tb):
    x, y = nd.array(a, device=DEV), nd.array(b, device=DEV)
    x = x.permute((0, 2, 1)) if ta else x
    y = y.permute((0, 2, 1)) if tb else y
    with DEV.backend.profile() as prof:
        got = (x @ y).numpy()
    return got, set(prof.totals)


def _exact(a, b, ta, tb):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    a64 = a64.transpose(0, 2, 1) if ta else a64
    b64 = b64.transpose(0, 2, 1) if tb else b64
    return np.matmul(a64, b64), np.matmul(np.abs(a64), np.abs(b64))


@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("m,k,p,batch", [
    (2048, 192, 2176, 1),  # 272 tiles, 3 k tiles
    (2048, 64, 2176, 1),   # one k tile: fewer than the pipeline's stages
    (2048, 320, 1152, 2),  # batched: 288 tiles
])
def test_float32_products_on_fp64_tensor_cores(layout, m, k, p, batch):
    _on()
    ta, tb = layout[0] == "t", layout[1] == "t"
    rng = np.random.default_rng(zlib.crc32(f"{layout} {m} {k} {p} {batch}".encode()))
    a, b = _operands(rng, m, k, p, ta, tb, batch)
    got, names = _product(a, b, ta, tb)
    tiles = (m // 128) * (p // 128) * batch
    assert tiles >= 2 * DEV.backend.device.compute_units
    assert f"matmul_{layout}_dmma_f32" in names, names
    want, scale = _exact(a, b, ta, tb)
    # the final rounding (half an ulp of the float32 result) and float64's sums
    bound = 0.5 * np.spacing(np.abs(got)) + 4 * k * 2.0**-53 * scale
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), float((err / bound).max())
    with DEV.backend.tuned(f32_on_f64=False):  # the SIMT kernel: no closer to the product
        simt, names = _product(a, b, ta, tb)
    assert f"matmul_{layout}_f32" in names, names
    assert err.max() <= np.abs(simt.astype(np.float64) - want).max()


@pytest.mark.parametrize("m,k,p", [
    (2050, 64, 2176),  # rows not whole tiles
    (2048, 96, 2176),  # k not a multiple of 64
    (1024, 64, 1024),  # 64 tiles: too few to fill 132 SMs twice
])
def test_products_the_fp64_kernel_does_not_fit_take_the_simt_kernel(m, k, p):
    _on()
    rng = np.random.default_rng(m + k + p)
    a, b = _operands(rng, m, k, p, False, False, 1)
    got, names = _product(a, b, False, False)
    assert not any("dmma" in n for n in names), names
    want, scale = _exact(a, b, False, False)
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-6)
