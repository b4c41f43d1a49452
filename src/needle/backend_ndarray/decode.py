"""The decode step's fused projections (``nd.rmsnorm_matvec``, ``nd.matvec_add``).

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

import numbers

from ..backends.api import has
from ..errors import ArgumentError, ArgumentTypeError, DeviceError, DTypeError, ShapeError
from . import dtypes
from .functions import matmul_swiglu
from .ndarray import NDArray, ones
from .quant import QuantizedMatrix, _activation_dtype, _h, quant_matmul


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
