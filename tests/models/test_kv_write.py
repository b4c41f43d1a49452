"""``nd.scatter_add(..., out=)``: the device-indexed write the decode step stores keys with."""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.errors import ShapeError


def test_adds_into_out_in_place(device):
    rng = np.random.default_rng(0)
    base = rng.standard_normal((6, 4)).astype(np.float32)
    values = rng.standard_normal((2, 4)).astype(np.float32)
    out = nd.array(base, device=device)
    rows = nd.array(np.array([4, 1], dtype=np.int32), device=device)
    result = nd.scatter_add(rows, nd.array(values, device=device), 6, out=out)
    expected = base.copy()
    expected[[4, 1]] += values
    assert result is out
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6)


def test_out_must_fit(device):
    values = nd.zeros((1, 4), "float32", device)
    rows = nd.array(np.array([0], dtype=np.int32), device=device)
    with pytest.raises(ShapeError, match="out must be a compact"):
        nd.scatter_add(rows, values, 6, out=nd.zeros((6, 3), "float32", device))
    with pytest.raises(ShapeError, match="out must be a compact"):
        nd.scatter_add(rows, values, 6, out=nd.zeros((6, 4), "float16", device))
    with pytest.raises(ShapeError, match="not compact"):
        nd.scatter_add(rows, values, 6, out=nd.zeros((4, 6), "float32", device).transpose())
