"""The reference backend: the array API (design §3) in numpy.

This module defines what every array-API function means; every other backend is tested
against it. Conventions shared by all backends:

* A buffer is a flat, typed allocation: ``Array(size, dtype)`` with ``.size`` (elements)
  and ``.dtype`` (needle's dtype name). Shapes live in NDArray, never in buffers.
* Functions write into a preallocated ``out`` and take compact inputs unless the name says
  otherwise (``compact``, ``ewise_setitem``, ``scalar_setitem`` take shape/strides/offset).
* Binary ``ewise_*``/``scalar_*`` functions get inputs of one dtype (NDArray promotes first);
  comparisons write bool. ``ewise_cast`` converts to ``out.dtype``.
* Arithmetic ``ewise_*``/``scalar_*`` functions may get ``out`` as the same buffer as an
  input (NDArray's in-place ``+=``, ``-=``, ``*=``, ``/=``): element i is read before it is
  written, so kernels must not assume ``out`` and the inputs are distinct.
* float16 and bfloat16 compute in float32 and round once when written.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from ..backend_ndarray.dtypes import to_numpy_dtype
from ..errors import DeviceError, OutOfMemoryError

name = "cpu_numpy"
capabilities = frozenset({"host_memory"})  # backends/api.py names what each one promises


def load(index: int = 0):
    """The backend: this module itself (one device, index 0)."""
    if index != 0:
        raise DeviceError(f"the cpu_numpy device has only index 0, got {index}")
    return sys.modules[__name__]


class Array:
    """A flat buffer of ``size`` elements of ``dtype`` held in a numpy array."""

    __slots__ = ("array", "dtype")

    def __init__(self, size: int, dtype: str = "float32"):
        try:
            self.array = np.empty(size, dtype=to_numpy_dtype(dtype))
        except (MemoryError, ValueError):  # ValueError: more bytes than numpy can address
            raise OutOfMemoryError(f"cannot allocate {size} elements of {dtype} "
                                   f"({size * to_numpy_dtype(dtype).itemsize} bytes) on "
                                   "cpu_numpy; use smaller arrays") from None
        self.dtype = dtype

    @property
    def size(self) -> int:
        return self.array.size

    @property
    def ptr(self) -> int:
        return self.array.ctypes.data


_HALF = (np.dtype(np.float16), to_numpy_dtype("bfloat16"))


def _f(x: np.ndarray) -> np.ndarray:
    """``x`` in its compute dtype: fp16/bf16 compute in float32."""
    return x.astype(np.float32) if x.dtype in _HALF else x


def _store(out: Array, value) -> None:
    out.array[:] = np.asarray(value).astype(out.array.dtype, copy=False).reshape(-1)


def _view(a: Array, shape, strides, offset) -> np.ndarray:
    item = a.array.itemsize
    return np.lib.stride_tricks.as_strided(
        a.array[offset:], shape=tuple(shape), strides=tuple(s * item for s in strides)
    )


# --- memory -----------------------------------------------------------------------------

def from_numpy(a: np.ndarray, out: Array) -> None:
    out.array[:] = np.ascontiguousarray(a).reshape(-1).astype(out.array.dtype, copy=False)


def wrap(flat: np.ndarray, dtype: str) -> Array:
    """An Array sharing the memory of the 1-d numpy array ``flat`` (DLPack import)."""
    arr = Array.__new__(Array)
    arr.array, arr.dtype = flat, dtype
    return arr


def host_view(a: Array) -> np.ndarray:
    """A 1-d numpy array aliasing the buffer (DLPack export, zero-copy)."""
    return a.array


def to_numpy(a: Array, shape, strides, offset) -> np.ndarray:
    return _view(a, shape, strides, offset).copy()


def fill(out: Array, value) -> None:
    out.array.fill(value)


def synchronize() -> None:
    """Wait for queued work; numpy runs eagerly, so there is none."""


# --- layout -----------------------------------------------------------------------------

def compact(a: Array, out: Array, shape, strides, offset) -> None:
    """Copy the strided view (shape, strides, offset) of ``a`` into compact ``out``."""
    out.array[:] = _view(a, shape, strides, offset).reshape(-1)


def ewise_setitem(a: Array, out: Array, shape, strides, offset) -> None:
    """Write compact ``a`` into the strided view (shape, strides, offset) of ``out``."""
    view = _view(out, shape, strides, offset)
    view[...] = a.array.reshape(shape)


def scalar_setitem(size: int, value, out: Array, shape, strides, offset) -> None:
    """Write ``value`` into every element of the strided view of ``out``."""
    view = _view(out, shape, strides, offset)
    view[...] = value


# --- elementwise ------------------------------------------------------------------------

def _binary(fn):
    # IEEE results (inf - inf is nan, 1 / 0 is inf) are the contract, not warnings
    def ewise(a: Array, b: Array, out: Array) -> None:
        with np.errstate(all="ignore"):
            _store(out, fn(_f(a.array), _f(b.array)))

    def scalar(a: Array, value, out: Array) -> None:
        x = _f(a.array)
        with np.errstate(all="ignore"):
            _store(out, fn(x, np.asarray(value, dtype=x.dtype)))

    return ewise, scalar


def _div(x, y):
    if x.dtype.kind in "iu":  # integer division truncates toward zero, as in C
        with np.errstate(divide="ignore", over="ignore"):
            q = np.where(y == 0, 0, x // np.where(y == 0, 1, y))
            r = x - q * y
        # floor division rounded a negative inexact quotient down: step back toward zero
        return q + ((r != 0) & (y != 0) & ((x < 0) != (y < 0)))
    with np.errstate(divide="ignore", invalid="ignore"):
        return x / y


def _power(x, y):
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if x.dtype.kind in "iu":
            return np.power(x, np.maximum(y, 0))
        return np.power(x, y)


ewise_add, scalar_add = _binary(np.add)
ewise_sub, scalar_sub = _binary(np.subtract)
ewise_mul, scalar_mul = _binary(np.multiply)
ewise_div, scalar_div = _binary(_div)
ewise_power, scalar_power = _binary(_power)
ewise_maximum, scalar_maximum = _binary(np.maximum)
ewise_minimum, scalar_minimum = _binary(np.minimum)
ewise_eq, scalar_eq = _binary(np.equal)
ewise_ne, scalar_ne = _binary(np.not_equal)
ewise_lt, scalar_lt = _binary(np.less)
ewise_le, scalar_le = _binary(np.less_equal)
ewise_gt, scalar_gt = _binary(np.greater)
ewise_ge, scalar_ge = _binary(np.greater_equal)


def _unary(fn):
    def ewise(a: Array, out: Array) -> None:
        with np.errstate(all="ignore"):
            _store(out, fn(_f(a.array)))

    return ewise


def _sigmoid(x):
    return 0.5 * (np.tanh(0.5 * x) + 1)


def _gelu(x):  # exact (erf) form, as torch.nn.GELU()
    erf = np.vectorize(math.erf, otypes=[x.dtype]) if x.size else (lambda v: v)
    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


ewise_neg = _unary(np.negative)
ewise_abs = _unary(np.abs)
ewise_exp = _unary(np.exp)
ewise_log = _unary(np.log)
ewise_sqrt = _unary(np.sqrt)
ewise_rsqrt = _unary(lambda x: 1 / np.sqrt(x))
ewise_sin = _unary(np.sin)
ewise_cos = _unary(np.cos)
ewise_tanh = _unary(np.tanh)
ewise_sigmoid = _unary(_sigmoid)
ewise_relu = _unary(lambda x: np.maximum(x, 0))
ewise_silu = _unary(lambda x: x * _sigmoid(x))
ewise_gelu = _unary(_gelu)


def ewise_cast(a: Array, out: Array) -> None:
    """Convert ``a`` to ``out.dtype`` (floats to ints truncate toward zero)."""
    with np.errstate(invalid="ignore", over="ignore"):  # overflow to inf is the contract
        out.array[:] = a.array.astype(out.array.dtype)


def where(cond: Array, a: Array, b: Array, out: Array) -> None:
    out.array[:] = np.where(cond.array, a.array, b.array)


# --- reductions -------------------------------------------------------------------------
# ``a`` is compact with logical shape (outer, reduce_size, inner); ``out`` is (outer, inner).
# inner == 1 is the common "last axis" case; inner > 1 reduces a middle axis in place.

def _r(a: Array, outer: int, reduce_size: int, inner: int) -> np.ndarray:
    return _f(a.array).reshape(outer, reduce_size, inner)


def reduce_sum(a: Array, out: Array, outer: int, reduce_size: int, inner: int = 1) -> None:
    x = _r(a, outer, reduce_size, inner)
    acc = x.dtype if x.dtype.kind in "iub" or x.dtype == np.float64 else np.float32
    if x.dtype == np.bool_:
        acc = np.int64
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is nan, by contract
        _store(out, x.sum(axis=1, dtype=acc))


def reduce_max(a: Array, out: Array, outer: int, reduce_size: int, inner: int = 1) -> None:
    _store(out, _r(a, outer, reduce_size, inner).max(axis=1))


def reduce_min(a: Array, out: Array, outer: int, reduce_size: int, inner: int = 1) -> None:
    _store(out, _r(a, outer, reduce_size, inner).min(axis=1))


def reduce_argmax(a: Array, out: Array, outer: int, reduce_size: int, inner: int = 1) -> None:
    """Index of the first maximum (NaN counts as the maximum); ``out`` is int64."""
    x = _r(a, outer, reduce_size, inner)
    out.array[:] = np.argmax(x, axis=1).reshape(-1)


# --- matmul -----------------------------------------------------------------------------

def matmul(a: Array, b: Array, out: Array, m: int, n: int, p: int, *, batch: int = 1,
           stride_a: int | None = None, stride_b: int | None = None,
           transpose_a: bool = False, transpose_b: bool = False) -> None:
    """out[i] = A[i] @ B[i] for i < batch; out is compact (batch, m, p).

    A[i] starts at element ``i * stride_a`` of ``a`` and is stored (m, n) row-major, or
    (n, m) when ``transpose_a``; likewise B[i] is (n, p), or (p, n) when ``transpose_b``.
    A stride of 0 broadcasts one matrix over the batch. Default strides are compact.
    """
    stride_a = m * n if stride_a is None else stride_a
    stride_b = n * p if stride_b is None else stride_b
    ra, ca = (n, m) if transpose_a else (m, n)
    rb, cb = (p, n) if transpose_b else (n, p)
    fa, fb = _f(a.array), _f(b.array)
    x = np.lib.stride_tricks.as_strided(fa, (batch, ra, ca), _strides(fa, stride_a, ca))
    y = np.lib.stride_tricks.as_strided(fb, (batch, rb, cb), _strides(fb, stride_b, cb))
    if transpose_a:
        x = x.transpose(0, 2, 1)
    if transpose_b:
        y = y.transpose(0, 2, 1)
    _store(out, np.matmul(x, y).reshape(-1))


def _strides(x: np.ndarray, batch_stride: int, cols: int) -> tuple[int, int, int]:
    return batch_stride * x.itemsize, cols * x.itemsize, x.itemsize


# --- indexing ---------------------------------------------------------------------------

def take(table: Array, indices: Array, out: Array, rows: int, dim: int) -> None:
    """out[i, :] = table[indices[i], :]; table is (rows, dim), indices int32/int64."""
    out.array[:] = table.array.reshape(rows, dim)[indices.array].reshape(-1)


def scatter_add(indices: Array, values: Array, out: Array, rows: int, dim: int) -> None:
    """out[indices[i], :] += values[i, :] (the gradient of ``take``); out is (rows, dim)."""
    acc = _f(out.array).reshape(rows, dim).copy()
    np.add.at(acc, indices.array, _f(values.array).reshape(-1, dim))
    _store(out, acc.reshape(-1))


# --- transformer ------------------------------------------------------------------------
# Row functions see compact (rows, dim) inputs and work along the last axis.

def softmax(a: Array, out: Array, dim: int) -> None:
    x = _f(a.array).reshape(-1, dim)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(x - x.max(axis=1, keepdims=True))
        _store(out, (e / e.sum(axis=1, keepdims=True)).reshape(-1))


def log_softmax(a: Array, out: Array, dim: int) -> None:
    x = _f(a.array).reshape(-1, dim)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        z = x - x.max(axis=1, keepdims=True)
        _store(out, (z - np.log(np.exp(z).sum(axis=1, keepdims=True))).reshape(-1))


def rmsnorm(x: Array, w: Array, out: Array, dim: int, eps: float) -> None:
    """out = x / sqrt(mean(x**2) + eps) * w, per row."""
    v = _f(x.array).reshape(-1, dim)
    r = 1 / np.sqrt((v * v).mean(axis=1, keepdims=True) + np.asarray(eps, v.dtype))
    _store(out, (v * r * _f(w.array)).reshape(-1))


def add_rmsnorm(x: Array, delta: Array, w: Array, total: Array, out: Array, dim: int,
                eps: float) -> None:
    """The pre-norm residual step in one pass, per row: ``total = x + delta`` (rounded to the
    dtype, as a separate add would), then ``out = rmsnorm(total) * w`` from the rounded sum.
    ``total`` may be ``x`` itself (the residual stream updated in place)."""
    s = (_f(x.array) + _f(delta.array)).astype(x.array.dtype)
    _store(total, s)
    v = _f(s).reshape(-1, dim)
    r = 1 / np.sqrt((v * v).mean(axis=1, keepdims=True) + np.asarray(eps, v.dtype))
    _store(out, (v * r * _f(w.array)).reshape(-1))


def layernorm(x: Array, w: Array, b: Array, out: Array, dim: int, eps: float) -> None:
    """out = (x - mean) / sqrt(var + eps) * w + b, per row (biased variance)."""
    v = _f(x.array).reshape(-1, dim)
    mu = v.mean(axis=1, keepdims=True)
    var = ((v - mu) ** 2).mean(axis=1, keepdims=True)
    y = (v - mu) / np.sqrt(var + np.asarray(eps, v.dtype)) * _f(w.array) + _f(b.array)
    _store(out, y.reshape(-1))


def rope(x: Array, cos: Array, sin: Array, out: Array,
         batch: int, seq: int, heads: int, head_dim: int) -> None:
    """Rotary embedding, half-split layout, on x of shape (batch, seq, heads, head_dim).

    cos and sin are (seq, head_dim // 2). With x1, x2 the two halves of the last axis:
    out = concat(x1*cos - x2*sin, x2*cos + x1*sin).
    """
    v = _f(x.array).reshape(batch, seq, heads, head_dim)
    h = head_dim // 2
    c = _f(cos.array).reshape(1, seq, 1, h)
    s = _f(sin.array).reshape(1, seq, 1, h)
    x1, x2 = v[..., :h], v[..., h:]
    _store(out, np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(-1))


def silu_mul(a: Array, b: Array, out: Array) -> None:
    """out = silu(a) * b (SwiGLU's gate)."""
    x = _f(a.array)
    _store(out, x * _sigmoid(x) * _f(b.array))


def swiglu(x: Array, out: Array, dim: int) -> None:
    """out = silu(x[:, :dim]) * x[:, dim:] per row of x (rows, 2 * dim): ``silu_mul`` of the
    two halves of a fused gate-and-up projection, without splitting it first."""
    v = _f(x.array).reshape(-1, 2 * dim)
    a = v[:, :dim]
    _store(out, (a * _sigmoid(a) * v[:, dim:]).reshape(-1))


def attention(q: Array, k: Array, v: Array, out: Array, batch: int, q_heads: int,
              kv_heads: int, q_len: int, kv_len: int, kv_capacity: int, head_dim: int,
              scale: float, causal: bool) -> None:
    """Scaled dot-product attention with grouped-query heads.

    q and out are (batch, q_heads, q_len, head_dim); k and v are (batch, kv_heads,
    kv_capacity, head_dim) of which the first kv_len positions are used (a KV cache).
    Query head h reads KV head h // (q_heads // kv_heads). With ``causal``, query i sits at
    position kv_len - q_len + i and sees keys j <= that position.
    """
    group = q_heads // kv_heads
    qq = _f(q.array).reshape(batch, q_heads, q_len, head_dim)
    kk = _f(k.array).reshape(batch, kv_heads, kv_capacity, head_dim)[:, :, :kv_len]
    vv = _f(v.array).reshape(batch, kv_heads, kv_capacity, head_dim)[:, :, :kv_len]
    kk = np.repeat(kk, group, axis=1)
    vv = np.repeat(vv, group, axis=1)
    s = np.matmul(qq, kk.transpose(0, 1, 3, 2)) * np.asarray(scale, qq.dtype)
    if causal:
        qpos = np.arange(q_len)[:, None] + (kv_len - q_len)
        s = np.where(np.arange(kv_len)[None, :] <= qpos, s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    _store(out, np.matmul(p, vv).reshape(-1))


def attention_decode(qkv: Array, cos: Array, sin: Array, position: Array, keys: Array,
                     values: Array, out: Array, q_heads: int, kv_heads: int, head_dim: int,
                     capacity: int, table_rows: int, scale: float) -> None:
    """One decode step of grouped-query attention at the position held in device memory.

    All arrays but ``position`` share one floating dtype; scores, softmax and the weighted
    sum are computed in float32 (float64 for float64). ``qkv`` is one token's fused
    projection, (q_heads + 2 * kv_heads) * head_dim values: the queries, then the keys, then
    the values, head after head. ``cos`` and ``sin`` are rotary tables (table_rows,
    head_dim // 2); ``keys`` and ``values`` a KV cache (kv_heads, capacity, head_dim);
    ``position`` an int32 array whose first element p is the token's position. In one pass:

    1. RoPE (half-split, as ``rope``) of the queries and the key with row p of the tables,
       each rounded to the dtype of ``qkv`` (as the ``rope`` function's output is);
    2. the key and value stored at ``keys[h, p]`` and ``values[h, p]``, for every KV head h;
    3. ``out`` (q_heads * head_dim, dtype of ``qkv``) = softmax(scale * q · keys[h, :p+1]ᵀ)
       · values[h, :p+1] per query head, h = head // (q_heads // kv_heads).

    Positions outside 0..min(capacity, table_rows)-1 write nothing to the cache and give NaN
    outputs (the kernels cannot raise; the caller checks positions on the host).
    """
    d, h = head_dim, head_dim // 2
    p = int(position.array[0])
    o = out.array.reshape(q_heads, d)
    if not 0 <= p < min(capacity, table_rows):
        o[:] = np.nan
        return
    dt = qkv.array.dtype
    v = _f(qkv.array).reshape(q_heads + 2 * kv_heads, d)
    c, s = _f(cos.array).reshape(-1, h)[p], _f(sin.array).reshape(-1, h)[p]
    x1, x2 = v[:q_heads + kv_heads, :h], v[:q_heads + kv_heads, h:]
    roped = _f(np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=1).astype(dt))
    q, k_new, v_new = roped[:q_heads], roped[q_heads:], v[q_heads + kv_heads:]
    kc = keys.array.reshape(kv_heads, capacity, d)
    vc = values.array.reshape(kv_heads, capacity, d)
    kc[:, p] = k_new.astype(kc.dtype)
    vc[:, p] = v_new.astype(vc.dtype)
    group = q_heads // kv_heads
    kk = np.repeat(_f(kc[:, :p + 1]), group, axis=0)  # (q_heads, p+1, d)
    vv = np.repeat(_f(vc[:, :p + 1]), group, axis=0)
    scores = np.einsum("hd,htd->ht", q, kk) * np.asarray(scale, q.dtype)
    e = np.exp(scores - scores.max(axis=1, keepdims=True))
    probs = e / e.sum(axis=1, keepdims=True)
    _store(out, np.einsum("ht,htd->hd", probs, vv).reshape(-1))


# --- optimizer updates ------------------------------------------------------------------
# One parameter's whole update in one pass, in place: an optimizer step written with the
# functions above costs a dozen passes over the weights and as many launches. ``param`` and
# ``grad`` share a dtype; the state buffers are float32 for float16/bfloat16 parameters and
# of the parameter's dtype otherwise, and all arithmetic runs in the state's dtype, rounding
# ``param`` once when it is written. Products and sums follow needle.optim's formulas in
# order, so float64 results are those of the unfused update bit for bit.

def adam_update(param: Array, grad: Array, m: Array, v: Array, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float, step: int,
                decoupled: bool) -> None:
    """Adam step number ``step`` (>= 1) of one parameter; ``m`` and ``v`` are the moments
    (zeros before the first step). With c = scalars rounded to the state's dtype:

    decay: ``w = w * (1 - lr*wd)`` when ``decoupled`` (AdamW), else ``g = g + w * wd``;
    ``m = m*b1 + g*(1-b1)``; ``v = v*b2 + (g*g)*(1-b2)``;
    ``w = w - m / (sqrt(v) + eps*sqrt(bc2)) * (lr*sqrt(bc2)/bc1)``, ``bc_i = 1 - b_i**step``.
    """
    c = m.array.dtype.type
    w, g = _f(param.array), _f(grad.array)
    with np.errstate(all="ignore"):
        if decoupled:
            w = w * c(1 - lr * weight_decay)
        elif weight_decay:
            g = g + w * c(weight_decay)
        g2 = g * g
        g2 *= c(1 - beta2)
        m.array *= c(beta1)
        m.array += g * c(1 - beta1)
        v.array *= c(beta2)
        v.array += g2
        root_bc2 = math.sqrt(1 - beta2 ** step)
        denom = np.sqrt(v.array)
        denom += c(eps * root_bc2)
        update = m.array / denom
        update *= c(lr * root_bc2 / (1 - beta1 ** step))
        _store(param, w - update)


def sgd_update(param: Array, grad: Array, momentum_buf: Array | None, lr: float,
               momentum: float, dampening: float, weight_decay: float, nesterov: bool,
               first: bool) -> None:
    """SGD step of one parameter, as torch.optim.SGD. ``momentum_buf`` is None exactly when
    ``momentum`` is 0; ``first`` says it holds nothing yet (the step sets it to g).

    ``g = g + w * wd``; ``u = g`` (first) or ``u = u*mu + g*(1-dampening)``;
    ``w = w - (g + u*mu if nesterov else u) * lr`` (``w = w - g * lr`` without momentum).
    """
    w, g = _f(param.array), _f(grad.array)
    c = g.dtype.type
    with np.errstate(all="ignore"):
        if weight_decay:
            g = g + w * c(weight_decay)
        if momentum_buf is not None:
            u = momentum_buf.array
            if first:
                u[:] = g
            else:
                u *= c(momentum)
                u += g * c(1 - dampening) if dampening else g
            g = g + u * c(momentum) if nesterov else u
        _store(param, w - g * c(lr))
