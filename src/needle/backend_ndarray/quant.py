"""``QuantizedMatrix`` and ``quant_matmul``: weight-only quantized matrices on a device.

The packed format is ``needle.quant.format``'s (docs/quantization.md): int32 words of int8 or
int4 values, float32 scales per row and group, optional float32 offsets. Checks happen here,
so a backend (capabilities ``int8``/``int4``, reference ``numpy_ref/quant.py``) only sees
compact buffers of the dtypes it expects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..backends.api import has
from ..errors import DeviceError, DTypeError, ShapeError
from ..quant.format import QuantSpec, quantize
from . import dtypes
from .device import Device
from .functions import concatenate
from .ndarray import NDArray, array

ACTIVATION_DTYPES = ("float16", "bfloat16", "float32")


@dataclass
class QuantizedMatrix:
    """A matrix (n, k) stored packed: ``qweight`` int32 (n, words), ``scales`` float32
    (n, groups), ``offsets`` float32 (n, groups) or None, all on one device."""

    qweight: NDArray
    scales: NDArray
    offsets: NDArray | None
    spec: QuantSpec
    shape: tuple[int, int]

    def __post_init__(self):
        n, k = self.shape
        want = {"qweight": (self.qweight, (n, self.spec.words(k)), "int32"),
                "scales": (self.scales, (n, self.spec.groups(k)), "float32")}
        if self.spec.has_offsets:
            want["offsets"] = (self.offsets, want["scales"][1], "float32")
        elif self.offsets is not None:
            raise ShapeError("QuantizedMatrix: offsets given, but the spec has none")
        for name, (a, shape, dt) in want.items():
            if not isinstance(a, NDArray) or a.shape != shape or a.dtype != dt:
                got = f"{a.shape} of {a.dtype}" if isinstance(a, NDArray) else type(a).__name__
                raise ShapeError(f"QuantizedMatrix {self.shape} ({self.spec.bits}-bit, group "
                                 f"{self.spec.group_size}): {name} must be {dt} {shape}, got "
                                 f"{got}")
            self.qweight._check_device(a)
        # views (rows of a larger matrix) become arrays of their own: kernels read buffers
        self.qweight, self.scales = self.qweight.compact(), self.scales.compact()
        if self.offsets is not None:
            self.offsets = self.offsets.compact()

    @property
    def device(self) -> Device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        """Bytes of the packed arrays (what one matrix-vector product reads)."""
        return self.spec.packed_nbytes(*self.shape)

    def arrays(self) -> list[NDArray]:
        return [a for a in (self.qweight, self.scales, self.offsets) if a is not None]

    @classmethod
    def from_packed(cls, qweight, scales, offsets, spec: QuantSpec, k: int,
                    device: Device | None = None) -> QuantizedMatrix:
        """From host arrays (numpy) of the packed format."""
        q = np.ascontiguousarray(qweight).view(np.int32)
        put = lambda a: array(np.ascontiguousarray(a, np.float32), device=device)  # noqa: E731
        return cls(array(q, device=device), put(scales),
                   None if offsets is None else put(offsets), spec, (q.shape[0], k))

    @classmethod
    def quantize(cls, w, bits: int, group_size: int | None = None, symmetric: bool = True,
                 device: Device | None = None) -> QuantizedMatrix:
        """Round-to-nearest quantization of a float matrix (NDArray or numpy) (n, k)."""
        host = w.numpy() if isinstance(w, NDArray) else np.asarray(w)
        if device is None and isinstance(w, NDArray):
            device = w.device
        q, s, b = quantize(host, bits, group_size, symmetric)
        spec = QuantSpec(bits, group_size or max(host.shape[1], 1), b is not None)
        return cls.from_packed(q, s, b, spec, host.shape[1], device)

    def dequantize(self, dtype: str = "float32") -> NDArray:
        """The (n, k) matrix of ``dtype`` (float16, bfloat16, float32) it stands for."""
        dtype = _activation_dtype(dtype, "dequantize")
        backend = self._backend()
        n, k = self.shape
        out = NDArray.make((n, k), device=self.device, dtype=dtype)
        if out.size:
            backend.dequantize(self.qweight.handle, self.scales.handle, _h(self.offsets),
                               out.handle, n, k, self.spec.bits, self.spec.group_size)
        return out

    def _backend(self):
        backend = self.device.backend
        cap = f"int{self.spec.bits}"
        if not has(backend, cap):
            raise DeviceError(f"{self.device.name} has no {self.spec.bits}-bit quantized "
                              f"kernels (capability {cap!r}); load the model on another device "
                              "or from its unquantized checkpoint")
        return backend


def _h(a: NDArray | None):
    return None if a is None else a.handle


def _activation_dtype(dtype, op: str) -> str:
    name = dtypes.canonical(dtype)
    if name not in ACTIVATION_DTYPES:
        raise DTypeError(f"{op}: quantized weights work with {', '.join(ACTIVATION_DTYPES)} "
                         f"activations, not {name}; cast with astype")
    return name


def quant_matmul(x: NDArray, w: QuantizedMatrix) -> NDArray:
    """x (..., k) @ W.T for a quantized W (n, k): (..., n) of x's dtype (float16, bfloat16,
    float32), summed in float32 (``numpy_ref.quant_matmul``)."""
    if not isinstance(w, QuantizedMatrix):
        raise DTypeError(f"quant_matmul needs a QuantizedMatrix, got {type(w).__name__}")
    x._check_device(w.qweight)
    _activation_dtype(x.dtype, "quant_matmul")
    n, k = w.shape
    if x.ndim < 1 or x.shape[-1] != k:
        raise ShapeError(f"quant_matmul: x {x.shape} must end in the matrix's k = {k} "
                         f"(W is {w.shape})")
    backend = w._backend()
    lead = x.shape[:-1]
    m = math.prod(lead)  # not np.prod: ~5 us a call on a tuple, a decode step's 88 calls
    xc = x.compact()
    out = NDArray.make(lead + (n,), device=x.device, dtype=x.dtype)
    if out.size:
        if k == 0:
            out.fill(0)
        else:
            backend.quant_matmul(xc.handle, w.qweight.handle, w.scales.handle, _h(w.offsets),
                                 out.handle, m, n, k, w.spec.bits, w.spec.group_size)
    return out


def concatenate_rows(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
    """Matrices of one format and k stacked along their rows (a fused q/k/v projection)."""
    first = parts[0]
    for p in parts[1:]:
        if p.spec != first.spec or p.shape[1] != first.shape[1]:
            raise ShapeError(f"concatenate_rows: {p.shape} {p.spec} does not match "
                             f"{first.shape} {first.spec}")
    if len(parts) == 1:
        return first
    offsets = (concatenate([p.offsets for p in parts]) if first.spec.has_offsets else None)
    return QuantizedMatrix(concatenate([p.qweight for p in parts]),
                           concatenate([p.scales for p in parts]), offsets, first.spec,
                           (sum(p.shape[0] for p in parts), first.shape[1]))
