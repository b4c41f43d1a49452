"""needle's packed weight formats, on the host (numpy): packing, unpacking, quantizing.

A quantized matrix W (n, k) (a Linear layer's weight, (out, in) as PyTorch stores it) is
three arrays (docs/quantization.md):

* ``qweight`` int32 (n, ceil(k / per_word)): ``per_word`` = 32 / bits values per word,
  element k of a row in bits ``(k % per_word) * bits`` of word ``k // per_word`` (little
  end first); int8 values are signed bytes, int4 values unsigned nibbles 0..15. A row's
  last word is padded with zeros.
* ``scales`` float32 (n, groups), groups = ceil(k / group_size): one scale per row and group
  of ``group_size`` consecutive k (int8 per output channel: group_size = k).
* ``offsets`` float32 (n, groups) or absent.

The value of element (i, j), in float32, with g = j // group_size:

* int8: ``q * scale[i, g]`` (+ ``offset[i, g]`` when present)
* int4: ``(u - 8) * scale[i, g]`` without offsets (symmetric), ``u * scale[i, g] +
  offset[i, g]`` with them (scale and minimum: the zero point is -offset / scale).

Float32 scales and offsets make the GGUF block formats repack exactly (gguf_repack.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ShapeError

BITS = (8, 4)


@dataclass(frozen=True)
class QuantSpec:
    """The format of one quantized matrix: bits, group size, and whether it has offsets."""

    bits: int
    group_size: int
    has_offsets: bool = False

    def __post_init__(self):
        if self.bits not in BITS:
            raise ShapeError(f"quantized weights have 8 or 4 bits, not {self.bits}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) \
                or self.group_size < 1:
            raise ShapeError(f"group_size must be a positive int, got {self.group_size!r}")

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    def words(self, k: int) -> int:
        return -(-k // self.per_word)

    def groups(self, k: int) -> int:
        return -(-k // self.group_size)

    def packed_nbytes(self, n: int, k: int) -> int:
        """Bytes of the three arrays of an (n, k) matrix: what a matvec reads."""
        per_group = 8 if self.has_offsets else 4
        return n * (self.words(k) * 4 + self.groups(k) * per_group)


def pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Integer values (n, k) -> qweight int32 (n, words): int8 values in -128..127, int4 in
    0..15 (range-checked)."""
    v = np.asarray(values)
    lo, hi = (-128, 127) if bits == 8 else (0, 15)
    if v.ndim != 2:
        raise ShapeError(f"pack needs a 2-d array of values, got shape {v.shape}")
    if v.size and (v.min() < lo or v.max() > hi):
        raise ShapeError(f"{bits}-bit values must lie in {lo}..{hi}")
    n, k = v.shape
    per = 32 // bits
    words = -(-k // per)
    padded = np.zeros((n, words * per), np.uint32)
    padded[:, :k] = v.astype(np.int64) & ((1 << bits) - 1)
    parts = padded.reshape(n, words, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    packed = np.bitwise_or.reduce(parts << shifts, axis=2).astype(np.uint32)
    return packed.view(np.int32)


def unpack(qweight: np.ndarray, bits: int, k: int) -> np.ndarray:
    """qweight int32 (n, words) -> the stored values (n, k) as int32 (int8: signed, int4:
    0..15)."""
    q = np.ascontiguousarray(qweight).view(np.uint32)
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    parts = (q[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    values = parts.reshape(q.shape[0], -1)[:, :k].astype(np.int32)
    if bits == 8:
        values = np.where(values >= 128, values - 256, values)
    return values


def dequantize(qweight: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None,
               bits: int, group_size: int, k: int) -> np.ndarray:
    """The float32 matrix (n, k) a packed one stands for (the module docstring's rule)."""
    v = unpack(qweight, bits, k).astype(np.float32)
    g = np.arange(k) // group_size
    s = np.asarray(scales, np.float32)[:, g]
    if offsets is None:
        return (v - 8.0 if bits == 4 else v) * s
    return v * s + np.asarray(offsets, np.float32)[:, g]


def quantize(w: np.ndarray, bits: int, group_size: int | None = None,
             symmetric: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Round-to-nearest quantization of a float matrix (n, k): (qweight, scales, offsets).

    ``group_size`` None means one group per row (int8's per-output-channel scales).
    Symmetric: scale = max|w| / 127 (int8) or / 7 (int4: values -7..7, stored u = q + 8, so
    the error is at most half a step everywhere);
    asymmetric (int4 only): the group's [min, max] mapped onto 0..15, offset = min.
    """
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ShapeError(f"quantize needs a 2-d matrix, got shape {w.shape}")
    n, k = w.shape
    g = k if group_size is None else group_size
    spec = QuantSpec(bits, max(g, 1), not symmetric)
    if bits == 8 and not symmetric:
        raise ShapeError("int8 quantization is symmetric (per output channel or group)")
    groups = spec.groups(k)
    padded = np.zeros((n, groups * spec.group_size), np.float32)
    padded[:, :k] = w
    blocks = padded.reshape(n, groups, spec.group_size)
    if symmetric:
        amax = np.abs(blocks).max(axis=2)
        top = 127.0 if bits == 8 else 7.0
        scales = (amax / top).astype(np.float32)
        safe = np.where(scales == 0, 1.0, scales)[:, :, None]
        lo, hi = (-127, 127) if bits == 8 else (-8, 7)
        q = np.clip(np.rint(blocks / safe), lo, hi)
        if bits == 4:
            q = q + 8
        offsets = None
    else:
        lo_v, hi_v = blocks.min(axis=2), blocks.max(axis=2)
        scales = ((hi_v - lo_v) / 15.0).astype(np.float32)
        safe = np.where(scales == 0, 1.0, scales)[:, :, None]
        q = np.clip(np.rint((blocks - lo_v[:, :, None]) / safe), 0, 15)
        offsets = lo_v.astype(np.float32)
    values = q.reshape(n, -1)[:, :k].astype(np.int32)
    return pack(values, bits), scales, offsets
