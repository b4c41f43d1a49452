"""Indexing and transformer functions: take, scatter_add, softmax, log_softmax, rmsnorm,
layernorm, rope, silu_mul and attention (causal or not, grouped-query heads, a KV cache
filled to kv_len < capacity)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backends.api import has
from needle.errors import ArgumentError, DTypeError, ShapeError

from ..conftest import assert_close, check_unsupported_dtype, tolerance
from .compare import FLOATS, LAYOUTS, compare, layout, on, random

# --- take and scatter_add -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", nd.ALL_DTYPES)
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_take(device, dtype, index_dtype, rng):
    if check_unsupported_dtype(device, dtype):
        return
    table = random(rng, (11, 6), dtype, -9, 9)
    for shape in [(5,), (2, 3), (), (0,), (40,)]:
        idx = rng.integers(0, 11, size=shape).astype(index_dtype)
        got = compare(device, lambda t, i: t.take(i), [table, idx],
                      expected=lambda t, i: t[i])
        assert got.shape == shape + (6,) and got.dtype == dtype


@pytest.mark.parametrize("table_kind", ["compact", "transposed", "sliced", "negative_step"])
def test_take_non_compact(device, table_kind, rng):
    base, view = layout((9, 5), table_kind)
    table = random(rng, base, "float32")
    idx = np.array([[8, 0, 3], [3, 3, 1]], np.int64)
    compare(device, lambda t, i: t.take(i), [table, idx], views=[view, lambda i: i[:, ::-1]],
            expected=lambda t, i: t[i])


def test_take_from_python_list_and_big_table(device, rng):
    table = random(rng, (1000, 64), "float32")
    a = on(device, table)
    got = a.take([999, 0, 512])
    np.testing.assert_array_equal(got.numpy(), table[[999, 0, 512]])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64", "int32"])
def test_scatter_add(device, dtype, rng):
    if check_unsupported_dtype(device, dtype):
        return
    rows, dim = 7, 5
    idx = np.array([0, 3, 3, 6, 0, 3, 2, 2, 2], np.int64)  # repeated rows accumulate
    values = random(rng, (idx.size, dim), dtype, -4, 4)

    def expected(i, v):
        out = np.zeros((rows, dim))
        np.add.at(out, i, v)
        return out

    got = compare(device, lambda i, v: nd.scatter_add(i, v, rows), [idx, values],
                  expected=expected, kind="reduction")
    assert got.shape == (rows, dim) and got.dtype == dtype


def test_scatter_add_non_compact_and_int32_indices(device, rng):
    idx = np.array([[1, 4], [4, 0]], np.int32)
    values = random(rng, (3, 2, 2), "float32")  # viewed as (2, 2, 3): (index, index, dim)

    def expected(i, v):
        out = np.zeros((5, 3))
        np.add.at(out, i.reshape(-1), v.reshape(-1, 3))
        return out

    compare(device, lambda i, v: nd.scatter_add(i, v, 5), [idx, values],
            views=[lambda i: i, lambda v: v.transpose((1, 2, 0))], expected=expected,
            kind="reduction")


def test_scatter_add_empty_and_many_collisions(device, rng):
    none = compare(device, lambda i, v: nd.scatter_add(i, v, 3),
                   [np.zeros(0, np.int64), np.zeros((0, 4), np.float32)],
                   expected=lambda i, v: np.zeros((3, 4)))
    assert none.shape == (3, 4)
    idx = rng.integers(0, 4, 5000).astype(np.int64)  # thousands of adds into 4 rows
    values = random(rng, (5000, 8), "float32", 0, 1)

    def expected(i, v):
        out = np.zeros((4, 8))
        np.add.at(out, i, v)
        return out

    compare(device, lambda i, v: nd.scatter_add(i, v, 4), [idx, values], expected=expected,
            kind="reduction")


# --- row functions ------------------------------------------------------------------------

def _softmax(x):
    z = x - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _log_softmax(x):
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


SOFTMAXES = {"softmax": (lambda a: a.softmax(), _softmax),
             "log_softmax": (lambda a: a.log_softmax(), _log_softmax)}
ROW_SHAPES = [(1,), (7,), (3, 33), (2, 3, 64), (4, 1000), (1, 4099), (5, 1)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", list(SOFTMAXES))
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
def test_softmax(device, dtype, op, shape, rng):
    if check_unsupported_dtype(device, dtype):
        return
    fn, want = SOFTMAXES[op]
    got = compare(device, fn, [random(rng, shape, dtype, -8, 8)], expected=want,
                  kind="reduction")
    assert got.dtype == dtype and got.shape == shape


@pytest.mark.parametrize("op", list(SOFTMAXES))
@pytest.mark.parametrize("kind", LAYOUTS)
def test_softmax_non_compact(device, op, kind, rng):
    fn, want = SOFTMAXES[op]
    base, view = layout((6, 9), kind)
    compare(device, fn, [random(rng, base, "float32", -5, 5)], views=[view], expected=want,
            kind="reduction")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", list(SOFTMAXES))
def test_softmax_edge_values(device, dtype, op):
    """Masked (-inf) and very negative (-1e30) logits, and logits whose exp overflows."""
    if check_unsupported_dtype(device, dtype):
        return
    fn, want = SOFTMAXES[op]
    big = 6e4 if dtype == "float16" else 1e30
    rows = np.array([
        [0.0, -np.inf, 1.0, -np.inf],
        [-big, 0.0, -big, 2.0],
        [big, big, 0.0, -big],  # exp(1e30) is inf: the max must be subtracted first
        [100.0, 99.0, 98.0, -100.0],
        [-np.inf, -np.inf, -np.inf, 5.0],
        [-np.inf, -np.inf, -np.inf, -np.inf],  # a fully masked row is NaN, as in torch
        [-big, -big, -big, -big],  # a uniform row stays uniform however negative
    ], dtype=nd.dtypes.to_numpy_dtype(dtype))
    compare(device, fn, [rows], expected=want, kind="reduction")


def _rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _layernorm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 3, 64), (4, 1000), (1, 4099)], ids=str)
@pytest.mark.parametrize("eps", [1e-6, 0.1])
def test_rmsnorm(device, dtype, shape, eps, rng):
    if check_unsupported_dtype(device, dtype):
        return
    x, w = random(rng, shape, dtype, -3, 3), random(rng, shape[-1:], dtype, 0.5, 1.5)
    got = compare(device, lambda a, b: a.rmsnorm(b, eps), [x, w],
                  expected=lambda a, b: _rmsnorm(a, b, eps), kind="reduction")
    assert got.dtype == dtype and got.shape == shape


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 3, 64), (4, 1000), (1, 4099)], ids=str)
def test_layernorm(device, dtype, shape, rng):
    if check_unsupported_dtype(device, dtype):
        return
    x = random(rng, shape, dtype, -3, 3) + np.asarray(2, nd.dtypes.to_numpy_dtype(dtype))
    w, b = random(rng, shape[-1:], dtype, 0.5, 1.5), random(rng, shape[-1:], dtype, -1, 1)
    got = compare(device, lambda a, ww, bb: a.layernorm(ww, bb, 1e-5), [x, w, b],
                  expected=lambda a, ww, bb: _layernorm(a, ww, bb, 1e-5), kind="reduction")
    assert got.dtype == dtype and got.shape == shape


def test_norms_constant_rows_and_mixed_weight_dtype(device, rng):
    """A constant row has zero variance (eps alone keeps it finite); a float32 weight is
    cast to the input's dtype."""
    x = np.full((2, 16), 3.0, np.float32)
    w, b = random(rng, (16,), "float32"), random(rng, (16,), "float32")
    compare(device, lambda a, ww, bb: a.layernorm(ww, bb), [x, w, b],
            expected=lambda a, ww, bb: _layernorm(a, ww, bb, 1e-5), kind="reduction")
    zeros = np.zeros((2, 16), np.float32)
    compare(device, lambda a, ww: a.rmsnorm(ww), [zeros, w],
            expected=lambda a, ww: _rmsnorm(a, ww, 1e-6), kind="reduction")
    xh = random(rng, (3, 16), "float16")
    got = compare(device, lambda a, ww: a.rmsnorm(ww), [xh, w],
                  expected=lambda a, ww: _rmsnorm(a, ww.astype(np.float16).astype(np.float64),
                                                  1e-6), kind="reduction")
    assert got.dtype == "float16"


@pytest.mark.parametrize("kind", LAYOUTS)
def test_norms_non_compact(device, kind, rng):
    base, view = layout((5, 8), kind)
    x, w, b = random(rng, base, "float32"), random(rng, (8,), "float32"), random(rng, (8,),
                                                                               "float32")
    compare(device, lambda a, ww: a.rmsnorm(ww), [x, w], views=[view, lambda t: t],
            expected=lambda a, ww: _rmsnorm(a, ww, 1e-6), kind="reduction")
    compare(device, lambda a, ww, bb: a.layernorm(ww, bb), [x, w, b],
            views=[view, lambda t: t[::-1], lambda t: t],
            expected=lambda a, ww, bb: _layernorm(a, ww, bb, 1e-5), kind="reduction")


def _rope(x, cos, sin):
    h = x.shape[-1] // 2
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _rope_tables(seq, head_dim, base=10000.0):
    inv = base ** (-np.arange(0, head_dim, 2) / head_dim)
    ang = np.arange(seq)[:, None] * inv[None, :]
    return np.cos(ang), np.sin(ang)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (2, 7, 3, 64), (1, 33, 4, 128), (3, 5, 2, 10)],
                         ids=str)
def test_rope(device, dtype, shape, rng):
    if check_unsupported_dtype(device, dtype):
        return
    np_dt = nd.dtypes.to_numpy_dtype(dtype)
    cos, sin = (t.astype(np_dt) for t in _rope_tables(shape[1], shape[3]))
    x = random(rng, shape, dtype, -2, 2)
    got = compare(device, lambda a, c, s: a.rope(c, s), [x, cos, sin], expected=_rope)
    assert got.dtype == dtype and got.shape == shape


def test_rope_non_compact_and_float32_tables(device, rng):
    """x in (batch, heads, seq, dim) order viewed as (batch, seq, heads, dim), as attention
    code permutes it; float32 tables with a float16 x are cast."""
    cos, sin = (t.astype(np.float32) for t in _rope_tables(6, 16))
    x = random(rng, (2, 3, 6, 16), "float32")
    compare(device, lambda a, c, s: a.rope(c, s), [x, cos, sin],
            views=[lambda t: t.transpose((0, 2, 1, 3)), lambda t: t, lambda t: t],
            expected=_rope)
    xh = random(rng, (1, 6, 2, 16), "float16")
    compare(device, lambda a, c, s: a.rope(c, s), [xh, cos, sin],
            expected=lambda a, c, s: _rope(a, c.astype(np.float16).astype(np.float64),
                                           s.astype(np.float16).astype(np.float64)))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 33), (2, 1000)], ids=str)
def test_silu_mul(device, dtype, shape, rng):
    if check_unsupported_dtype(device, dtype):
        return
    a, b = random(rng, shape, dtype, -6, 6), random(rng, shape, dtype, -2, 2)
    got = compare(device, lambda x, y: x.silu_mul(y), [a, b],
                  expected=lambda x, y: x / (1 + np.exp(-x)) * y)
    assert got.dtype == dtype


def test_silu_mul_non_compact(device, rng):
    a, b = random(rng, (8, 6), "float32"), random(rng, (6, 8), "float32")
    compare(device, lambda x, y: x.silu_mul(y), [a, b],
            views=[lambda t: t[::-1], lambda t: t.transpose((1, 0))],
            expected=lambda x, y: x / (1 + np.exp(-x)) * y)


# --- attention ----------------------------------------------------------------------------

def _attention(q, k, v, scale, causal, kv_len, window=None, softcap=None):
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k[:, :, :kv_len], group, axis=1)
    v = np.repeat(v[:, :, :kv_len], group, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if causal:
        q_len = q.shape[2]
        position = np.arange(q_len)[:, None] + (kv_len - q_len)
        allowed = np.arange(kv_len)[None, :] <= position
        if window:
            allowed &= np.arange(kv_len)[None, :] > position - window
        s = np.where(allowed, s, -np.inf)
    return _softmax(s) @ v


ATTENTION_CASES = {
    # name: (batch, q_heads, kv_heads, q_len, kv_len, capacity, head_dim, causal)
    "prefill_causal": (2, 4, 4, 7, 7, 7, 16, True),
    "full": (1, 2, 2, 5, 9, 9, 8, False),
    "gqa_causal": (1, 8, 2, 6, 6, 6, 32, True),
    "mqa": (2, 4, 1, 3, 5, 5, 16, False),
    "decode_cache": (1, 4, 2, 1, 13, 32, 64, True),  # one new token, a part-filled cache
    "chunk_into_cache": (2, 6, 3, 4, 10, 16, 16, True),
    "not_causal_cache": (1, 2, 1, 3, 5, 12, 8, False),
    "odd_dims": (1, 3, 1, 33, 33, 40, 24, True),
}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention(device, dtype, case, rng):
    if check_unsupported_dtype(device, dtype):
        return
    b, hq, hkv, sq, kv_len, cap, d, causal = ATTENTION_CASES[case]
    q = random(rng, (b, hq, sq, d), dtype, -1, 1)
    k, v = random(rng, (b, hkv, cap, d), dtype, -1, 1), random(rng, (b, hkv, cap, d), dtype, -1, 1)
    scale = 1 / math.sqrt(d)
    got = compare(device, lambda qq, kk, vv: nd.attention(qq, kk, vv, causal=causal,
                                                          kv_len=kv_len), [q, k, v],
                  expected=lambda qq, kk, vv: _attention(qq, kk, vv, scale, causal, kv_len),
                  kind="reduction")
    assert got.dtype == dtype and got.shape == q.shape


# name: (batch, q_heads, kv_heads, q_len, kv_len, capacity, head_dim, window): prompts and
# chunks continuing a cache, windows shorter than a tile (CUDA: 32 or 64 keys), spanning many,
# and one group of rows across two heads; head sizes of CUDA's tensor-core kernel (64, 128)
# and of the tiled kernel (256, 96, 16)
WINDOW_CASES = {
    "prefill_w3": (1, 4, 2, 20, 20, 20, 16, 3),
    "gqa_prefill_w100_d64": (1, 8, 2, 300, 300, 300, 64, 100),
    "gemma_prefill_w40_d256": (1, 4, 1, 130, 130, 140, 256, 40),
    "chunk_w50_d128": (2, 8, 2, 70, 200, 210, 128, 50),
    "heads_cross_w7_d96": (1, 6, 3, 45, 45, 45, 96, 7),
    "chunk_w150_d64": (1, 16, 2, 128, 900, 1000, 64, 150),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_attention_sliding_window(device, dtype, case, rng):
    """A causal window: the query at position i sees keys i - window + 1..i (a layer of
    Mistral, Phi-3 or Gemma 3 over its prompt), heads-first and as token-major query rows."""
    if check_unsupported_dtype(device, dtype):
        return
    b, hq, hkv, sq, kv_len, cap, d, window = WINDOW_CASES[case]
    q = random(rng, (b, hq, sq, d), dtype, -1, 1)
    k, v = random(rng, (b, hkv, cap, d), dtype, -1, 1), random(rng, (b, hkv, cap, d), dtype, -1, 1)
    scale = 1 / math.sqrt(d)
    compare(device, lambda qq, kk, vv: nd.attention(qq, kk, vv, causal=True, kv_len=kv_len,
                                                    window=window), [q, k, v],
            expected=lambda qq, kk, vv: _attention(qq, kk, vv, scale, True, kv_len, window),
            kind="reduction")
    rows = on(device, np.ascontiguousarray(q.transpose(0, 2, 1, 3)))  # (b, s, hq, d) rows
    got = nd.attention(rows.permute((0, 2, 1, 3)), on(device, k), on(device, v), causal=True,
                       kv_len=kv_len, window=window)
    wide = [np.asarray(t, np.float64) for t in (q, k, v)]
    want = _attention(*wide, scale, True, kv_len, window)
    assert_close(got, want, dtype, "reduction")


# name: (batch, q_heads, kv_heads, q_len, kv_len, capacity, head_dim, window): Gemma 2's
# prompts (256-wide heads, windows on every other layer) and the other head sizes, whose
# tensor-core and float32-tile kernels do not cap (CUDA then takes the nn kernel)
SOFTCAP_CASES = {
    "gemma2_prefill_d256": (1, 8, 4, 130, 130, 140, 256, None),
    "gemma2_prefill_w40_d256": (1, 8, 4, 130, 130, 140, 256, 40),
    "gqa_prefill_d64": (1, 8, 2, 300, 300, 300, 64, None),
    "chunk_d128_w50": (2, 8, 2, 70, 200, 210, 128, 50),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(SOFTCAP_CASES))
def test_attention_soft_capped(device, dtype, case, rng):
    """Gemma 2's soft-capped scores over a prompt (cap · tanh(s / cap) after the scale,
    before the mask), heads-first and as token-major query rows, against the float64
    formula; the cap binds (uncapped is further off than the tolerance)."""
    if check_unsupported_dtype(device, dtype):
        return
    b, hq, hkv, sq, kv_len, cap, d, window = SOFTCAP_CASES[case]
    q = random(rng, (b, hq, sq, d), dtype, -1, 1)
    k, v = random(rng, (b, hkv, cap, d), dtype, -1, 1), random(rng, (b, hkv, cap, d), dtype, -1, 1)
    compare(device, lambda qq, kk, vv: nd.attention(qq, kk, vv, 1.0, True, kv_len, window, 1.5),
            [q, k, v],
            expected=lambda qq, kk, vv: _attention(qq, kk, vv, 1.0, True, kv_len, window, 1.5),
            kind="reduction")
    rows = on(device, np.ascontiguousarray(q.transpose(0, 2, 1, 3)))  # (b, s, hq, d) rows
    got = nd.attention(rows.permute((0, 2, 1, 3)), on(device, k), on(device, v), 1.0, True,
                       kv_len, window, 1.5)
    wide = [np.asarray(t, np.float64) for t in (q, k, v)]
    want = _attention(*wide, 1.0, True, kv_len, window, 1.5)
    assert_close(got, want, dtype, "reduction")
    uncapped = _attention(*wide, 1.0, True, kv_len, window)
    assert np.abs(uncapped - want).max() > 3 * tolerance(dtype, "reduction")
    with pytest.raises(ArgumentError, match="softcap"):
        nd.attention(rows.permute((0, 2, 1, 3)), on(device, k), on(device, v), softcap=0)


def test_attention_window_errors(device, rng):
    q = on(device, random(rng, (1, 2, 4, 8), "float32"))
    for bad, causal in ((0, True), (-1, True), (2.0, True), (True, True), (3, False)):
        with pytest.raises(ArgumentError, match="window"):
            nd.attention(q, q, q, causal=causal, window=bad)
    # a window at least as long as the keys binds nowhere
    x = random(rng, (1, 2, 4, 8), "float32")
    compare(device, lambda a: nd.attention(a, a, a, causal=True, window=4), [x],
            expected=lambda a: _attention(a, a, a, 1 / math.sqrt(8), True, 4), kind="reduction")


@pytest.mark.parametrize("causal", [False, True])
def test_attention_views_of_a_cache_and_custom_scale(device, causal, rng):
    """k and v sliced out of a bigger cache along capacity; q permuted from (b, s, h, d)."""
    q = random(rng, (1, 5, 4, 16), "float32")
    cache_k = random(rng, (1, 2, 20, 16), "float32")
    cache_v = random(rng, (1, 2, 20, 16), "float32")
    views = [lambda t: t.transpose((0, 2, 1, 3)), lambda t: t[:, :, :12], lambda t: t[:, :, :12]]
    compare(device, lambda qq, kk, vv: nd.attention(qq, kk, vv, scale=0.3, causal=causal,
                                                    kv_len=9), [q, cache_k, cache_v],
            views=views, expected=lambda qq, kk, vv: _attention(qq, kk, vv, 0.3, causal, 9),
            kind="reduction")


def test_attention_extreme_scores(device, rng):
    """Large scores must not overflow: the row maximum is subtracted before exp."""
    q = random(rng, (1, 1, 4, 8), "float32", 10, 20)
    k = random(rng, (1, 1, 4, 8), "float32", 10, 20)
    v = random(rng, (1, 1, 4, 8), "float32")
    compare(device, lambda qq, kk, vv: nd.attention(qq, kk, vv, scale=10.0, causal=True),
            [q, k, v], expected=lambda qq, kk, vv: _attention(qq, kk, vv, 10.0, True, 4),
            kind="reduction")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("b,hq,hkv,s,d", [(2, 4, 2, 7, 16), (1, 8, 2, 40, 64)])
def test_attention_of_token_major_query_rows(device, dtype, b, hq, hkv, s, d, rng):
    """q as a prefill makes it: the query heads of a fused QKV projection's rows (b, s,
    hq + 2 hkv, d), viewed heads-first. Backends with ``token_major_attention`` read the
    rows as they are and return a heads-first view of a token-major output (so the
    output's permute back to (b, s, hq, d) is compact); every device gives the reference's
    numbers (the second shape is prefill-sized: CUDA's tensor-core kernel)."""
    if check_unsupported_dtype(device, dtype):
        return
    qkv = random(rng, (b, s, hq + 2 * hkv, d), dtype, -1, 1)
    k, v = random(rng, (b, hkv, s + 3, d), dtype, -1, 1), random(rng, (b, hkv, s + 3, d), dtype,
                                                                   -1, 1)
    rows = on(device, qkv)
    q = rows[:, :, :hq].permute((0, 2, 1, 3))
    got = nd.attention(q, on(device, k), on(device, v), causal=True, kv_len=s)
    want = _attention(qkv[:, :, :hq].transpose(0, 2, 1, 3).astype(np.float64),
                      k.astype(np.float64), v.astype(np.float64), 1 / math.sqrt(d), True, s)
    assert got.shape == (b, hq, s, d) and got.dtype == dtype
    err = np.abs(got.numpy().astype(np.float64) - want).max()
    assert err < (2e-2 if dtype == "bfloat16" else 1e-5), err
    if has(device.backend, "token_major_attention"):
        assert got.permute((0, 2, 1, 3)).is_compact()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("m,n,p", [(5, 8, 3), (130, 64, 136), (256, 128, 264)])
def test_matmul_swiglu_is_the_product_then_swiglu(device, dtype, m, n, p, rng):
    """swiglu(x @ wᵀ) for a fused gate/up weight (2p, n): the numbers of the product rounded
    to the dtype and then swiglu, on every device (CUDA's one-pass kernel for the larger
    bfloat16 shapes); a batch of rows keeps its leading axes."""
    if check_unsupported_dtype(device, dtype):
        return
    x = on(device, random(rng, (2, m, n), dtype, -1, 1))
    w = on(device, random(rng, (2 * p, n), dtype, -1, 1))
    got = nd.matmul_swiglu(x, w)
    want = (x @ w.transpose()).swiglu()
    assert got.shape == (2, m, p) and got.dtype == dtype
    np.testing.assert_allclose(got.numpy().astype(np.float64), want.numpy().astype(np.float64),
                               rtol=2e-2 if dtype == "bfloat16" else 1e-5,
                               atol=2e-2 if dtype == "bfloat16" else 1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("m,n,p", [(1, 1152, 6912), (1, 8, 3), (5, 64, 70)])
def test_matmul_geglu_is_the_product_then_geglu(device, dtype, m, n, p, rng):
    """Gemma's GeGLU of a fused gate/up product: the numbers of the product rounded to the
    dtype and then geglu, on every device (CUDA's one-pass kernel for one row: bitwise)."""
    if check_unsupported_dtype(device, dtype):
        return
    x = on(device, random(rng, (m, n), dtype, -1, 1))
    w = on(device, random(rng, (2 * p, n), dtype, -1, 1))
    got = nd.matmul_geglu(x, w)
    want = (x @ w.transpose()).geglu()
    assert got.shape == (m, p) and got.dtype == dtype
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    with pytest.raises(ShapeError, match="matmul_geglu"):
        nd.matmul_geglu(x, w[:-1])


def test_matmul_swiglu_checks_its_operands(device, rng):
    x = on(device, random(rng, (4, 8), "float32"))
    with pytest.raises(ShapeError, match="fused gate/up weight"):
        nd.matmul_swiglu(x, on(device, random(rng, (5, 8), "float32")))
    with pytest.raises(DTypeError, match="must be floating-point arrays of one dtype"):
        nd.matmul_swiglu(x, on(device, random(rng, (6, 8), "bfloat16")))
