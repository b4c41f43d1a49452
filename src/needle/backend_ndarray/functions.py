"""needle's module-level array functions (``nd.where``, ``nd.stack``, ``nd.concatenate``,
``nd.attention``, ``nd.from_dlpack``, ...) over NDArray: the ones that combine several arrays
or call fused kernels, and the course's function-style aliases of NDArray methods."""

from __future__ import annotations

import builtins
import math
import numbers
from functools import reduce

import numpy as np

from ..backends.api import has
from ..errors import (
    ArgumentError,
    DeviceError,
    DTypeError,
    ShapeError,
)
from . import dtypes
from .device import Device, cpu_numpy
from .ndarray import (
    NDArray,
    _normalize_axes,
    broadcast_shapes,
    full,
    zeros,
)
from .transformer_ops import _as_index_array


def broadcast_to(a: NDArray, shape) -> NDArray:
    return a.broadcast_to(shape)


def reshape(a: NDArray, shape) -> NDArray:
    return a.reshape(shape)


def maximum(a: NDArray, b) -> NDArray:
    return a.maximum(b)


def minimum(a: NDArray, b) -> NDArray:
    return a.minimum(b)


def log(a: NDArray) -> NDArray:
    return a.log()


def exp(a: NDArray) -> NDArray:
    return a.exp()


def tanh(a: NDArray) -> NDArray:
    return a.tanh()


def sqrt(a: NDArray) -> NDArray:
    return a.sqrt()


def sum(a: NDArray, axis=None, keepdims: bool = False) -> NDArray:  # noqa: A001
    return a.sum(axis=axis, keepdims=keepdims)


def max(a: NDArray, axis=None, keepdims: bool = False) -> NDArray:  # noqa: A001
    return a.max(axis=axis, keepdims=keepdims)


def flip(a: NDArray, axes=None) -> NDArray:
    return a.flip(axes)


def transpose(a: NDArray, axes=None) -> NDArray:
    return a.transpose(axes)


def where(cond: NDArray, a, b) -> NDArray:
    """Elements of ``a`` where ``cond`` is true, else of ``b`` (all broadcast together)."""
    dev = cond.device
    a = a if isinstance(a, NDArray) else full((), a, dtypes.promote_scalar("bool", a)
                                              if not isinstance(b, NDArray) else b.dtype, dev)
    b = b if isinstance(b, NDArray) else full((), b, a.dtype, dev)
    cond._check_device(a)
    cond._check_device(b)
    dt = dtypes.promote(a.dtype, b.dtype)
    shape = broadcast_shapes(cond.shape, a.shape, b.shape)
    c = cond.astype("bool").broadcast_to(shape).compact()
    a = a.astype(dt).broadcast_to(shape).compact()
    b = b.astype(dt).broadcast_to(shape).compact()
    out = NDArray.make(shape, device=dev, dtype=dt)
    if out.size:
        dev.backend.where(c._handle, a._handle, b._handle, out._handle)
    return out


def stack(arrays, axis: int = 0) -> NDArray:
    arrays = list(arrays)
    if not arrays:
        raise ShapeError("stack needs at least one array")
    shape = arrays[0].shape
    for a in arrays:
        arrays[0]._check_device(a)
        if a.shape != shape:
            raise ShapeError(f"stack needs arrays of one shape, got {shape} and {a.shape}")
    axis = _normalize_axes(axis, len(shape) + 1)[0]
    dt = reduce(dtypes.promote, (a.dtype for a in arrays))
    out = NDArray.make(shape[:axis] + (len(arrays),) + shape[axis:], device=arrays[0].device,
                       dtype=dt)
    for i, a in enumerate(arrays):
        out[(slice(None),) * axis + (i,)] = a
    return out


def concatenate(arrays, axis: int = 0) -> NDArray:
    arrays = list(arrays)
    if not arrays:
        raise ShapeError("concatenate needs at least one array")
    if not all(isinstance(a, NDArray) for a in arrays):
        raise DTypeError("concatenate takes NDArrays")
    first = arrays[0]
    if any(a.ndim == 0 for a in arrays):
        raise ShapeError("concatenate needs arrays of at least one dimension (0-d arrays have "
                         "no axis to join along); use stack for scalars")
    axis = _normalize_axes(axis, first.ndim)[0]
    for a in arrays:
        first._check_device(a)
        if a.ndim != first.ndim or any(a.shape[i] != first.shape[i]
                                       for i in range(first.ndim) if i != axis):
            raise ShapeError(f"concatenate: shapes {first.shape} and {a.shape} differ off "
                             f"axis {axis}")
    dt = reduce(dtypes.promote, (a.dtype for a in arrays))
    total = builtins.sum(a.shape[axis] for a in arrays)
    out = NDArray.make(first.shape[:axis] + (total,) + first.shape[axis + 1:],
                       device=first.device, dtype=dt)
    start = 0
    for a in arrays:
        out[(slice(None),) * axis + (slice(start, start + a.shape[axis]),)] = a
        start += a.shape[axis]
    return out


def scatter_add(indices, values: NDArray, rows: int, out: NDArray | None = None) -> NDArray:
    """A (rows, dim) array of zeros with ``values[i]`` added at row ``indices[i]``.

    With ``out`` (a compact (rows, dim) array of the values' dtype and device) the values
    are added into it in place instead: a write at positions held in device memory, which
    is how a captured decode step stores keys and values at the current position.
    """
    idx = _as_index_array(indices, values.device, rows, "scatter_add").reshape(-1)
    dim = values.shape[-1] if values.ndim else 1
    if values.size != idx.size * dim:
        raise ShapeError(f"scatter_add: {idx.size} indices need values of shape "
                         f"({idx.size}, {dim}), got {values.shape}")
    if out is None:
        out = zeros((rows, dim), dtype=values.dtype, device=values.device)
    else:
        values._check_device(out)
        if out.shape != (rows, dim) or not out.is_compact() or out.dtype != values.dtype:
            raise ShapeError(f"scatter_add: out must be a compact ({rows}, {dim}) array of "
                             f"{values.dtype}, got {out.shape} of {out.dtype}"
                             + ("" if out.is_compact() else " (not compact)"))
    if idx.size:
        values.device.backend.scatter_add(idx.compact()._handle, values.compact()._handle,
                                          out._handle, rows, dim)
    return out


def window_arg(window, op: str, keys: int | None = None) -> int:
    """A sliding window argument as the backends take it: a positive int, or 0 for None or
    for a window of at least ``keys`` positions (it binds nowhere); ArgumentError otherwise."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1:
        raise ArgumentError(f"{op}: window must be a positive int or None, got {window!r}")
    return 0 if keys is not None and window >= keys else int(window)


def softcap_arg(softcap, op: str) -> float:
    """A soft cap of attention scores as the backends take it: a positive finite number, or
    0.0 for None; ArgumentError otherwise."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or \
            not math.isfinite(softcap) or softcap <= 0:
        raise ArgumentError(f"{op}: softcap must be a positive number or None, got "
                            f"{softcap!r}")
    return float(softcap)


def _attention_shapes(q: NDArray, k: NDArray, v: NDArray, kv_len: int | None,
                      causal: bool) -> tuple[int, int, int, int, int, int, int]:
    """attention's checks; (batch, q_heads, q_len, head_dim, kv_heads, capacity, kv_len)."""
    for t in (k, v):
        q._check_device(t)
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ShapeError(f"attention needs 4-d q, k, v with k and v of one shape; got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    bsz, hq, sq, d = q.shape
    bk, hkv, cap, dk = k.shape
    if bk != bsz or dk != d:
        raise ShapeError(f"attention: q {q.shape} and k {k.shape} differ in batch or head_dim")
    if hkv == 0 or hq % hkv:
        raise ShapeError(f"attention: {hq} query heads are not a multiple of {hkv} kv heads")
    kv_len = cap if kv_len is None else kv_len
    if not 0 < kv_len <= cap or (causal and kv_len < sq):
        raise ShapeError(f"attention: kv_len {kv_len} must be in 1..{cap}"
                         + (f" and at least q_len {sq} when causal" if causal else ""))
    if not dtypes.is_floating(q.dtype):
        raise DTypeError(f"attention needs floating-point arrays, got {q.dtype}")
    return bsz, hq, sq, d, hkv, cap, kv_len


def attention_with_stats(q: NDArray, k: NDArray, v: NDArray, scale: float | None = None,
                         causal: bool = False) -> tuple[NDArray, NDArray | None]:
    """``attention(q, k, v, scale, causal)`` and, where the backend can (capability
    ``attention_backward``, arrays it supports), each query row's max score and 1 / sum of
    exponentials, which ``attention_backward`` then reads instead of recomputing them (a
    training step's forward: ``ops.scaled_dot_product_attention`` asks for them when a
    gradient may follow). (output, None) elsewhere."""
    bsz, hq, sq, d, hkv, cap, kv_len = _attention_shapes(q, k, v, None, causal)
    backend = q.device.backend
    if not has(backend, "attention_backward") or not q.size or k.dtype != q.dtype \
            or v.dtype != q.dtype:
        return attention(q, k, v, scale, causal), None
    q_row = _token_major_rows(q)
    q_rows = (sq * q_row, d, q_row) if q_row is not None else (hq * sq * d, sq * d, d)
    out_rows = (sq * hq * d, d, hq * d)
    # k and v as they are where their rows are contiguous (a model's token-major projections
    # seen heads-first), else compacted
    kc, vc = (_rows_contiguous(t, offset=False) for t in (k, v))
    kv_rows = (*kc.strides[:3], *vc.strides[:3])
    if not backend.attention_backward_supported(q.dtype, d, q_rows + out_rows + kv_rows):
        return attention(q, k, v, scale, causal), None
    qc = q if q_row is not None else q.compact()
    out = NDArray.make((bsz, sq, hq, d), device=q.device, dtype=q.dtype)
    stats = NDArray.make((2 * bsz * hq * sq,), device=q.device, dtype="float32")
    scale = 1 / math.sqrt(d) if scale is None else float(scale)
    backend.attention_with_stats(qc._handle, kc._handle, vc._handle, out._handle, stats._handle,
                                 bsz, hq, hkv, sq, kv_len, d, scale, bool(causal), q_rows,
                                 out_rows, kv_rows)
    return out.permute((0, 2, 1, 3)), stats


def attention(q: NDArray, k: NDArray, v: NDArray, scale: float | None = None,
              causal: bool = False, kv_len: int | None = None,
              window: int | None = None, softcap: float | None = None) -> NDArray:
    """softmax(q kᵀ · scale) v with grouped-query heads.

    q is (batch, q_heads, q_len, head_dim); k and v are (batch, kv_heads, capacity,
    head_dim), of which the first ``kv_len`` positions (default: all) are attended to.
    k and v may be views of a larger cache along the capacity axis. ``window`` (a positive
    int, with ``causal``): a sliding window, the query at position i seeing keys
    i - window + 1..i only. ``softcap`` (a positive number; None: none): the scaled scores s
    soft-capped to softcap · tanh(s / softcap) before the mask and softmax (Gemma 2).
    """
    bsz, hq, sq, d, hkv, capacity, kv_len = _attention_shapes(q, k, v, kv_len, causal)
    if window is not None and not causal:
        raise ArgumentError(f"attention: a window ({window!r}) needs causal=True")
    window = window_arg(window, "attention", kv_len)
    cap = softcap_arg(softcap, "attention")
    scale = 1 / math.sqrt(d) if scale is None else float(scale)
    kc, vc = k.astype(q.dtype).compact(), v.astype(q.dtype).compact()
    backend = q.device.backend
    q_row = _token_major_rows(q)
    if q_row is not None and q.size and has(backend, "token_major_attention"):
        # q is a heads-first view of token-major rows (a prefill's fused QKV projection):
        # the backend reads them as they are and writes the output token-major too, so
        # neither needs a heads-first copy; the result is the heads-first view of it
        out = NDArray.make((bsz, sq, hq, d), device=q.device, dtype=q.dtype)
        backend.attention_token_major(q._handle, kc._handle, vc._handle, out._handle, bsz, hq,
                                      hkv, sq, kv_len, capacity, d, scale, bool(causal), q_row,
                                      window, softcap=cap)
        return out.permute((0, 2, 1, 3))
    qc = q.compact()
    out = qc._empty_like()
    if out.size:
        backend.attention(qc._handle, kc._handle, vc._handle, out._handle, bsz, hq, hkv,
                          sq, kv_len, capacity, d, scale, bool(causal), window, softcap=cap)
    return out


def attention_backward(q: NDArray, k: NDArray, v: NDArray, out: NDArray, dout: NDArray,
                       scale: float | None = None, causal: bool = False,
                       stats: NDArray | None = None) -> tuple[NDArray, NDArray, NDArray] | None:
    """(dq, dk, dv), the gradients of ``out = attention(q, k, v, scale, causal)`` given the
    output's gradient ``dout``, in one backend call (capability ``attention_backward``:
    numpy_ref/nn.py defines the numbers); None where the backend lacks it or does not
    support these arrays (``attention_backward_supported``), and the caller composes the
    gradients from products and a softmax.

    q, out and dout are (batch, q_heads, q_len, head_dim), k and v (batch, kv_heads, kv_len,
    head_dim), all of one floating dtype; views whose rows are contiguous (a model's
    token-major projections seen heads-first) are read as they are. The gradients are
    heads-first views of token-major arrays, as ``attention`` returns its output. ``stats``:
    what ``attention_with_stats`` gave with this ``out`` (the backend then need not
    recompute them).
    """
    backend = q.device.backend
    if not has(backend, "attention_backward"):
        return None
    for t in (k, v, out, dout):
        q._check_device(t)
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or out.shape != q.shape \
            or dout.shape != q.shape:
        raise ShapeError(f"attention_backward needs 4-d q, k, v, out, dout with k and v of one "
                         f"shape and out, dout of q's; got {q.shape}, {k.shape}, {v.shape}, "
                         f"{out.shape}, {dout.shape}")
    bsz, hq, sq, d = q.shape
    bk, hkv, skv, kd = k.shape
    if bk != bsz or kd != d or hkv == 0 or hq % hkv or (causal and skv < sq):
        raise ShapeError(f"attention_backward: q {q.shape} and k {k.shape} differ in batch or "
                         "head_dim, or the query heads are not a multiple of the KV heads, or "
                         "a causal kv_len is shorter than q_len")
    if any(t.dtype != q.dtype for t in (k, v, out, dout)) or not dtypes.is_floating(q.dtype):
        raise DTypeError("attention_backward needs q, k, v, out and dout of one floating dtype")
    if not q.size or not k.size:
        return None
    scale = 1 / math.sqrt(d) if scale is None else float(scale)
    inputs = [_rows_contiguous(t) for t in (q, k, v, out, dout)]
    grads = [NDArray.make((bsz, n, h, d), device=q.device, dtype=q.dtype)
             for n, h in ((sq, hq), (skv, hkv), (skv, hkv))]
    rows = tuple(s for t in inputs for s in t.strides[:3])
    rows += tuple(s for g in grads for s in (g.strides[0], g.strides[2], g.strides[1]))
    rows += tuple(t.offset for t in inputs + grads)
    if not backend.attention_backward_supported(q.dtype, d, rows):
        return None
    backend.attention_backward(*(t._handle for t in inputs + grads), bsz, hq, hkv, sq, skv, d,
                               scale, bool(causal), rows,
                               None if stats is None else stats._handle)
    dq, dk, dv = (g.permute((0, 2, 1, 3)) for g in grads)
    return dq, dk, dv


def _rows_contiguous(t: NDArray, offset: bool = True) -> NDArray:
    """``t`` itself where each row (its last axis) is contiguous and no stride is negative
    (and, unless ``offset``, it starts at its buffer's first element), else a compact copy:
    what the attention kernels that read rows through strides take."""
    if t.strides[-1] == 1 and min(t.strides) >= 0 and (offset or t.offset == 0):
        return t
    return t.compact()


def _token_major_rows(q: NDArray) -> int | None:
    """The elements between q's positions when q (batch, heads, len, d) is a view of
    token-major rows starting at its buffer's first element (query head h of position i in
    batch b at (b * len + i) * row + h * d, row >= heads * d); else None."""
    bsz, hq, sq, d = q.shape
    row = q.strides[2]
    if (q.offset or q.strides[1] != d or q.strides[3] != 1 or row < hq * d
            or (bsz > 1 and q.strides[0] != sq * row) or q._handle.size < bsz * sq * row):
        return None
    return row


def matmul_swiglu(x: NDArray, weight: NDArray) -> NDArray:
    """swiglu(x @ weightᵀ): x (..., n) and a fused gate/up projection weight (2p, n), gate
    rows first, to (..., p). The same numbers as ``(x @ weight.T).swiglu()`` (the product is
    rounded to the dtype first); a backend with capability ``matmul_swiglu`` does both in
    one pass and never writes the (..., 2p) product."""
    return _matmul_glu(x, weight, "swiglu")


def matmul_geglu(x: NDArray, weight: NDArray) -> NDArray:
    """``matmul_swiglu`` with Gemma's GeGLU: ``(x @ weight.T).geglu()``'s numbers, in one
    pass where the backend has capability ``matmul_geglu`` (CUDA: one row, a decode step)."""
    return _matmul_glu(x, weight, "geglu")


def _matmul_glu(x: NDArray, weight: NDArray, act: str) -> NDArray:
    name = f"matmul_{act}"
    x._check_device(weight)
    if weight.ndim != 2 or weight.shape[0] % 2 or x.ndim == 0 or x.shape[-1] != weight.shape[1]:
        raise ShapeError(f"{name}: x {x.shape} and a fused gate/up weight {weight.shape} "
                         "(2p, n) must share n, and the weight needs an even number of rows")
    if x.dtype != weight.dtype or not dtypes.is_floating(x.dtype):
        raise DTypeError(f"{name}: x ({x.dtype}) and weight ({weight.dtype}) must be "
                         "floating-point arrays of one dtype")
    backend = x.device.backend
    if not has(backend, name):
        return getattr(x @ weight.transpose(), act)()
    n, p = weight.shape[1], weight.shape[0] // 2
    a, w = x.compact(), weight.compact()
    m = a.size // n if n else 0
    out = NDArray.make(x.shape[:-1] + (p,), device=x.device, dtype=x.dtype)
    if out.size:
        if n == 0:  # sums of nothing: act(0) * 0
            out.fill(0)
        else:
            getattr(backend, name)(a._handle, w._handle, out._handle, m, n, p)
    return out


def add_rmsnorm(x: NDArray, delta: NDArray, weight: NDArray, eps: float = 1e-6,
                inplace: bool = False,
                delta_weight: NDArray | None = None) -> tuple[NDArray, NDArray]:
    """(x + delta, rmsnorm(x + delta) * weight) in one pass over the rows: a transformer's
    residual add and the next pre-norm. The sum is rounded to the dtype before it is
    normalized, exactly as ``rmsnorm(x + delta)``. With ``inplace`` the sum is written into
    ``x`` (which must then be compact) and x is returned as the first result.

    ``delta_weight``: delta is first ``rmsnorm(delta) * delta_weight`` (rounded, as
    ``delta.rmsnorm(delta_weight)``): Gemma 2's and 3's sandwich norms, where a block's
    output is normed before it joins the residual stream; one pass instead of two."""
    x._check_device(delta)
    if x.shape != delta.shape:
        raise ShapeError(f"add_rmsnorm: x {x.shape} and delta {delta.shape} must have one shape")
    if x.dtype != delta.dtype:
        raise DTypeError(f"add_rmsnorm: x ({x.dtype}) and delta ({delta.dtype}) must have one "
                         "dtype; cast one with astype")
    a, dim = x._rows("add_rmsnorm")
    if inplace and a is not x:
        raise ShapeError("add_rmsnorm(inplace=True) needs a compact x; pass a compact array "
                         "or inplace=False")
    w = x._param(weight, dim, "add_rmsnorm weight")
    dw = None if delta_weight is None else x._param(delta_weight, dim,
                                                    "add_rmsnorm delta_weight")
    d = delta.compact()
    total = a if inplace else a._empty_like()
    out = a._empty_like()
    if a.size and dw is None:
        x.device.backend.add_rmsnorm(a._handle, d._handle, w._handle, total._handle,
                                     out._handle, dim, float(eps))
    elif a.size:
        x.device.backend.add_rmsnorm_post(a._handle, d._handle, dw._handle, w._handle,
                                          total._handle, out._handle, dim, float(eps))
    return total, out


# DLPack device types (dlpack.h's DLDeviceType) -> needle's device kinds
_DLPACK_KINDS = {2: "cuda", 8: "metal"}
_DLPACK_NAMES = {4: "OpenCL", 7: "Vulkan", 9: "VPI", 10: "ROCm", 13: "CUDA managed",
                 14: "oneAPI", 15: "WebGPU", 16: "Hexagon", 17: "MAIA"}


def _dlpack_device(dev_type: int, dev_id: int) -> Device:
    """The needle device that owns memory of a DLPack (device type, id), from the producer's
    ``__dlpack_device__``; DeviceError for a kind of memory needle has no device for."""
    kind = _DLPACK_KINDS.get(dev_type)
    if kind is None:
        name = _DLPACK_NAMES.get(dev_type, f"type {dev_type}")
        raise DeviceError(f"this DLPack tensor lives on a {name} device (id {dev_id}), which "
                          "needle has no backend for; move it to the CPU or a CUDA device "
                          "first")
    from .device import device_from_name

    return device_from_name(f"{kind}:{dev_id}" if kind == "cuda" else kind)


def from_dlpack(x, device: Device | None = None) -> NDArray:
    """Wrap a DLPack-exporting array (numpy, PyTorch, CuPy) without copying where possible.

    Host memory is shared with a CPU device when its strides are non-negative; device
    memory is imported by the backend that owns that kind of device.
    """
    if not hasattr(x, "__dlpack__"):
        raise DTypeError(f"from_dlpack needs an object that exports DLPack (__dlpack__), "
                         f"such as a numpy array or a torch tensor, not {type(x).__name__}")
    dev_type, dev_id = x.__dlpack_device__() if hasattr(x, "__dlpack_device__") else (1, 0)
    if dev_type not in (1, 3):  # kDLCPU, kDLCUDAHost: memory the host reads directly
        target = device or _dlpack_device(dev_type, dev_id)
        if not has(target.backend, "dlpack"):
            raise DeviceError(f"{target.name} cannot import DLPack tensors; pass a device "
                              "whose arrays can be exchanged (a CUDA device)")
        return target.backend.from_dlpack(x, NDArray)
    try:
        host = np.from_dlpack(x)
    except (RuntimeError, BufferError) as e:  # e.g. bfloat16, which numpy's DLPack import
        # does not know (older numpy raises RuntimeError, newer BufferError)
        raise DTypeError(f"cannot import this array through DLPack ({e}); convert it to "
                         "float32, float16, int32, int64 or bool first") from None
    target = device or cpu_numpy()
    dt = dtypes.canonical(host.dtype)
    item = host.itemsize
    if (not has(target.backend, "host_memory") or host.size == 0
            or any(s < 0 or s % item for s in host.strides)):
        return NDArray(host, device=target, dtype=dt)
    strides = tuple(s // item for s in host.strides)
    span = builtins.sum(s * (d - 1) for s, d in zip(strides, host.shape)) + 1
    flat = np.lib.stride_tricks.as_strided(host, (span,), (item,))
    return NDArray.make(host.shape, strides, target, target.backend.wrap(flat, dt), 0, dt)


