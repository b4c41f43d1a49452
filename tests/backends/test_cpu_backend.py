"""The native CPU backend's own paths, called directly on its buffers.

The conformance suite (tests/backend_ndarray) runs the array API through NDArray on every
device; these tests cover what it does not reach: the build itself, bit-exact fp16/bf16 and
cast rounding for every dtype pair, each matmul path (packed GEMM, its edge tiles, the
thread team, transposes, broadcast batches, the m == 1 path), the multi-threaded paths of
large sizes, zero-copy wrap/host_view, and the errors the backend raises itself.
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backends import numpy_ref as ref
from needle.backends.api import missing_functions
from needle.errors import DeviceError, DTypeError, IndexOutOfRangeError, ShapeError

cpu_device = nd.cpu()
pytestmark = pytest.mark.skipif(not cpu_device.enabled(),
                                reason=f"cpu disabled: {cpu_device.reason}")

DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "bool")
FLOATS = ("float32", "float16", "bfloat16", "float64")
BF16 = np.dtype(ml_dtypes.bfloat16)
ODD_SIZES = (1, 7, 33, 1000003)


@pytest.fixture(scope="module")
def be():
    return cpu_device.backend


def put(backend, x: np.ndarray, dtype: str):
    """A buffer of ``backend`` holding ``x`` converted to ``dtype``."""
    a = backend.Array(x.size, dtype)
    backend.from_numpy(x.reshape(-1), a)
    return a


def values(backend, a) -> np.ndarray:
    return np.array(backend.host_view(a) if backend is not ref else a.array)


def both(fn: str, inputs, outputs, *args, **kwargs) -> tuple[list, list]:
    """Run ``fn`` on the cpu backend and the reference with the same inputs: the outputs."""
    results = []
    for backend in (cpu_device.backend, ref):
        ins = [put(backend, x, dt) for x, dt in inputs]
        outs = [backend.Array(n, dt) for n, dt in outputs]
        getattr(backend, fn)(*ins, *outs, *args, **kwargs)
        results.append([values(backend, o) for o in outs])
    return results[0], results[1]


def both_scalar(fn: str, x: np.ndarray, dtype: str, value, out_dtype: str) -> tuple:
    """Like ``both`` for the ``scalar_*`` functions, whose scalar comes before ``out``."""
    results = []
    for backend in (cpu_device.backend, ref):
        out = backend.Array(x.size, out_dtype)
        getattr(backend, fn)(put(backend, x, dtype), value, out)
        results.append(values(backend, out))
    return results[0], results[1]


def bits(x: np.ndarray) -> np.ndarray:
    """The raw bits (to compare NaN payloads and signed zeros exactly)."""
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.itemsize])


def close(got, want, rtol, atol=0.0):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)


# --- the build ---------------------------------------------------------------------------------

def test_extension_implements_the_whole_array_api(be):
    assert be.name == "cpu"
    assert not missing_functions(be), f"cpu backend lacks {missing_functions(be)}"
    names = set(be.kernels())
    for name in ("ewise_add_f32", "scalar_lt_bf16", "ewise_exp_f16", "reduce_argmax_b8",
                 "matmul_i64", "cast_f64_f16", "cast_b8_bf16", "attention_bf16", "where_f64"):
        assert name in names, name
    assert "ewise_exp_i32" not in names  # integer transcendentals are cast by NDArray first


def test_load_says_how_to_build_when_the_extension_is_missing(monkeypatch):
    from needle.backends import cpu as package

    monkeypatch.delattr(package, "_cpu", raising=False)
    monkeypatch.setitem(sys.modules, "needle.backends.cpu._cpu", None)
    with pytest.raises(DeviceError, match="pip install -e ."):
        package.load()
    with pytest.raises(DeviceError, match="only index 0"):
        package.load(1)


def test_buffers_are_aligned_and_typed(be):
    for dtype in DTYPES:
        a = be.Array(37, dtype)
        assert a.size == 37 and a.dtype == dtype and a.ptr % 64 == 0
        assert be.host_view(a).dtype == nd.dtypes.to_numpy_dtype(dtype)
    assert be.Array(0, "float32").size == 0
    with pytest.raises(DTypeError, match="unknown dtype"):
        be.Array(3, "complex64")
    with pytest.raises(ShapeError):
        be.Array(-1, "float32")


# --- zero-copy exchange ------------------------------------------------------------------------

def test_wrap_and_host_view_alias_the_same_memory(be):
    flat = np.arange(10, dtype=np.float32)
    a = be.wrap(flat, "float32")
    assert a.ptr == flat.ctypes.data and a.size == 10
    be.scalar_setitem(3, 7.0, a, (3,), (2,), 1)  # writes through to the numpy array
    assert flat.tolist() == [0, 7, 2, 7, 4, 7, 6, 7, 8, 9]
    view = be.host_view(a)
    view[0] = -1
    out = be.Array(10, "float32")
    be.compact(a, out, (10,), (1,), 0)
    assert be.host_view(out)[0] == -1
    del flat, view  # the Array keeps the wrapped array alive
    assert be.to_numpy(a, (2,), (1,), 0).tolist() == [-1, 7]


def test_host_view_keeps_its_buffer_alive(be):
    a = put(be, np.arange(5.0), "bfloat16")
    view = be.host_view(a)
    assert view.dtype == BF16
    del a
    assert view.astype(np.float32).tolist() == [0, 1, 2, 3, 4]


def test_wrap_rejects_mismatched_memory(be):
    with pytest.raises(DTypeError):
        be.wrap(np.zeros(4, np.float64), "float32")
    with pytest.raises(DTypeError):
        be.wrap(np.zeros(8, np.float32)[::2], "float32")


# --- casts and fp16/bf16 rounding ----------------------------------------------------------------

def _edge_values() -> np.ndarray:
    specials = [0.0, -0.0, 1.0, -1.0, 0.5, 1.5, 2.5, -2.5, 65504.0, 65519.0, 65520.0, 1e5,
                3.0e38, -3.4e38, 1e-8, 6e-8, 5.9604645e-08, 2.98e-08, 1e-40, -1e-45,
                2.0**31, -(2.0**31), 2.0**31 - 128, 2.0**63, 1e19, -1e19, 2.0**24 + 1,
                np.inf, -np.inf, np.nan, 1 + 2.0**-8, 1 + 3 * 2.0**-9, 1 + 2.0**-11,
                1 + 2.0**-11 + 2.0**-30, 255.5, -7.9, 7.9]
    rng = np.random.default_rng(1)
    return np.concatenate([specials, rng.standard_normal(200) * 1e3,
                           np.round(rng.standard_normal(100) * 100)])


@pytest.mark.parametrize("src", DTYPES)
def test_cast_between_every_pair_of_dtypes_matches_numpy(be, src):
    x = _edge_values()
    with np.errstate(all="ignore"):
        x = x.astype(nd.dtypes.to_numpy_dtype(src))
    for dst in DTYPES:
        got, want = both("ewise_cast", [(x, src)], [(x.size, dst)])
        g, w = got[0], want[0]
        if dst in FLOATS:
            nan = np.isnan(w.astype(np.float64))
            np.testing.assert_array_equal(np.isnan(g.astype(np.float64)), nan)
            np.testing.assert_array_equal(bits(g)[~nan], bits(w)[~nan], err_msg=f"{src}->{dst}")
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{src}->{dst}")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
def test_float32_to_half_rounds_like_numpy_for_every_kind_of_bit_pattern(be):
    rng = np.random.default_rng(2)
    patterns = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    # make sure ties, the subnormal range and NaN payloads are well represented
    ties = (rng.integers(0, 2**19, size=20_000, dtype=np.uint32) << 13) | 0x1000
    tops = np.arange(0, 2**16, dtype=np.uint32) << 16
    patterns = np.concatenate([patterns, ties, ties | 0x7F800000, tops]).astype(np.uint32)
    x = patterns.view(np.float32)
    for dst, npdt in (("float16", np.float16), ("bfloat16", BF16)):
        out = be.Array(x.size, dst)
        be.ewise_cast(be.wrap(x, "float32"), out)
        np.testing.assert_array_equal(bits(be.host_view(out)), bits(x.astype(npdt)), err_msg=dst)


def test_every_half_widens_exactly(be):
    h = np.arange(2**16, dtype=np.uint16)
    for src, npdt in (("float16", np.float16), ("bfloat16", BF16)):
        out = be.Array(h.size, "float32")
        be.ewise_cast(be.wrap(h.view(npdt), src), out)
        want = h.view(npdt).astype(np.float32)
        np.testing.assert_array_equal(bits(be.host_view(out)), bits(want))


def test_half_arithmetic_rounds_once_from_float32(be):
    rng = np.random.default_rng(3)
    for dtype in ("float16", "bfloat16"):
        x = rng.standard_normal(4097).astype(nd.dtypes.to_numpy_dtype(dtype))
        y = rng.standard_normal(4097).astype(nd.dtypes.to_numpy_dtype(dtype))
        for op in ("add", "mul", "div"):
            got, want = both("ewise_" + op, [(x, dtype), (y, dtype)], [(x.size, dtype)])
            np.testing.assert_array_equal(bits(got[0]), bits(want[0]), err_msg=f"{op} {dtype}")


# --- elementwise: integer semantics, special values, large sizes ---------------------------------

def test_integer_division_truncates_and_division_by_zero_gives_zero(be):
    for dtype, lo in (("int32", -(2**31)), ("int64", -(2**63))):
        x = np.array([7, -7, 7, -7, 5, -5, lo, lo, 0, 9], dtype=dtype)
        y = np.array([2, 2, -2, -2, 0, 0, -1, 1, -3, 3], dtype=dtype)
        got, want = both("ewise_div", [(x, dtype), (y, dtype)], [(x.size, dtype)])
        np.testing.assert_array_equal(got[0], want[0])
        assert got[0].tolist()[:6] == [3, -3, -3, 3, 0, 0]


def test_integer_power_and_overflow_wrap_like_numpy(be):
    x = np.array([2, -3, 7, 0, 2**30, -(2**31)], dtype=np.int32)
    y = np.array([31, 3, -1, 0, 2, 1], dtype=np.int32)
    for op in ("power", "add", "mul", "sub"):
        got, want = both("ewise_" + op, [(x, "int32"), (y, "int32")], [(x.size, "int32")])
        np.testing.assert_array_equal(got[0], want[0], err_msg=op)
    got, want = both("ewise_abs", [(x, "int32")], [(x.size, "int32")])
    np.testing.assert_array_equal(got[0], want[0])


def test_special_values_follow_numpy(be):
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, 88.8, -104.0, -87.5, 1e30, -1e30,
                  0.6, -0.6, 20.0, -20.0], dtype=np.float32)
    y = np.roll(x, 3)
    for op in ("maximum", "minimum", "div", "power", "eq", "lt"):
        out_dtype = "bool" if op in ("eq", "lt") else "float32"
        got, want = both("ewise_" + op, [(x, "float32"), (y, "float32")], [(x.size, out_dtype)])
        close(got[0], want[0], rtol=1e-6)
    for op in ("exp", "log", "sqrt", "tanh", "sigmoid", "relu", "silu", "gelu", "abs", "neg"):
        got, want = both("ewise_" + op, [(x, "float32")], [(x.size, "float32")])
        # sigmoid = 1 / (1 + exp(-x)) keeps values below 1e-7 that the reference's
        # 0.5 * (tanh(x / 2) + 1) rounds to 0; both are within float32's absolute precision.
        close(got[0], want[0], rtol=2e-6, atol=1e-7 if op in ("sigmoid", "silu") else 1e-37)


@pytest.mark.parametrize("op", ["exp", "log", "tanh", "sigmoid"])
def test_vectorized_float32_math_is_accurate_over_its_range(be, op):
    rng = np.random.default_rng(4)
    lo, hi = {"exp": (-103, 88.7), "log": (-40, 38), "tanh": (-12, 12), "sigmoid": (-30, 30)}[op]
    x = rng.uniform(lo, hi, 200_000)
    if op == "log":
        x = 10.0**x
    x = x.astype(np.float32)
    truth = {"exp": np.exp, "log": np.log, "tanh": np.tanh,
             "sigmoid": lambda v: 1 / (1 + np.exp(-v))}[op](x.astype(np.float64))
    out = be.Array(x.size, "float32")
    getattr(be, "ewise_" + op)(be.wrap(x, "float32"), out)
    got = be.host_view(out).astype(np.float64)
    tiny = np.finfo(np.float32).tiny
    err = np.abs(got - truth) / np.maximum(np.abs(truth), tiny)
    assert err.max() < 3e-7, (op, x[np.argmax(err)], got[np.argmax(err)], truth[np.argmax(err)])


@pytest.mark.parametrize("n", ODD_SIZES)
def test_elementwise_at_odd_and_large_sizes(be, n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    got, want = both("ewise_add", [(x, "float32"), (y, "float32")], [(n, "float32")])
    np.testing.assert_array_equal(got[0], want[0])
    got, want = both_scalar("scalar_ge", x, "float32", 0.25, "bool")
    np.testing.assert_array_equal(got, want)
    got, want = both("ewise_exp", [(x, "bfloat16")], [(n, "bfloat16")])
    close(got[0], want[0], rtol=8e-3)
    cond = x > 0
    got, want = both("where", [(cond, "bool"), (x, "float16"), (y, "float16")], [(n, "float16")])
    np.testing.assert_array_equal(bits(got[0]), bits(want[0]))


def test_scalar_operands_convert_like_numpy(be):
    x = np.array([1, -2, 3], dtype=np.int32)
    got, want = both_scalar("scalar_mul", x, "int32", np.int64(3), "int32")
    np.testing.assert_array_equal(got, want)
    got, want = both_scalar("scalar_add", x.astype(np.float16), "float16", 0.1, "float16")
    np.testing.assert_array_equal(bits(got), bits(want))
    got, want = both_scalar("scalar_power", x, "int32", -1, "int32")
    np.testing.assert_array_equal(got, want)
    a = be.Array(3, "int32")
    with pytest.raises(OverflowError):
        be.fill(a, 2**40)
    be.fill(a, 2.9)
    assert be.host_view(a).tolist() == [2, 2, 2]
    b = be.Array(2, "bool")
    be.fill(b, 0.5)
    assert be.host_view(b).tolist() == [True, True]


# --- reductions --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1000003, 1), (3, 300001, 1), (1, 4096, 1000), (5, 33, 7),
                                   (2, 1, 9), (1, 131072 * 3 + 5, 1)])
def test_reductions_match_the_reference(be, dtype, shape):
    outer, size, inner = shape
    rng = np.random.default_rng(5)
    x = rng.standard_normal(outer * size * inner) * 4
    if dtype == "bool":
        x = x > 1
    elif dtype in ("int32", "int64"):
        x = np.round(x)
    for op in ("sum", "max", "min", "argmax"):
        if dtype == "bool" and op in ("max", "min"):
            continue
        out_dtype = "int64" if op == "argmax" or (op == "sum" and dtype == "bool") else dtype
        got, want = both("reduce_" + op, [(x, dtype)], [(outer * inner, out_dtype)],
                         outer, size, inner)
        if op == "sum" and dtype in FLOATS:
            rtol = {"float64": 1e-11, "float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}[dtype]
            close(got[0], want[0], rtol=rtol, atol=rtol * np.sqrt(size) * 4)
        else:
            np.testing.assert_array_equal(got[0], want[0], err_msg=op)


def test_argmax_takes_the_first_nan_and_the_first_of_ties(be):
    n = 300_001  # long enough to be split across threads
    x = np.zeros(n, np.float32)
    x[[5, 200_000]] = 3.0
    got, want = both("reduce_argmax", [(x, "float32")], [(1, "int64")], 1, n, 1)
    assert got[0][0] == want[0][0] == 5
    x[[250_000, 299_999]] = np.nan
    got, want = both("reduce_argmax", [(x, "float32")], [(1, "int64")], 1, n, 1)
    assert got[0][0] == want[0][0] == 250_000
    cols = np.zeros((50, 4), np.float32)
    cols[[3, 9], 1] = 2.0
    cols[[7, 40], 2] = np.nan
    got, want = both("reduce_argmax", [(cols, "float32")], [(4, "int64")], 1, 50, 4)
    assert got[0].tolist() == want[0].tolist() == [0, 3, 7, 0]
    got, want = both("reduce_max", [(cols, "float32")], [(4, "float32")], 1, 50, 4)
    np.testing.assert_array_equal(got[0], want[0])


# --- matmul --------------------------------------------------------------------------------------

def _matmul_case(dtype, m, n, p, batch=1, stride_a=None, stride_b=None, ta=False, tb=False):
    rng = np.random.default_rng(m * 1000 + n * 10 + p)
    na = m * n * (batch if stride_a is None else 1) + (stride_a or 0) * (batch - 1)
    nb = n * p * (batch if stride_b is None else 1) + (stride_b or 0) * (batch - 1)
    x, y = rng.standard_normal(na), rng.standard_normal(nb)
    if dtype in ("int32", "int64"):
        x, y = np.round(x * 3), np.round(y * 3)
    got, want = both("matmul", [(x, dtype), (y, dtype)], [(batch * m * p, dtype)], m, n, p,
                     batch=batch, stride_a=stride_a, stride_b=stride_b, transpose_a=ta,
                     transpose_b=tb)
    if dtype in ("int32", "int64"):
        np.testing.assert_array_equal(got[0], want[0])
    else:
        rtol = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
        close(got[0], want[0], rtol=rtol, atol=rtol * np.sqrt(n) * 2)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64", "int32", "int64"])
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_matmul_transposes_and_edge_tiles(dtype, ta, tb):
    for m, n, p in ((1, 1, 1), (7, 33, 5), (33, 7, 1), (97, 300, 70), (2, 5, 1000)):
        _matmul_case(dtype, m, n, p, ta=ta, tb=tb)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_batched_matmul_broadcasts_with_stride_zero(dtype):
    _matmul_case(dtype, 9, 17, 13, batch=4, stride_a=0)
    _matmul_case(dtype, 9, 17, 13, batch=4, stride_b=0, tb=True)
    _matmul_case(dtype, 1, 64, 300, batch=3, stride_b=0)  # decode path over a batch
    _matmul_case(dtype, 5, 6, 7, batch=3, stride_a=50, stride_b=60)  # padded strides


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_large_matmul_on_the_thread_team(dtype):
    # larger than the KC x NC blocks, so several blocks are packed and accumulated
    _matmul_case(dtype, 300, 700, 1100)
    _matmul_case(dtype, 260, 300, 200, ta=True, tb=True, batch=2)


def test_matrix_vector_path(be):
    for tb in (False, True):
        _matmul_case("float32", 1, 4099, 2050, tb=tb)
        _matmul_case("bfloat16", 1, 513, 700, tb=tb)


def test_matmul_checks_its_buffers(be):
    a, b, out = be.Array(6, "float32"), be.Array(6, "float32"), be.Array(4, "float32")
    with pytest.raises(ShapeError):
        be.matmul(a, b, out, 2, 3, 3)  # out too small for 2 x 3
    with pytest.raises(ShapeError):
        be.matmul(a, b, be.Array(8, "float32"), 2, 3, 2, batch=2, stride_a=3)
    with pytest.raises(DTypeError):
        be.matmul(a, be.Array(6, "float64"), out, 2, 3, 2)
    with pytest.raises(DTypeError):
        be.matmul(be.Array(6, "bool"), be.Array(6, "bool"), be.Array(4, "bool"), 2, 3, 2)


# --- transformer and indexing kernels --------------------------------------------------------

@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the -inf row
@pytest.mark.parametrize("dtype", FLOATS)
def test_row_kernels_on_many_rows(dtype):
    rng = np.random.default_rng(6)
    rows, dim = 513, 1000
    x = rng.standard_normal(rows * dim) * 5
    x[7] = -np.inf
    w, b = rng.standard_normal(dim), rng.standard_normal(dim)
    rtol = {"float64": 1e-12, "float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}[dtype]
    for fn, ins, args in (("softmax", [x], (dim,)), ("log_softmax", [x], (dim,)),
                          ("rmsnorm", [x, w], (dim, 1e-6)), ("layernorm", [x, w, b], (dim, 1e-5)),
                          ("silu_mul", [x, x[::-1].copy()], ())):
        got, want = both(fn, [(v, dtype) for v in ins], [(x.size, dtype)], *args)
        close(got[0], want[0], rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("case", [
    (1, 8, 2, 1, 37, 40, 64, True),     # decode against a KV cache, grouped heads
    (2, 4, 4, 130, 130, 130, 32, True),  # causal prefill over several query blocks
    (1, 6, 3, 70, 90, 96, 16, False),    # non-causal, kv_len < capacity
])
def test_attention_paths(dtype, case):
    batch, hq, hkv, lq, lkv, cap, d, causal = case
    rng = np.random.default_rng(8)
    q = rng.standard_normal(batch * hq * lq * d)
    k = rng.standard_normal(batch * hkv * cap * d)
    v = rng.standard_normal(batch * hkv * cap * d)
    got, want = both("attention", [(q, dtype), (k, dtype), (v, dtype)], [(q.size, dtype)],
                     batch, hq, hkv, lq, lkv, cap, d, 0.125, causal)
    rtol = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 2e-2}[dtype]
    close(got[0], want[0], rtol=rtol, atol=rtol)


def test_rope_matches_reference():
    rng = np.random.default_rng(9)
    batch, seq, heads, hd = 2, 17, 3, 64
    x = rng.standard_normal(batch * seq * heads * hd)
    cos, sin = rng.standard_normal(seq * hd // 2), rng.standard_normal(seq * hd // 2)
    for dtype in FLOATS:
        got, want = both("rope", [(x, dtype), (cos, dtype), (sin, dtype)], [(x.size, dtype)],
                         batch, seq, heads, hd)
        close(got[0], want[0], rtol=1e-2 if dtype == "bfloat16" else 1e-5, atol=1e-2)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
def test_take_and_scatter_add_with_repeated_and_negative_indices(be, dtype):
    rng = np.random.default_rng(10)
    rows, dim, n = 100, 300, 2000
    table = np.round(rng.standard_normal(rows * dim) * 8)
    idx = rng.integers(-rows, rows, n)
    for idx_dtype in ("int32", "int64"):
        got, want = both("take", [(table, dtype), (idx, idx_dtype)], [(n * dim, dtype)], rows, dim)
        np.testing.assert_array_equal(got[0], want[0])
    vals = np.round(rng.standard_normal(n * dim) * 4)
    results = []
    for backend in (be, ref):
        out = put(backend, table, dtype)
        backend.scatter_add(put(backend, idx, "int64"), put(backend, vals, dtype), out, rows, dim)
        results.append(values(backend, out))
    np.testing.assert_array_equal(results[0], results[1])  # same order of additions
    with pytest.raises(IndexOutOfRangeError, match="out of range"):
        be.take(put(be, table, dtype), put(be, np.array([0, rows]), "int64"),
                be.Array(2 * dim, dtype), rows, dim)


# --- layout ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool"])
def test_strided_copies_large_and_transposed(be, dtype):
    rng = np.random.default_rng(11)
    x = rng.standard_normal(600 * 700)
    if dtype == "bool":
        x = x > 0
    for shape, strides, offset in (((700, 600), (1, 700), 0),          # transpose: tiled path
                                   ((3, 200, 350), (2, 700, -1), 349),  # negative inner stride
                                   ((600, 1, 700), (700, 0, 1), 0),
                                   ((5, 100000), (0, 1), 7)):          # broadcast rows
        got = be.to_numpy(put(be, x, dtype), shape, strides, offset)
        want = ref.to_numpy(put(ref, x, dtype), shape, strides, offset)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(bits(got), bits(want))
    shape, strides = (300, 400), (1, 600)
    src = x[: 300 * 400].copy()
    results = []
    for backend in (be, ref):
        out = put(backend, x, dtype)
        backend.ewise_setitem(put(backend, src, dtype), out, shape, strides, 5)
        backend.scalar_setitem(200, 1, out, (200,), (-3,), 420000 - 1)
        results.append(values(backend, out))
    np.testing.assert_array_equal(bits(results[0]), bits(results[1]))


def test_views_outside_the_buffer_are_refused(be):
    a, out = be.Array(10, "float32"), be.Array(4, "float32")
    with pytest.raises(IndexOutOfRangeError):
        be.compact(a, out, (2, 2), (5, 1), 6)
    with pytest.raises(IndexOutOfRangeError):
        be.compact(a, out, (4,), (-1,), 2)
    with pytest.raises(ShapeError):
        be.compact(a, be.Array(3, "float32"), (2, 2), (2, 1), 0)
    with pytest.raises(DTypeError):
        be.ewise_add(a, a, be.Array(10, "bool"))
    with pytest.raises(DTypeError, match="bool"):
        be.ewise_add(be.Array(3, "bool"), be.Array(3, "bool"), be.Array(3, "bool"))
