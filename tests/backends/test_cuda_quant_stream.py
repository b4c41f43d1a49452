"""One token's quantized projections with the weights streamed into shared memory
(kernels/quant_stream.cu, sm_90: ``NEEDLE_QUANT_STREAM``) against the float64 reference
and against quant_decode.cu's kernels: groups of several stages, a last group and a last
step partly empty, per-channel int8 (one scale a row), int4 with offsets; and the calls that
fall back to quant_decode.cu (rows beyond a group's barriers or its shared memory, x wider
than a lane's registers, float32 x)."""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from tests.backend_ndarray.compare import on, random
from tests.backend_ndarray.test_quant_decode import EPS, _normed, _packed, _rounded
from tests.conftest import assert_close, tolerance

DEV = nd.cuda(0)
needs_sm90 = pytest.mark.skipif(
    not (DEV.enabled() and DEV.backend.device.capability >= 90),
    reason="the streamed quantized projections need an sm_90 GPU (bulk copies, mbarriers)")
SFX = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def _three(x, w, qm, qm2, t0, dtype, stream: str):
    """The three projections of one layer under NEEDLE_QUANT_STREAM=stream, and the kernels
    they ran."""
    X, Wn, T = on(DEV, x), on(DEV, w), on(DEV, t0)
    with DEV.backend.tuned(quant_stream=stream), DEV.backend.profile() as prof:
        plain = nd.rmsnorm_matvec(X, Wn, qm, EPS).numpy().astype(np.float64)
        act = nd.rmsnorm_matvec(X, Wn, qm2, EPS, activation="swiglu").numpy().astype(
            np.float64)
        nd.matvec_add(X, qm, T)
    return plain, act, T.numpy().astype(np.float64), set(prof.totals)


def _check(dtype, fmt, p, stream, want_kernels, rng):
    bits, group, symmetric, k = fmt
    x, w = random(rng, (1, k), dtype, -2, 2), random(rng, (k,), dtype, 0.5, 1.5)
    t0 = random(rng, (1, p), dtype, -2, 2)
    qm, exact = _packed(rng, p, k, bits, group, symmetric, DEV)
    qm2, exact2 = _packed(rng, 2 * p, k, bits, group, symmetric, DEV)
    plain, act, added, kernels = _three(x, w, qm, qm2, t0, dtype, stream)
    assert kernels == want_kernels, kernels
    h = _normed(x, w, dtype)
    assert_close(plain, h @ exact.T, dtype, "matmul")
    gu = _rounded(h @ exact2.T, dtype)
    # g and u are rounded to T before the SiLU: a product at a rounding tie may round the
    # other way (x taken as integers: docs/quantization.md), moving the result an ulp more
    assert_close(act, gu[:, :p] / (1 + np.exp(-gu[:, :p])) * gu[:, p:], dtype, "matmul",
                 rtol=2 * tolerance(dtype, "matmul"))
    y = _rounded(x.astype(np.float64) @ exact.T, dtype)
    assert_close(added, t0.astype(np.float64) + y, dtype, "matmul",
                 scale=max(1.0, float(np.abs(y).max())))
    # the same results as quant_decode.cu's kernels within the products' rounding
    old = _three(x, w, qm, qm2, t0, dtype, "off")
    for got, before in zip((plain, act, added), old[:3]):
        assert_close(got, before, dtype, "matmul", scale=max(1.0, float(np.abs(before).max())))


def _names(prefix: str, bits: int, symmetric: bool, dtype: str) -> set[str]:
    o = "" if symmetric else "o"
    kinds = (("norm", "swiglu", "add") if prefix == "qstream" else
             ("rmsnorm_qmv", "rmsnorm_qmv_swiglu", "qmv_add"))
    return {f"{prefix}_{kind}{bits}{o}_{SFX[dtype]}" if prefix == "qstream"
            else f"{kind}{bits}{o}_{SFX[dtype]}" for kind in kinds}


@needs_sm90
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fmt", [(8, None, True, 512), (8, 32, True, 256), (4, 128, True, 1024),
                                 (4, 32, False, 384), (4, 64, True, 2816),
                                 (4, 128, True, 640)], ids=str)
@pytest.mark.parametrize("p", [5, 1000, 4321])
def test_streamed_projections_match_the_reference(dtype, fmt, p, rng):
    """p = 5: a few groups of one partly empty step; 1,000 and 4,321: groups of 4-33 outputs,
    warps of up to 3 steps (SwiGLU: 1 pair a step), the last group shorter. The scales come
    by bulk copies where a row's groups are a multiple of 4 (8, 12, 44 here), by 4-byte
    copies otherwise (1 and 5)."""
    bits, _, symmetric, _ = fmt
    _check(dtype, fmt, p, "always", _names("qstream", bits, symmetric, dtype), rng)


@needs_sm90
@pytest.mark.parametrize("fmt,p", [((8, None, True, 256), 34000),  # > 16 stages a group
                                   ((8, None, True, 6144), 5100),  # > shared memory
                                   ((4, 128, True, 6400), 300)],  # x wider than registers
                         ids=str)
def test_what_does_not_fit_one_wave_takes_quant_decode(fmt, p, rng):
    bits, _, symmetric, _ = fmt
    _check("bfloat16", fmt, p, "always", _names("plain", bits, symmetric, "bfloat16"), rng)


@needs_sm90
def test_float32_x_takes_quant_decode(rng):
    _check("float32", (4, 64, True, 256), 300, "always", _names("plain", 4, True, "float32"),
           rng)


@needs_sm90
@pytest.mark.parametrize("fmt,p,streamed", [((4, 128, True, 5120), 4321, True),
                                            ((8, None, True, 2560), 4321, True),
                                            ((4, 128, True, 4096), 4321, False),
                                            ((8, None, True, 2048), 4321, False),
                                            ((4, 128, True, 1024), 1000, True)], ids=str)
def test_by_default_one_step_a_warp_or_rows_of_160_chunks_stream(fmt, p, streamed, rng):
    """"auto": 4,321 outputs are 33 a multiprocessor (several steps of each warp): rows of
    at least 160 16-byte chunks (5,120 int4 or 2,560 int8 values) take quant_stream.cu,
    shorter ones quant_decode.cu; 1,000 outputs are one step of each warp (2 rows, or a gate
    and up pair) whatever the rows."""
    prefix = "qstream" if streamed else "plain"
    _check("bfloat16", fmt, p, "auto", _names(prefix, fmt[0], True, "bfloat16"), rng)
