"""The decode step's fused operations (``nd.attention_decode``, ``nd.rmsnorm_matvec``,
``nd.matvec_add``, ``nd.qk_rmsnorm``).

A Llama layer for one token is five array operations: ``rmsnorm_matvec`` (norm + QKV),
``attention_decode``, ``matvec_add`` (output projection + residual), ``rmsnorm_matvec``
with ``activation="swiglu"`` (norm + gate/up + SiLU·mul), ``matvec_add`` (down +
residual). Each is one kernel on CUDA; ``numpy_ref/decode.py`` defines what they compute
(the same roundings as the unfused ops). Weights are (out, in), as checkpoints store them,
dense or packed (``QuantizedMatrix``, docs/quantization.md): packed ones go to a backend's
``quant_rmsnorm_matvec``/``quant_matvec_add`` (capability ``fused_quant_matvec``), or, where it
has none, are composed here from ``rmsnorm`` and ``quant_matmul``.
"""

from __future__ import annotations

import math
import numbers

from ..backends.api import has
from ..errors import ArgumentError, ArgumentTypeError, DeviceError, DTypeError, ShapeError
from . import dtypes
from .functions import matmul_swiglu, softcap_arg, window_arg
from .ndarray import NDArray, ones
from .quant import QuantizedMatrix, _activation_dtype, _h, quant_matmul


def attention_decode(qkv: NDArray, cos: NDArray, sin: NDArray, position: NDArray,
                     keys: NDArray, values: NDArray, q_heads: int,
                     scale: float | None = None, max_positions: int | None = None,
                     window: int | None = None, softcap: float | None = None) -> NDArray:
    """One token's attention step against a KV cache, at a position held on the device.

    ``qkv``: the token's fused query/key/value projection, (q_heads + 2 * kv_heads) *
    head_dim values (any shape with that size); ``cos``/``sin``: rotary tables (rows,
    head_dim // 2) of qkv's dtype; ``position``: an int32 array whose first element is the
    position p; ``keys``/``values``: compact caches (..., kv_heads, capacity, head_dim) of
    qkv's dtype.
    Rotates the query and key (RoPE at row p), stores key and value at row p of the caches,
    and returns the attention output over positions 0..p, shape (q_heads * head_dim,).
    Nothing here reads p on the host, so a captured decode step can replay it; a p outside
    the cache or the tables writes nothing and gives NaNs (check positions before).
    ``max_positions`` (1..capacity; None: the capacity) bounds the positions p + 1 that the
    caller expects to read, for a backend that chooses its kernel by it (capability
    ``decode_bands``; ``attention_decode_bands`` says where the choice changes): the result
    is the same at any position, also past the bound.
    ``window`` (a positive int; None: every position): a sliding window, the step at p
    attending to positions p - window + 1..p only (Mistral, Gemma 3's local layers).
    ``softcap`` (a positive number; None: none): the scaled scores s soft-capped to
    softcap · tanh(s / softcap) before the softmax (Gemma 2).
    See ``numpy_ref.attention_decode``.
    """
    for t in (cos, sin, position, keys, values):
        qkv._check_device(t)
    if keys.shape != values.shape or keys.ndim < 3 or any(d != 1 for d in keys.shape[:-3]):
        raise ShapeError(f"attention_decode: keys {keys.shape} and values {values.shape} must "
                         "be caches of one shape (kv_heads, capacity, head_dim)")
    kv_heads, capacity, d = keys.shape[-3:]
    if d % 2 or kv_heads == 0 or q_heads <= 0 or q_heads % kv_heads:
        raise ShapeError(f"attention_decode: {q_heads} query heads over {kv_heads} kv heads "
                         f"of size {d} (must divide, with an even head size)")
    if qkv.size != (q_heads + 2 * kv_heads) * d:
        raise ShapeError(f"attention_decode: qkv has {qkv.size} values, expected "
                         f"({q_heads} + 2 x {kv_heads}) x {d} = {(q_heads + 2 * kv_heads) * d}")
    if not dtypes.is_floating(qkv.dtype) or not dtypes.is_floating(keys.dtype):
        raise DTypeError(f"attention_decode needs floating-point arrays, got {qkv.dtype} "
                         f"and a {keys.dtype} cache")
    if keys.dtype != qkv.dtype or values.dtype != qkv.dtype:
        raise DTypeError(f"attention_decode: the cache ({keys.dtype}, {values.dtype}) must have "
                         f"qkv's dtype {qkv.dtype}")
    if not (keys.is_compact() and values.is_compact()):
        raise ShapeError("attention_decode: keys and values must be compact (whole) caches")
    if position.dtype != "int32" or position.size < 1:
        raise DTypeError(f"attention_decode: position must be an int32 array, got "
                         f"{position.dtype} of size {position.size}")
    for t, nm in ((cos, "cos"), (sin, "sin")):
        if t.ndim != 2 or t.shape[1] != d // 2 or t.shape != cos.shape:
            raise ShapeError(f"attention_decode: {nm} must be (rows, {d // 2}) like cos, got "
                             f"{t.shape}")
    bound = _positions_bound(max_positions, capacity)
    window = window_arg(window, "attention_decode", capacity)
    cap = softcap_arg(softcap, "attention_decode")
    scale = 1 / math.sqrt(d) if scale is None else float(scale)
    c, s = cos.astype(qkv.dtype).compact(), sin.astype(qkv.dtype).compact()
    a = qkv.compact()
    out = NDArray.make((q_heads * d,), device=qkv.device, dtype=qkv.dtype)
    be = qkv.device.backend
    handles = (a._handle, c._handle, s._handle, position.compact()._handle, keys._handle,
               values._handle, out._handle, q_heads, kv_heads, d, capacity, cos.shape[0], scale,
               window)
    if bound < capacity and has(be, "decode_bands"):
        be.attention_decode_within(*handles, bound, softcap=cap)
    else:
        be.attention_decode(*handles, softcap=cap)
    return out


def _is_int(value) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _positions_bound(max_positions, capacity: int) -> int:
    """attention_decode's ``max_positions`` checked: an int in 1..capacity (None: capacity)."""
    if max_positions is None:
        return capacity
    if not _is_int(max_positions) or not 1 <= max_positions <= capacity:
        raise ArgumentError(f"attention_decode: max_positions must be an int from 1 to the "
                            f"cache's capacity {capacity}, got {max_positions!r}")
    return int(max_positions)


def attention_decode_bands(keys: NDArray, q_heads: int) -> tuple[int, ...]:
    """The bounds on positions read (ascending, the last the cache's capacity) at which the
    backend's ``attention_decode`` over this cache picks another kernel: a decoder that
    records its step records one a band and passes the band's bound as
    ``max_positions``. ``(capacity,)`` where the backend's choice does not depend on it."""
    if not isinstance(keys, NDArray) or keys.ndim < 3:
        raise ArgumentTypeError("attention_decode_bands: keys must be a cache NDArray "
                                "(kv_heads, capacity, head_dim)")
    kv_heads, capacity, d = keys.shape[-3:]
    if not _is_int(q_heads) or kv_heads == 0 or q_heads <= 0 or q_heads % kv_heads:
        raise ShapeError(f"attention_decode_bands: {q_heads!r} query heads over {kv_heads} kv "
                         "heads (must be a positive multiple)")
    be = keys.device.backend
    if not has(be, "decode_bands"):
        return (capacity,)
    bands = tuple(int(b) for b in be.attention_decode_bands(keys.dtype, q_heads, kv_heads, d,
                                                            capacity))
    if not bands or bands[-1] != capacity or list(bands) != sorted(set(bands)) or bands[0] < 1:
        # the decoder relies on it: every position falls in exactly one band
        raise DeviceError(f"{keys.device.name}'s attention_decode_bands gave {bands} for a "
                          f"cache of {capacity}: not ascending bounds ending at the capacity")
    return bands


def _operand(x: NDArray, other, name: str, what: str, first: str) -> NDArray:
    """``other`` checked to be an NDArray on x's device (x is called ``first``)."""
    if not isinstance(other, NDArray):
        raise ArgumentTypeError(f"{name}: {what} must be an NDArray, got "
                                f"{type(other).__name__}")
    if other.device != x.device:
        raise DeviceError(f"{name}: {what} is on {other.device.name} and {first} on "
                          f"{x.device.name}; move one with .to(device)")
    return other


def _rows_of(x: NDArray, name: str, what: str) -> tuple[NDArray, int, int]:
    """(x compact, rows, dim) of x read as rows along its last axis."""
    if not isinstance(x, NDArray):
        raise ArgumentTypeError(f"{name}: {what} must be an NDArray, got {type(x).__name__}")
    if not dtypes.is_floating(x.dtype):
        raise DTypeError(f"{name}: {what} must be floating-point, got {x.dtype}")
    if x.ndim == 0:
        raise ShapeError(f"{name}: {what} needs at least one dimension")
    dim = x.shape[-1]
    return x.compact(), (x.size // dim if dim else 0), dim


def _matrix(x: NDArray, weight: NDArray | QuantizedMatrix, dim: int, name: str,
            factor: int = 1, first: str = "x") -> int:
    """Rows of the projection ``weight`` (out, dim), dense or packed, checked against x
    (called ``first``); ``factor`` 2 means gate rows then up rows, and the output has half of
    them. A dense weight shares x's dtype; a packed one needs an activation dtype of x."""
    packed = isinstance(weight, QuantizedMatrix)
    if packed:
        x._check_device(weight.qweight)
        _activation_dtype(x.dtype, name)
    else:
        _operand(x, weight, name, "weight", first)
    shape = weight.shape
    if len(shape) != 2 or shape[1] != dim or shape[0] % factor:
        what = "(2 * p, dim): gate rows then up rows" if factor == 2 else "(p, dim)"
        raise ShapeError(f"{name}: weight must be {what} with dim = {dim} ({first}'s last axis), "
                         f"got {'a packed ' if packed else ''}{shape}")
    if not packed and weight.dtype != x.dtype:
        raise DTypeError(f"{name}: weight ({weight.dtype}) and {first} ({x.dtype}) must have one "
                         "dtype; cast one with astype")
    return shape[0] // factor


def qk_rmsnorm(qkv: NDArray, q_weight: NDArray, k_weight: NDArray, q_heads: int,
               kv_heads: int, eps: float = 1e-6) -> NDArray:
    """The per-head RMSNorms of a fused query/key/value projection (Qwen3, Gemma 3), in one
    pass: ``qkv`` (..., (q_heads + 2 * kv_heads) * head_dim), each token's query heads, key
    heads, then value heads; returns its shape with every query head normed and scaled by
    ``q_weight`` (head_dim,), every key head by ``k_weight``, the values as they are. The
    numbers of ``rmsnorm`` on each head (see ``numpy_ref.qk_rmsnorm``)."""
    for w in (q_weight, k_weight):
        qkv._check_device(w)
    if not (_is_int(q_heads) and _is_int(kv_heads)) or q_heads <= 0 or kv_heads <= 0:
        raise ShapeError(f"qk_rmsnorm: q_heads and kv_heads must be positive ints, got "
                         f"{q_heads!r} and {kv_heads!r}")
    heads = q_heads + 2 * kv_heads
    if qkv.ndim < 1 or qkv.shape[-1] % heads:
        raise ShapeError(f"qk_rmsnorm: qkv's last axis ({qkv.shape}) must hold {q_heads} + 2 x "
                         f"{kv_heads} heads of one size")
    d = qkv.shape[-1] // heads
    if q_weight.shape != (d,) or k_weight.shape != (d,):
        raise ShapeError(f"qk_rmsnorm: the weights must be ({d},) for heads of {d}, got "
                         f"{q_weight.shape} and {k_weight.shape}")
    if not dtypes.is_floating(qkv.dtype):
        raise DTypeError(f"qk_rmsnorm needs a floating-point qkv, got {qkv.dtype}")
    a = qkv.compact()
    qw, kw = (w.astype(a.dtype).compact() for w in (q_weight, k_weight))
    out = a._empty_like()
    rows = a.size // d
    if rows:
        a.device.backend.qk_rmsnorm(a._handle, qw._handle, kw._handle, out._handle, rows,
                                    q_heads, kv_heads, d, float(eps))
    return out


def rmsnorm_matvec(x: NDArray, norm_weight: NDArray | None, weight: NDArray | QuantizedMatrix,
                   eps: float = 1e-6, activation: str | None = None) -> NDArray:
    """``rmsnorm(x) * norm_weight @ weight.T`` in one pass: shape (..., p) for weight
    (p, dim). With ``activation="swiglu"``, weight is (2p, dim), gate rows then up rows,
    and the result is ``silu(gate) * up`` (..., p). Rounded as the separate ops would be
    (with a packed weight: as ``quant_matmul`` of the rounded norm).

    ``norm_weight=None``: the norm's scale is already folded into weight's columns
    (``weight * norm_weight``, rounded once, as the model does at load where the backend
    declares ``folded_norm_matvec``). The result is then ``r * (weight @ x)`` with
    r = 1 / sqrt(mean(x^2) + eps) and the normed vector never rounded (one pass over the
    weights, the sum of squares taken from the values the product already reads); backends
    without the capability compute ``rmsnorm(x)`` (rounded to x's dtype) and the product,
    which differs from it only by that rounding. Dense weights only."""
    if activation not in (None, "swiglu"):
        raise ArgumentError(f"rmsnorm_matvec: activation must be None or 'swiglu', got "
                         f"{activation!r}")
    name = "rmsnorm_matvec"
    a, rows, dim = _rows_of(x, name, "x")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise ArgumentTypeError(f"{name}: eps must be a real number, got {type(eps).__name__}")
    swiglu, eps = activation == "swiglu", float(eps)
    p = _matrix(x, weight, dim, name, 2 if swiglu else 1)
    packed = isinstance(weight, QuantizedMatrix)
    if norm_weight is None:
        return _folded_norm_matvec(x, a, rows, dim, weight, p, eps, swiglu)
    w = x._param(_operand(x, norm_weight, name, "norm_weight", "x"), dim, f"{name} norm_weight")
    if packed and not has(weight._backend(), "fused_quant_matvec"):
        y = quant_matmul(x.rmsnorm(w, eps), weight)  # composed, with the same roundings
        return y.swiglu() if swiglu else y
    out = a._empty_like(a.shape[:-1] + (p,))
    if out.size and dim:
        if packed:
            weight._backend().quant_rmsnorm_matvec(
                a._handle, w._handle, weight.qweight.handle, weight.scales.handle,
                _h(weight.offsets), out._handle, rows, dim, p, eps, weight.spec.bits,
                weight.spec.group_size, swiglu)
        else:
            kernel = "rmsnorm_matvec_swiglu" if swiglu else "rmsnorm_matvec"
            getattr(x.device.backend, kernel)(a._handle, w._handle, weight.compact()._handle,
                                              out._handle, rows, dim, p, eps)
    elif out.size:
        out.fill(0)
    return out


def _folded_norm_matvec(x: NDArray, a: NDArray, rows: int, dim: int, weight, p: int,
                        eps: float, swiglu: bool) -> NDArray:
    """rmsnorm_matvec with the norm's scale in weight (norm_weight None)."""
    if isinstance(weight, QuantizedMatrix):
        raise ArgumentError("rmsnorm_matvec: norm_weight=None (a scale folded into the "
                            "weight) needs a dense weight; pass the norm weight with a "
                            "packed one")
    backend = x.device.backend
    if rows == 1 and dim and has(backend, "folded_norm_matvec"):
        out = a._empty_like(a.shape[:-1] + (p,))
        backend.folded_rmsnorm_matvec(a._handle, weight.compact()._handle, out._handle, dim,
                                      p, eps, swiglu)
        return out
    h = a.rmsnorm(ones((dim,), a.dtype, a.device), eps)
    if swiglu:
        return matmul_swiglu(h, weight)
    return h @ weight.transpose()


def matvec_add(a: NDArray, weight: NDArray | QuantizedMatrix, total: NDArray) -> NDArray:
    """``total += a @ weight.T`` in place (the product rounded first, as ``total + a @
    weight.T`` would be) and returns total: a projection added into the residual stream.
    a (..., dim), weight (p, dim), total (..., p) compact, with a's leading shape."""
    name = "matvec_add"
    x, rows, dim = _rows_of(a, name, "a")
    quantized = isinstance(weight, QuantizedMatrix)
    p = _matrix(a, weight, dim, name, first="a")
    _operand(a, total, name, "total", "a")
    if total.shape != a.shape[:-1] + (p,):
        raise ShapeError(f"{name}: total must have shape {a.shape[:-1] + (p,)}, got "
                         f"{total.shape}")
    if total.dtype != a.dtype:
        raise DTypeError(f"{name}: total ({total.dtype}) and a ({a.dtype}) must have one dtype")
    if not total.is_compact():
        raise ShapeError(f"{name} writes total in place: pass a compact array")
    if not (total.size and dim):
        return total
    if not quantized:
        a.device.backend.matvec_add(x._handle, weight.compact()._handle, total._handle, rows,
                                    dim, p)
        return total
    backend = weight._backend()
    if not has(backend, "fused_quant_matvec"):
        total += quant_matmul(x, weight)  # rounded before the add, as the fused form
        return total
    backend.quant_matvec_add(x._handle, weight.qweight.handle, weight.scales.handle,
                             _h(weight.offsets), total._handle, rows, dim, p,
                             weight.spec.bits, weight.spec.group_size)
    return total
