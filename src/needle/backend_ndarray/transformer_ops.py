"""NDArray's transformer and indexing functions: softmax, log_softmax, rmsnorm, layernorm,
rope, silu_mul, swiglu, geglu and take (a mixin of NDArray, split from ndarray.py for its length).
Each checks its operands and calls the backend function of the same name
(``numpy_ref/nn.py`` defines them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..backends.api import has
from ..errors import DeviceError, DTypeError, IndexOutOfRangeError, ShapeError
from . import dtypes

if TYPE_CHECKING:
    from .ndarray import NDArray


class TransformerOps:
    """Methods NDArray mixes in; they use its ``_be``, ``_handle``, ``_empty_like``,
    ``_check_device``, ``compact`` and ``astype``."""

    __slots__ = ()

    def _rows(self, name: str) -> tuple[NDArray, int]:
        if not dtypes.is_floating(self.dtype):
            raise DTypeError(f"{name} needs a floating-point array, got {self.dtype}")
        if self.ndim == 0:
            raise ShapeError(f"{name} needs at least one dimension")
        return self.compact(), self.shape[-1]

    def _along_rows(self, name: str) -> NDArray:
        """The backend's row function ``name`` (x, out, dim) over the last axis."""
        a, dim = self._rows(name)
        out = a._empty_like()
        if a.size:
            getattr(self._be, name)(a._handle, out._handle, dim)
        return out

    def softmax(self) -> NDArray:
        """Softmax over the last axis."""
        return self._along_rows("softmax")

    def log_softmax(self) -> NDArray:
        """log(softmax(x)) over the last axis, computed stably."""
        return self._along_rows("log_softmax")

    def rmsnorm(self, weight: NDArray, eps: float = 1e-6) -> NDArray:
        a, dim = self._rows("rmsnorm")
        w = self._param(weight, dim, "rmsnorm weight")
        out = a._empty_like()
        if a.size:
            self._be.rmsnorm(a._handle, w._handle, out._handle, dim, float(eps))
        return out

    def layernorm(self, weight: NDArray, bias: NDArray, eps: float = 1e-5) -> NDArray:
        a, dim = self._rows("layernorm")
        w = self._param(weight, dim, "layernorm weight")
        b = self._param(bias, dim, "layernorm bias")
        out = a._empty_like()
        if a.size:
            self._be.layernorm(a._handle, w._handle, b._handle, out._handle, dim, float(eps))
        return out

    def _param(self, p: NDArray, dim: int, what: str) -> NDArray:
        self._check_device(p)
        if p.shape != (dim,):
            raise ShapeError(f"{what} must have shape ({dim},), got {p.shape}")
        return p.astype(self.dtype).compact()

    def rope(self, cos: NDArray, sin: NDArray) -> NDArray:
        """Rotary embedding (half-split) of x shaped (batch, seq, heads, head_dim)."""
        a, d = self._rows("rope")
        if a.ndim != 4 or d % 2:
            raise ShapeError(f"rope needs x of shape (batch, seq, heads, head_dim) with an even "
                             f"head_dim, got {self.shape}")
        bsz, seq, heads, _ = a.shape
        for t, nm in ((cos, "cos"), (sin, "sin")):
            self._check_device(t)
            if t.shape != (seq, d // 2):
                raise ShapeError(f"rope {nm} must have shape ({seq}, {d // 2}), got {t.shape}")
        c, s = cos.astype(a.dtype).compact(), sin.astype(a.dtype).compact()
        out = a._empty_like()
        if a.size:
            self._be.rope(a._handle, c._handle, s._handle, out._handle, bsz, seq, heads, d)
        return out

    def silu_mul(self, other: NDArray) -> NDArray:
        """silu(self) * other, the SwiGLU gate."""
        self._check_device(other)
        if self.shape != other.shape:
            raise ShapeError(f"silu_mul needs equal shapes, got {self.shape} and {other.shape}")
        a, _ = self._rows("silu_mul")
        b = other.astype(a.dtype).compact()
        out = a._empty_like()
        if a.size:
            self._be.silu_mul(a._handle, b._handle, out._handle)
        return out

    def swiglu(self) -> NDArray:
        """silu(first half) * second half along the last axis: SwiGLU of a fused gate-and-up
        projection (..., 2 * dim) -> (..., dim), without copying the halves apart."""
        return self._gated("swiglu")

    def geglu(self) -> NDArray:
        """gelu_tanh(first half) * second half along the last axis: GeGLU (Gemma) of a fused
        gate-and-up projection (..., 2 * dim) -> (..., dim), in one pass."""
        return self._gated("geglu")

    def _gated(self, op: str) -> NDArray:
        """The backend's gated-MLP function ``op`` (swiglu, geglu) of the last axis' halves."""
        a, two = self._rows(op)
        if two % 2:
            raise ShapeError(f"{op} needs an even last axis (gate and up halves), got "
                             f"{self.shape}")
        out = type(self).make(a.shape[:-1] + (two // 2,), device=self.device, dtype=a.dtype)
        if out.size:
            getattr(self._be, op)(a._handle, out._handle, two // 2)
        return out

    def take(self, indices: NDArray) -> NDArray:
        """Rows of this (rows, dim) table at ``indices`` (any shape): indices.shape + (dim,)."""
        if self.ndim != 2:
            raise ShapeError(f"take needs a 2-d table, got shape {self.shape}")
        rows, dim = self.shape
        idx = _as_index_array(indices, self.device, rows, "take")
        table = self.compact()
        out = type(self).make(idx.shape + (dim,), device=self.device, dtype=self.dtype)
        if out.size:
            self._be.take(table._handle, idx.compact()._handle, out._handle, rows, dim)
        return out


def _as_index_array(indices, device, rows: int, what: str) -> NDArray:
    """``indices`` as an int32/int64 NDArray on ``device``, range-checked against ``rows``.

    Indices from the host are checked before upload, and arrays in host memory (capability
    ``host_memory``) where that is free. Device arrays on a GPU are not (reading them back
    would stall the queue and break a captured decode step): there an out-of-range index
    gives a row of zeros (take) or is skipped (scatter_add), as docs/kernels.md says.
    """
    from .ndarray import NDArray  # the class that mixes these in

    if not isinstance(indices, NDArray):
        host = np.asarray(indices)
        if host.dtype.kind in "iu" and host.size:
            _check_range(int(host.min()), int(host.max()), rows, what)
        indices = NDArray(host, device=device)
    elif indices.size and has(device.backend, "host_memory"):
        _check_range(indices.min().item(), indices.max().item(), rows, what)
    if indices.dtype not in ("int32", "int64"):
        raise DTypeError(f"indices must be int32 or int64, got {indices.dtype}")
    if indices.device != device:
        raise DeviceError(f"indices are on {indices.device.name}, the table on {device.name}")
    return indices


def _check_range(lo: int, hi: int, rows: int, what: str) -> None:
    if lo < 0 or hi >= rows:
        raise IndexOutOfRangeError(f"{what}: index {lo if lo < 0 else hi} is out of range for "
                                   f"a table of {rows} rows")
