"""The fused functions of a decode step: add_rmsnorm (residual add + pre-norm), swiglu (SwiGLU
of a fused gate-and-up projection) and attention_decode (RoPE, KV-cache write and attention
of one token at a position held in device memory).

Every result is checked against a float64 numpy computation written here, on every device
(the ``device`` fixture), for every float dtype the device has.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backends.api import has
from needle.errors import ArgumentError, ArgumentTypeError, DTypeError, ShapeError

from ..conftest import assert_close, assert_equal, check_unsupported_dtype, tolerance
from .compare import FLOATS, np_dtype, on, random


def _wide(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64)


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded to ``dtype`` and widened back."""
    return x.astype(np_dtype(dtype)).astype(np.float64)


# --- add_rmsnorm ----------------------------------------------------------------------------

def _add_rmsnorm(x, delta, w, eps, dtype):
    """(x + delta rounded to dtype, rmsnorm of that rounded sum * w) in float64."""
    total = _rounded(_wide(x) + _wide(delta), dtype)
    out = total / np.sqrt((total * total).mean(-1, keepdims=True) + eps) * _wide(w)
    return total, out


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 7), (3, 2048), (5, 4096)], ids=str)
@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
def test_add_rmsnorm(device, dtype, shape, inplace, rng):
    if check_unsupported_dtype(device, dtype):
        return
    x, delta = random(rng, shape, dtype, -3, 3), random(rng, shape, dtype, -1, 1)
    w = random(rng, shape[-1:], dtype, 0.5, 1.5)
    eps = 1e-6
    a = on(device, x)
    total, out = nd.add_rmsnorm(a, on(device, delta), on(device, w), eps, inplace=inplace)
    want_total, want_out = _add_rmsnorm(x, delta, w, eps, dtype)
    for r in (total, out):
        assert (r.shape, r.dtype, r.device) == (shape, dtype, device)
    assert_close(total, want_total, dtype)
    assert_close(out, want_out, dtype, "reduction")
    if inplace:
        assert total is a
    else:
        assert total is not a
        assert_equal(a, x)  # x untouched
    assert out is not total


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_add_rmsnorm_3d_and_eps(device, dtype, rng):
    if check_unsupported_dtype(device, dtype):
        return
    shape, eps = (2, 3, 64), 0.1
    x, delta = random(rng, shape, dtype, -3, 3), random(rng, shape, dtype, -1, 1)
    w = random(rng, (64,), dtype, 0.5, 1.5)
    a = on(device, x)
    total, out = nd.add_rmsnorm(a, on(device, delta), on(device, w), eps, inplace=True)
    want_total, want_out = _add_rmsnorm(x, delta, w, eps, dtype)
    assert total is a and total.shape == shape
    assert_close(a, want_total, dtype)
    assert_close(out, want_out, dtype, "reduction")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 7), (3, 1152), (2, 2, 2560), (2, 20000)], ids=str)
def test_add_rmsnorm_with_the_deltas_post_norm(device, dtype, shape, rng):
    """delta_weight (Gemma's sandwich norms): delta is rmsnorm(delta) * delta_weight,
    rounded to the dtype, before the add and the next norm; one pass gives what the two
    ops give (20,000 values: the streaming path of the GPUs' row kernels)."""
    if check_unsupported_dtype(device, dtype):
        return
    x, delta = random(rng, shape, dtype, -3, 3), random(rng, shape, dtype, -4, 4)
    w, dw = (random(rng, shape[-1:], dtype, 0.5, 1.5) for _ in range(2))
    eps = 1e-6
    d = _wide(delta)
    normed = _rounded(d / np.sqrt((d * d).mean(-1, keepdims=True) + eps) * _wide(dw), dtype)
    want_total, want_out = _add_rmsnorm(x, normed, w, eps, dtype)
    a = on(device, x)
    total, out = nd.add_rmsnorm(a, on(device, delta), on(device, w), eps, inplace=True,
                                delta_weight=on(device, dw))
    assert total is a and out.shape == shape and out.dtype == dtype
    # the normed delta may round the other way from float64's (float32 sums): one unit in
    # its last place, which x + delta's cancellation can make large beside the sum
    unit = np.finfo(np.float32 if dtype == "bfloat16" else np_dtype(dtype)).eps
    unit = 2.0 ** -7 if dtype == "bfloat16" else unit
    scale = np.abs(_wide(x)) + np.abs(normed)
    r = 1 / np.sqrt((want_total ** 2).mean(-1, keepdims=True) + eps)
    for got, want, size in ((total, want_total, scale), (out, want_out, scale * r * _wide(w))):
        err = np.abs(got.numpy().astype(np.float64) - want)
        assert (err <= 2 * unit * size + 1e-6).all(), f"worst {err.max()}"
    post = on(device, delta).rmsnorm(on(device, dw), eps)
    total2, out2 = nd.add_rmsnorm(on(device, x), post, on(device, w), eps)
    assert_close(total, total2.numpy(), dtype, "reduction")
    assert_close(out, out2.numpy(), dtype, "reduction")
    with pytest.raises(ShapeError, match="delta_weight"):
        nd.add_rmsnorm(a, on(device, delta), on(device, w), delta_weight=on(device, dw[:3]))


def test_add_rmsnorm_views_and_errors(device, rng):
    """A non-compact x works out of place (x untouched) but not in place; shapes, dtypes and
    the weight's length must match."""
    base = random(rng, (8, 5), "float32")
    delta = random(rng, (5, 8), "float32")
    w = random(rng, (8,), "float32", 0.5, 1.5)
    xv = on(device, base).transpose((1, 0))
    total, out = nd.add_rmsnorm(xv, on(device, delta), on(device, w))
    want_total, want_out = _add_rmsnorm(base.T, delta, w, 1e-6, "float32")
    assert_close(total, want_total, "float32")
    assert_close(out, want_out, "float32", "reduction")
    assert_equal(xv, base.T)
    with pytest.raises(ShapeError, match="compact"):
        nd.add_rmsnorm(xv, on(device, delta), on(device, w), inplace=True)
    with pytest.raises(ShapeError):
        nd.add_rmsnorm(on(device, delta), on(device, delta[:, :4]), on(device, w))
    with pytest.raises(DTypeError, match="dtype"):
        nd.add_rmsnorm(on(device, delta), on(device, delta.astype(np.float16)), on(device, w))
    with pytest.raises(ShapeError):
        nd.add_rmsnorm(on(device, delta), on(device, delta), on(device, w[:7]))
    ints = on(device, np.ones((2, 3), np.int32))
    with pytest.raises(DTypeError):
        nd.add_rmsnorm(ints, ints, on(device, np.ones(3, np.float32)))


# --- swiglu -----------------------------------------------------------------------------------

def _swiglu(x):
    h = x.shape[-1] // 2
    a = x[..., :h]
    return a / (1 + np.exp(-a)) * x[..., h:]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(2,), (1, 14), (3, 66), (2, 3, 256), (1, 2 * 4099)],
                         ids=str)
def test_swiglu(device, dtype, shape, rng):
    if check_unsupported_dtype(device, dtype):
        return
    x = random(rng, shape, dtype, -6, 6)
    got = on(device, x).swiglu()
    assert (got.shape, got.dtype, got.device) == (shape[:-1] + (shape[-1] // 2,), dtype, device)
    assert_close(got, _swiglu(_wide(x)), dtype)


def test_swiglu_views_and_errors(device, rng):
    x = random(rng, (10, 6), "float32")
    v = on(device, x).transpose((1, 0))  # (6, 10): rows of a non-compact view
    assert_close(v.swiglu(), _swiglu(_wide(x.T)), "float32")
    big = np.concatenate([random(rng, (3, 500), "float32", -20, 20),  # saturating gates
                          random(rng, (3, 500), "float32")], axis=1)
    assert_close(on(device, big).swiglu(), _swiglu(_wide(big)), "float32")
    with pytest.raises(ShapeError, match="even"):
        on(device, random(rng, (2, 7), "float32")).swiglu()
    with pytest.raises(DTypeError):
        on(device, np.ones((2, 4), np.int32)).swiglu()


# --- geglu ------------------------------------------------------------------------------------

def _geglu(x):
    """float64 GeGLU: PyTorch's gelu(approximate="tanh") of the gate half times the up half."""
    h = x.shape[-1] // 2
    a = x[..., :h]
    return 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a ** 3))) * x[..., h:]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(2,), (1, 14), (3, 66), (2, 3, 256), (1, 2 * 4099)],
                         ids=str)
def test_geglu(device, dtype, shape, rng):
    if check_unsupported_dtype(device, dtype):
        return
    x = random(rng, shape, dtype, -6, 6)
    got = on(device, x).geglu()
    assert (got.shape, got.dtype, got.device) == (shape[:-1] + (shape[-1] // 2,), dtype, device)
    assert_close(got, _geglu(_wide(x)), dtype)


def test_geglu_matches_torch_and_checks_its_input(device, rng):
    import torch  # the dev install's (README): its absence fails here
    x = np.concatenate([random(rng, (3, 500), "float32", -12, 12),  # tails of both signs
                        random(rng, (3, 500), "float32")], axis=1)
    t = torch.as_tensor(x)
    expected = torch.nn.functional.gelu(t[:, :500], approximate="tanh") * t[:, 500:]
    assert_close(on(device, x).geglu(), expected.numpy().astype(np.float64), "float32")
    v = on(device, x).transpose((1, 0)).transpose((1, 0))[:, 250:750]  # a strided view
    assert_close(v.geglu(), _geglu(_wide(x[:, 250:750])), "float32")
    with pytest.raises(ShapeError, match="even"):
        on(device, random(rng, (2, 7), "float32")).geglu()
    with pytest.raises(DTypeError):
        on(device, np.ones((2, 4), np.int32)).geglu()


# --- attention_decode --------------------------------------------------------------------------

def _rope_tables(rows, head_dim, base=10000.0):
    inv = base ** (-np.arange(0, head_dim, 2) / head_dim)
    ang = np.arange(rows)[:, None] * inv[None, :]
    return np.cos(ang), np.sin(ang)


class DecodeState:
    """One decode session: rotary tables and K/V caches on the device, and the same in numpy
    (float64 copies of dtype-rounded values) updated by a float64 reference step."""

    def __init__(self, device, dtype, q_heads, kv_heads, head_dim, capacity, rng,
                 table_rows=None, scale=None):
        self.device, self.dtype, self.rng = device, dtype, rng
        self.q_heads, self.kv_heads, self.d, self.capacity = q_heads, kv_heads, head_dim, capacity
        self.table_rows = capacity + 3 if table_rows is None else table_rows
        self.scale = scale
        cos, sin = _rope_tables(self.table_rows, head_dim)
        self.cos, self.sin = (t.astype(np_dtype(dtype)) for t in (cos, sin))
        shape = (kv_heads, capacity, head_dim)
        # earlier tokens: the cache holds random history before the steps under test
        self.keys = random(rng, shape, dtype, -1, 1)
        self.values = random(rng, shape, dtype, -1, 1)
        self.k_dev, self.v_dev = on(device, self.keys), on(device, self.values)
        self.cos_dev, self.sin_dev = on(device, self.cos), on(device, self.sin)
        self.pos_dev = nd.array(np.zeros(1, np.int32), device=device, dtype="int32")

    def qkv(self) -> np.ndarray:
        return random(self.rng, ((self.q_heads + 2 * self.kv_heads) * self.d,), self.dtype,
                      -1, 1)

    def run(self, qkv: np.ndarray, p: int, max_positions: int | None = None,
            window: int | None = None, softcap: float | None = None) -> nd.NDArray:
        """The device step at position p (written into the position array on the device),
        its kernel chosen for ``max_positions`` where the backend chooses by it."""
        self.pos_dev.fill(p)
        return nd.attention_decode(on(self.device, qkv), self.cos_dev, self.sin_dev,
                                   self.pos_dev, self.k_dev, self.v_dev, self.q_heads,
                                   self.scale, max_positions, window, softcap)

    def expected(self, qkv: np.ndarray, p: int, window: int | None = None,
                 softcap: float | None = None) -> np.ndarray:
        """The float64 step: updates the numpy caches and returns the output (attending to
        positions p - window + 1..p with a window; scores soft-capped with a softcap)."""
        hq, hkv, d, h = self.q_heads, self.kv_heads, self.d, self.d // 2
        v = _wide(qkv).reshape(hq + 2 * hkv, d)
        c, s = _wide(self.cos[p]), _wide(self.sin[p])
        x1, x2 = v[:hq + hkv, :h], v[:hq + hkv, h:]
        roped = _rounded(np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=1),
                         self.dtype)
        self.keys[:, p] = roped[hq:].astype(self.keys.dtype)
        self.values[:, p] = v[hq + hkv:].astype(self.values.dtype)
        group = hq // hkv
        lo = max(0, p - window + 1) if window else 0
        k = np.repeat(_wide(self.keys[:, lo:p + 1]), group, axis=0)  # (hq, p + 1 - lo, d)
        vv = np.repeat(_wide(self.values[:, lo:p + 1]), group, axis=0)
        scale = 1 / math.sqrt(d) if self.scale is None else self.scale
        scores = np.einsum("hd,htd->ht", roped[:hq], k) * scale
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        e = np.exp(scores - scores.max(axis=1, keepdims=True))
        return np.einsum("ht,htd->hd", e / e.sum(axis=1, keepdims=True), vv).reshape(-1)

    def check_caches(self, p: int | None) -> None:
        """Row p of the key cache within rounding of the reference (the rope is computed in
        the compute type), every other row and the whole value cache exactly. The reference
        then takes the device's row p, so later steps see the same history."""
        k, v = self.k_dev.numpy(), self.v_dev.numpy()
        assert_equal(v, self.values)
        if p is not None:
            assert_close(k[:, p], _wide(self.keys[:, p]), self.dtype)
            self.keys[:, p] = k[:, p]
            k, want = np.delete(k, p, axis=1), np.delete(self.keys, p, axis=1)
        else:
            want = self.keys
        assert_equal(k, want)


DECODE_CASES = {
    # name: (q_heads, kv_heads, head_dim, capacity, positions run one after another, scale)
    "mha_d8_cap1": (2, 2, 8, 1, [0], None),
    "gqa4_d64_cap5": (8, 2, 64, 5, [0, 1, 2, 4], None),
    "group7_d128_cap100": (7, 1, 128, 100, [0, 63, 64, 65, 99], None),
    "gqa4_d64_cap300": (8, 2, 64, 300, [63, 64, 150, 151, 299], 0.3),
    "mha_d128_cap300": (4, 4, 128, 300, [0, 1, 127, 128, 298, 299], None),
    "group7_d8_cap300": (14, 2, 8, 300, [5, 6, 191, 192, 299], None),
}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_attention_decode(device, dtype, case, rng):
    if check_unsupported_dtype(device, dtype):
        return
    hq, hkv, d, cap, positions, scale = DECODE_CASES[case]
    st = DecodeState(device, dtype, hq, hkv, d, cap, rng, scale=scale)
    for p in positions:  # consecutive steps on one cache, as decoding runs them
        qkv = st.qkv()
        got = st.run(qkv, p)
        assert (got.shape, got.dtype, got.device) == ((hq * d,), dtype, device)
        want = st.expected(qkv, p)
        assert_close(got, want, dtype, "reduction")
        st.check_caches(p)


def test_attention_decode_long_cache(device, rng):
    """A cache long enough for chunks of more than 64 positions on the GPUs (capacity 20000:
    157 chunks of 128), with steps on both sides of a chunk boundary and at the end."""
    st = DecodeState(device, "float32", 2, 1, 8, 20000, rng)
    for p in (127, 128, 19999):
        qkv = st.qkv()
        assert_close(st.run(qkv, p), st.expected(qkv, p), "float32", "reduction")
        st.check_caches(p)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_decode_long_cache_grouped(device, dtype, rng):
    """Llama shapes far into a cache: 8 query heads per KV head of size 64, capacity 9000
    (CUDA: 32 ranges of up to 282 positions, each walked in tiles of 64 with an online
    softmax, merged by the last group), before, at and after tile boundaries."""
    if check_unsupported_dtype(device, dtype):
        return
    st = DecodeState(device, dtype, 16, 2, 64, 9000, rng)
    for p in (64, 2047, 2048, 8999):
        qkv = st.qkv()
        assert_close(st.run(qkv, p), st.expected(qkv, p), dtype, "reduction")
        st.check_caches(p)


# name: (q_heads, kv_heads, head_dim, capacity, window, positions); head sizes of each CUDA
# kernel (64 / 128: flash or tensor-core ranges, the cluster kernel at short caches; 256 and
# 96: the split kernel of 128-position chunks), windows shorter than a tile, than a chunk, and
# over many of either, positions before, at and past the window's length
WINDOW_CASES = {
    "gemma3_d256_w5": (4, 1, 256, 40, 5, [0, 3, 4, 5, 6, 39]),
    "gemma3_d256_w512": (8, 2, 256, 1500, 512, [100, 511, 512, 513, 640, 1499]),
    "phi3_d96_w200": (8, 8, 96, 700, 200, [199, 200, 256, 385, 699]),
    "mistral_d128_w300": (8, 2, 128, 2100, 300, [299, 300, 301, 1000, 2099]),
    "d64_w70_long": (16, 2, 64, 9000, 70, [69, 70, 2047, 2048, 8999]),
    "d64_w2500": (8, 2, 64, 4000, 2500, [2499, 2500, 3999]),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_attention_decode_sliding_window(device, dtype, case, rng):
    """A sliding window: the step at p attends to p - window + 1..p only (the cache before
    it holds random history, which must not count), with the bound of each band too."""
    if check_unsupported_dtype(device, dtype):
        return
    hq, hkv, d, cap, window, positions = WINDOW_CASES[case]
    st = DecodeState(device, dtype, hq, hkv, d, cap, rng)
    for p in positions:
        for bound in (None, min(cap, 2048)) if cap > 2048 else (None,):
            if bound is not None and p >= bound:
                continue
            qkv = st.qkv()
            got = st.run(qkv, p, bound, window)
            assert_close(got, st.expected(qkv, p, window), dtype, "reduction")
            st.check_caches(p)


# name: (q_heads, kv_heads, head_dim, capacity, window, positions); Gemma 2's shapes (2B:
# 8/4 heads of 256, windows of 4096 on every other layer) and each CUDA kernel's head sizes
# (64 and 128: the warp-per-head flash kernel, which soft-capped scores take instead of the
# tensor-core one; 96: the split kernel)
SOFTCAP_CASES = {
    "gemma2_d256": (8, 4, 256, 300, None, [0, 5, 64, 299]),
    "gemma2_d256_w70": (8, 4, 256, 300, 70, [69, 70, 71, 299]),
    "d64_long": (8, 2, 64, 3000, None, [63, 64, 1000, 2999]),
    "d128": (16, 8, 128, 200, None, [0, 127, 128, 199]),
    "d96_w50": (4, 2, 96, 400, 50, [10, 49, 50, 399]),
}


@pytest.mark.parametrize("case,dtype", [(c, dt) for c in SOFTCAP_CASES for dt in (
    "float32", "bfloat16", *(("float64",) if SOFTCAP_CASES[c][2] < 256 else ()))])
def test_attention_decode_soft_capped(device, dtype, case, rng):
    """Gemma 2's soft-capped scores (cap · tanh(s / cap) after the scale, before the
    softmax) against the float64 step, with a scale and cap for which the cap binds: the
    same steps uncapped are further from the capped reference than the tolerance (float64
    below 256-wide heads, whose chunks CUDA's split kernel cannot hold in float64)."""
    if check_unsupported_dtype(device, dtype):
        return
    hq, hkv, d, cap, window, positions = SOFTCAP_CASES[case]
    st = DecodeState(device, dtype, hq, hkv, d, cap, rng, scale=1.0)
    for p in positions:
        qkv = st.qkv()
        keys, values = st.keys.copy(), st.values.copy()
        got = st.run(qkv, p, None, window, 1.5)
        want = st.expected(qkv, p, window, 1.5)
        assert_close(got, want, dtype, "reduction")
        st.check_caches(p)
        if p > 8:  # enough positions for the cap to change the weights
            st.keys, st.values = keys, values
            uncapped = st.expected(qkv, p, window)
            assert np.abs(uncapped - want).max() > 3 * tolerance(dtype, "reduction")
            st.keys[:, p] = st.k_dev.numpy()[:, p]


def test_attention_decode_window_errors(device, rng):
    st = DecodeState(device, "float32", 2, 1, 8, 10, rng)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ArgumentError, match="window"):
            st.run(st.qkv(), 3, None, bad)
    for bad in (0, -1.5, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ArgumentError, match="softcap"):
            st.run(st.qkv(), 3, None, None, bad)
    # a window at least the cache's length binds nowhere: the plain step's numbers
    qkv = st.qkv()
    assert_close(st.run(qkv, 9, None, 10), st.expected(qkv, 9), "float32", "reduction")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_attention_decode_position_out_of_range(device, dtype, rng):
    """p = capacity, p = -1 and p >= the tables' rows give NaN and leave the caches as they
    were; a valid step after them works."""
    if check_unsupported_dtype(device, dtype):
        return
    st = DecodeState(device, dtype, 4, 2, 16, 10, rng, table_rows=8)
    for p in (10, -1, 8, 9, 2**31 - 1):
        got = st.run(st.qkv(), p)
        assert np.isnan(got.numpy().astype(np.float32)).all(), f"position {p}"
        st.check_caches(None)
    qkv = st.qkv()
    assert_close(st.run(qkv, 7), st.expected(qkv, 7), dtype, "reduction")
    st.check_caches(7)


def test_attention_decode_position_array_and_views(device, rng):
    """Only the first element of the position array counts; qkv may be any shape (or a
    non-compact view) of the right size, and float32 tables are cast to qkv's dtype."""
    st = DecodeState(device, "float32", 4, 2, 16, 12, rng)
    qkv = st.qkv()
    pos = nd.array(np.array([5, 99, -1], np.int32), device=device, dtype="int32")
    view = on(device, qkv.reshape(16, 8).T.copy()).transpose((1, 0))  # non-compact (16, 8)
    got = nd.attention_decode(view, st.cos_dev, st.sin_dev, pos, st.k_dev, st.v_dev, 4)
    assert_close(got, st.expected(qkv, 5), "float32", "reduction")
    st.check_caches(5)
    if check_unsupported_dtype(device, "float16"):
        return
    sh = DecodeState(device, "float16", 2, 1, 8, 6, rng)
    qkv = sh.qkv()
    cos32 = on(device, sh.cos.astype(np.float32))
    sin32 = on(device, sh.sin.astype(np.float32))
    sh.pos_dev.fill(3)
    got = nd.attention_decode(on(device, qkv), cos32, sin32, sh.pos_dev, sh.k_dev, sh.v_dev, 2)
    assert_close(got, sh.expected(qkv, 3), "float16", "reduction")
    sh.check_caches(3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_decode_bound_picks_no_numbers(device, dtype, rng):
    """``max_positions`` only picks a kernel: steps with bounds below, at and above p + 1
    (1, a band's bound, the capacity) all match the float64 step; the bands end at the
    capacity, and a backend without the capability has one."""
    if check_unsupported_dtype(device, dtype):
        return
    st = DecodeState(device, dtype, 16, 2, 64, 1300, rng)
    bands = nd.attention_decode_bands(st.k_dev, 16)
    assert bands[-1] == 1300 and list(bands) == sorted(set(bands))
    if not has(device.backend, "decode_bands"):
        assert bands == (1300,)
    for p, bound in ((0, 1), (200, 1300), (700, 1024), (1100, 1024), (1299, 1)):
        qkv = st.qkv()
        assert_close(st.run(qkv, p, bound), st.expected(qkv, p), dtype, "reduction")
        st.check_caches(p)


def test_attention_decode_bad_input(device, rng):
    hq, hkv, d, cap = 4, 2, 8, 6

    def f32(shape):
        return nd.array(random(rng, shape, "float32"), device=device, dtype="float32")

    qkv, keys, values = f32(((hq + 2 * hkv) * d,)), f32((hkv, cap, d)), f32((hkv, cap, d))
    cos, sin = f32((10, d // 2)), f32((10, d // 2))
    pos = nd.array(np.array([1], np.int32), device=device, dtype="int32")

    def call(**kw):
        args = dict(qkv=qkv, cos=cos, sin=sin, position=pos, keys=keys, values=values,
                    q_heads=hq)
        args.update(kw)
        return nd.attention_decode(**args)

    call()  # the valid call
    call(max_positions=cap)
    for bad in (0, cap + 1, 2.0, True, "6"):
        with pytest.raises(ArgumentError, match="max_positions"):
            call(max_positions=bad)
    with pytest.raises(ArgumentTypeError, match="cache"):
        nd.attention_decode_bands(qkv, hq)
    for heads in (3, 0, 2.0):
        with pytest.raises(ShapeError, match="query heads"):
            nd.attention_decode_bands(keys, heads)
    with pytest.raises(ShapeError, match="qkv"):
        call(qkv=f32(((hq + 2 * hkv) * d + 1,)))
    with pytest.raises(ShapeError):
        call(q_heads=3)  # not a multiple of the 2 KV heads
    with pytest.raises(ShapeError):
        call(cos=f32((10, d)))  # cos of the wrong width
    with pytest.raises(ShapeError):
        call(sin=f32((9, d // 2)))  # sin unlike cos
    with pytest.raises(ShapeError):
        call(values=f32((hkv, cap + 1, d)))
    with pytest.raises(DTypeError, match="position"):
        call(position=nd.array(np.array([1], np.int64), device=device, dtype="int64"))
    with pytest.raises(DTypeError):
        call(position=nd.array(np.array([1.0], np.float32), device=device, dtype="float32"))
    if not check_unsupported_dtype(device, "float16"):
        half = nd.array(random(rng, (hkv, cap, d), "float16"), device=device, dtype="float16")
        with pytest.raises(DTypeError, match="cache"):
            call(keys=half, values=half)
        with pytest.raises(DTypeError):
            call(values=half)
    with pytest.raises(DTypeError):
        ints = nd.array(np.ones(((hq + 2 * hkv) * d,), np.int32), device=device, dtype="int32")
        call(qkv=ints)


# --- qk_rmsnorm ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("tokens,hq,hkv,d", [(1, 16, 8, 128), (3, 4, 1, 256), (5, 6, 2, 40),
                                             (1, 2, 2, 8)], ids=str)
def test_qk_rmsnorm(device, dtype, tokens, hq, hkv, d, rng):
    """Every query head normed with q_weight, every key head with k_weight (rmsnorm's
    numbers), the value heads bit for bit, for one token (a decode step) or several."""
    if check_unsupported_dtype(device, dtype):
        return
    x = random(rng, (tokens, (hq + 2 * hkv) * d), dtype, -3, 3)
    qw, kw = random(rng, (d,), dtype, 0.5, 1.5), random(rng, (d,), dtype, 0.5, 1.5)
    got = nd.qk_rmsnorm(on(device, x), on(device, qw), on(device, kw), hq, hkv, 1e-6)
    assert (got.shape, got.dtype) == (x.shape, dtype)
    heads = _wide(x).reshape(tokens, hq + 2 * hkv, d)
    normed = heads / np.sqrt((heads ** 2).mean(axis=2, keepdims=True) + 1e-6)
    want = heads.copy()
    want[:, :hq] = normed[:, :hq] * _wide(qw)
    want[:, hq:hq + hkv] = normed[:, hq:hq + hkv] * _wide(kw)
    g = got.numpy().reshape(tokens, hq + 2 * hkv, d)
    assert_close(g[:, :hq + hkv], want[:, :hq + hkv], dtype)
    assert_equal(g[:, hq + hkv:], x.reshape(tokens, hq + 2 * hkv, d)[:, hq + hkv:])
    # rmsnorm's numbers on the heads (the composed form it replaces; sums in another order)
    rows = on(device, x).reshape((tokens, hq + 2 * hkv, d))
    assert_close(g[:, :hq], _wide(rows[:, :hq].rmsnorm(on(device, qw), 1e-6).numpy()), dtype)


def test_qk_rmsnorm_errors(device, rng):
    x = on(device, random(rng, (2, 40), "float32"))
    w = on(device, np.ones(8, np.float32))
    with pytest.raises(ShapeError, match="heads"):
        nd.qk_rmsnorm(x, w, w, 2, 2, 1e-6)  # 6 heads do not divide 40 values
    with pytest.raises(ShapeError, match="weights"):
        nd.qk_rmsnorm(x, on(device, np.ones(4, np.float32)), w, 3, 1, 1e-6)
    for bad in ("3", 0, 2.0):
        with pytest.raises(ShapeError, match="positive ints"):
            nd.qk_rmsnorm(x, w, w, bad, 1, 1e-6)
    with pytest.raises(DTypeError):
        ints = on(device, np.ones((1, 40), np.int32))
        nd.qk_rmsnorm(ints, w, w, 3, 1, 1e-6)
