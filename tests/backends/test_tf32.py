"""float32 matmul precision (``ndl.set_float32_matmul_precision``): the setting itself on
every machine; TF32 products on a Hopper GPU (the TMA GEMM with float operands) against a
float64 reference, and IEEE float32 when the setting is "highest"."""

from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
import needle.backend_ndarray as nd
from needle.backends import precision
from needle.errors import ArgumentError

DEV = nd.cuda(0)
RNG = np.random.default_rng(11)
hopper = pytest.mark.skipif(not (DEV.enabled() and DEV.backend.tuning.tma),
                            reason="TF32 products need a Hopper GPU (device feature 'tma')")


@pytest.fixture
def restore_precision():
    before = precision._precision
    yield
    precision._precision = before


def _relerr(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_precision_is_set_read_and_checked(restore_precision, monkeypatch):
    precision._precision = None
    monkeypatch.delenv("NEEDLE_FLOAT32_MATMUL_PRECISION", raising=False)
    assert ndl.get_float32_matmul_precision() == "highest" and not precision.tf32_allowed()
    ndl.set_float32_matmul_precision("high")
    assert ndl.get_float32_matmul_precision() == "high" and precision.tf32_allowed()
    with pytest.raises(ArgumentError, match="must be one of 'highest', 'high'.*got 'medium'"):
        ndl.set_float32_matmul_precision("medium")
    assert ndl.get_float32_matmul_precision() == "high"  # a refused value changes nothing
    precision._precision = None
    monkeypatch.setenv("NEEDLE_FLOAT32_MATMUL_PRECISION", "high")
    assert ndl.get_float32_matmul_precision() == "high"
    precision._precision = None
    monkeypatch.setenv("NEEDLE_FLOAT32_MATMUL_PRECISION", "tf32")
    with pytest.raises(ArgumentError, match="NEEDLE_FLOAT32_MATMUL_PRECISION.*got 'tf32'"):
        ndl.get_float32_matmul_precision()


@pytest.mark.parametrize("device", ["cpu", "cpu_numpy"])
def test_backends_without_tf32_compute_float32_either_way(restore_precision, device):
    dev = nd.device_from_name(device)
    a = RNG.standard_normal((130, 96)).astype(np.float32)
    b = RNG.standard_normal((96, 70)).astype(np.float32)
    x, y = nd.array(a, device=dev), nd.array(b, device=dev)
    ndl.set_float32_matmul_precision("highest")
    exact = (x @ y).numpy()
    ndl.set_float32_matmul_precision("high")
    np.testing.assert_array_equal((x @ y).numpy(), exact)


def _case(m, n, p, ta, tb, batch):
    a = RNG.standard_normal((batch, n, m) if ta else (batch, m, n)).astype(np.float32)
    b = RNG.standard_normal((batch, p, n) if tb else (batch, n, p)).astype(np.float32)
    A, B = nd.array(a, device=DEV), nd.array(b, device=DEV)
    A = A.permute((0, 2, 1)) if ta else A
    B = B.permute((0, 2, 1)) if tb else B
    a64 = a.astype(np.float64).transpose(0, 2, 1) if ta else a.astype(np.float64)
    b64 = b.astype(np.float64).transpose(0, 2, 1) if tb else b.astype(np.float64)
    return A, B, a64 @ b64


@hopper
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("m,n,p,batch", [(128, 32, 64, 1), (300, 200, 520, 2),
                                         (1024, 1024, 1024, 1), (257, 68, 130, 3),
                                         (512, 2052, 258, 1)])
def test_tf32_products_on_hopper(restore_precision, m, n, p, ta, tb, batch):
    """"high": the TMA GEMM's TF32 kernel (every layout, ragged tiles, batches), within
    TF32's error of the float64 product and outside float32's; "highest": float32 kernels
    within float32's error."""
    A, B, want = _case(m, n, p, ta, tb, batch)
    ndl.set_float32_matmul_precision("high")
    with DEV.backend.profile() as prof:
        got = (A @ B).numpy()
    assert any(k.startswith("matmul_tma") and k.endswith("_tf32_f32") for k in prof.totals), \
        prof.table()
    err = _relerr(got, want)
    assert 1e-5 < err < 3e-3, err
    ndl.set_float32_matmul_precision("highest")
    with DEV.backend.profile() as prof:
        got = (A @ B).numpy()
    assert not any("tf32" in k for k in prof.totals), prof.table()
    assert _relerr(got, want) < 1e-5


@hopper
def test_tf32_falls_back_where_the_tma_kernel_does_not_apply(restore_precision):
    """Rows of k not a multiple of 4 floats (16-byte strides) and products under a tile
    keep float32 kernels even when TF32 is allowed."""
    ndl.set_float32_matmul_precision("high")
    for m, n, p in [(256, 66, 128), (64, 64, 64)]:
        A, B, want = _case(m, n, p, False, False, 1)
        with DEV.backend.profile() as prof:
            got = (A @ B).numpy()
        assert not any("tf32" in k for k in prof.totals), prof.table()
        assert _relerr(got, want) < 1e-5
