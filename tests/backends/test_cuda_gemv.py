"""One-row products on CUDA (kernels/matmul.cu's gemv family, cuda/gemv.py): gemv_glu (the
decode step's gate/up projection and SwiGLU in one pass) against float64 and bitwise against
the product + swiglu it replaces, eagerly and replayed in a graph."""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from tests.conftest import assert_close

DEV = nd.cuda(0)
RNG = np.random.default_rng(15)
gpu = pytest.mark.skipif(not DEV.enabled(), reason=f"cuda disabled: {DEV.reason}")
SFX = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def _on(a, dtype="float32"):
    return nd.array(np.asarray(a, np.float32), device=DEV, dtype=dtype)


def _silu(x):
    return x / (1 + np.exp(-x))


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n,p", [(2048, 5632), (64, 3), (100, 70), (5632, 130)])
def test_gemv_glu_is_the_product_then_swiglu(n, p, dtype):
    x = _on(RNG.standard_normal((1, n)), dtype)
    w = _on(RNG.standard_normal((2 * p, n)) / np.sqrt(n), dtype)
    with DEV.backend.profile() as prof:
        got = nd.matmul_swiglu(x, w)
    assert set(prof.totals) == {f"gemv_glu_{SFX[dtype]}"}, prof.totals
    xs, ws = x.numpy().astype(np.float64), w.numpy().astype(np.float64)
    gate, up = xs @ ws[:p].T, xs @ ws[p:].T
    # three roundings (gate, up, the output) where a product has one
    assert_close(got.numpy().astype(np.float64), _silu(gate) * up, dtype, "matmul", scale=4.0)
    composed = (x @ w.permute((1, 0))).swiglu()  # gemv_t, then the swiglu kernel
    np.testing.assert_array_equal(got.numpy(), composed.numpy())


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n,p", [(1152, 6912), (64, 3), (100, 70)])
def test_gemv_geglu_is_the_product_then_geglu(n, p, dtype):
    """One row's GeGLU projection (Gemma's decode step) in one kernel, bitwise the
    composed gemv_t and geglu kernels."""
    x = _on(RNG.standard_normal((1, n)), dtype)
    w = _on(RNG.standard_normal((2 * p, n)) / np.sqrt(n), dtype)
    with DEV.backend.profile() as prof:
        got = nd.matmul_geglu(x, w)
    assert set(prof.totals) == {f"gemv_geglu_{SFX[dtype]}"}, prof.totals
    composed = (x @ w.permute((1, 0))).geglu()
    np.testing.assert_array_equal(got.numpy(), composed.numpy())


def _capture_replays(step, inputs, trials=3):
    """Capture ``step()``, then for each trial give ``inputs`` new values and compare the
    replay with an eager run of the same step (bitwise: the same kernels)."""
    with DEV.backend.capture() as graph:
        outs = step()
    try:
        for trial in range(trials):
            for arr in inputs:
                arr[...] = _on(RNG.standard_normal(arr.shape), arr.dtype)
            graph.replay()
            want = step()
            for got, ref in zip(outs, want):
                np.testing.assert_array_equal(got.numpy(), ref.numpy(), err_msg=f"replay {trial}")
    finally:
        graph.close()


@gpu
def test_a_decode_like_chain_replays_right():
    """norm -> QKV-like product -> norm -> gate/up + SwiGLU -> down, ten times in a graph,
    different weights each time: replays with new inputs equal the eager run."""
    k = 1024
    x = _on(RNG.standard_normal((1, k)), "bfloat16")
    d = _on(RNG.standard_normal((1, k)), "bfloat16")
    ones = _on(np.ones(k), "bfloat16")
    ws = [(_on(RNG.standard_normal((1536, k)) / 32, "bfloat16"),
           _on(RNG.standard_normal((2 * 2816, k)) / 32, "bfloat16"),
           _on(RNG.standard_normal((k, 2816)) / 53, "bfloat16")) for _ in range(10)]

    def step():
        h = x
        outs = []
        for wq, wgu, wdn in ws:
            _, n = nd.add_rmsnorm(h, d, ones)
            outs.append(n @ wq.permute((1, 0)))
            _, n = nd.add_rmsnorm(h, d, ones)
            h = nd.matmul_swiglu(n, wgu) @ wdn.permute((1, 0))
            outs.append(h)
        return outs

    _capture_replays(step, [x, d], trials=3)
