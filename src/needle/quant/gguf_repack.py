"""GGUF (llama.cpp) block formats repacked, exactly, into needle's packed formats.

Every supported block type is a per-block scale (and minimum) times small integers, so its
values are needle values (docs/quantization.md) with float32 scales and offsets; the
float32 arithmetic of the products is exact (an fp16 scale times a 6- or 8-bit sub-scale has
at most 19 significant bits), so W is the same matrix ``gguf.quants.dequantize`` gives:

==========  ====================  ===================================================
GGUF type   needle format         value
==========  ====================  ===================================================
Q8_0        int8, group 32        q * d
Q4_0        int4, group 32        (u - 8) * d
Q4_K        int4 + offsets, g 32  u * (d * sc) - dmin * m        (8 sub-blocks of 256)
Q5_K        int8 + offsets, g 32  (u + 16 * hbit) * (d * sc) - dmin * m
Q6_K        int8, group 16        (q - 32) * (d * sc)           (16 sub-blocks of 256)
==========  ====================  ===================================================

Q5_K takes 8 bits a value here (no 5-bit format): it stays exact at 1.6x its bytes.
Functions take a tensor's rows of raw blocks (uint8, (n, row bytes)) and k, and return
``(qweight, scales, offsets or None, QuantSpec)``.
"""

from __future__ import annotations

import numpy as np

from .format import QuantSpec, pack

QK_K = 256
BLOCK_BYTES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176),
               "Q6_K": (QK_K, 210)}


def _blocks(data: np.ndarray, kind: str, k: int) -> np.ndarray:
    per, nbytes = BLOCK_BYTES[kind]
    return np.ascontiguousarray(data, np.uint8).reshape(data.shape[0], k // per, nbytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from the last axis' 2 bytes, as float32 (..., 1)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _int8_words(values: np.ndarray) -> np.ndarray:
    """Values in -128..127 (n, k), k a multiple of 4 -> int32 words: the bytes themselves."""
    return np.ascontiguousarray(values.astype(np.int8)).view(np.int32)


def q8_0(data, k):
    b = _blocks(data, "Q8_0", k)
    d = _f16(b[..., 0:2])[..., 0]
    q = b[..., 2:].view(np.int8).reshape(b.shape[0], k)
    return _int8_words(q), d, None, QuantSpec(8, 32)


def q4_0(data, k):
    b = _blocks(data, "Q4_0", k)
    d = _f16(b[..., 0:2])[..., 0]
    qs = b[..., 2:]
    u = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(b.shape[0], k)
    return pack(u, 4), d, None, QuantSpec(4, 32)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs packed in 12 bytes (llama.cpp's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    m = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    m[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    m[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc.astype(np.float32), m.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 nibbles: chunk c of 32 bytes gives 32 low nibbles, then 32 high."""
    chunks = qs.reshape(qs.shape[:-1] + (4, 32))
    return np.stack([chunks & 0xF, chunks >> 4], axis=-2).reshape(qs.shape[:-1] + (QK_K,))


def q4_k(data, k):
    b = _blocks(data, "Q4_K", k)
    n = b.shape[0]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scales(b[..., 4:16])
    u = _k_nibbles(b[..., 16:144]).reshape(n, k)
    return (pack(u, 4), (d * sc).reshape(n, -1), (-(dmin * m)).reshape(n, -1),
            QuantSpec(4, 32, True))


def q5_k(data, k):
    b = _blocks(data, "Q5_K", k)
    n = b.shape[0]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scales(b[..., 4:16])
    qh = b[..., 16:48]  # bit 2c of qh[l]: element 64c + l's fifth bit; bit 2c+1: 64c + 32 + l
    low = _k_nibbles(b[..., 48:176]).reshape(b.shape[:2] + (4, 2, 32))
    bits = (qh[..., None, None, :] >> (np.arange(8, dtype=np.uint8).reshape(4, 2, 1))) & 1
    u = (low + 16 * bits).reshape(n, k)
    return _int8_words(u), (d * sc).reshape(n, -1), (-(dmin * m)).reshape(n, -1), \
        QuantSpec(8, 32, True)


def q6_k(data, k):
    b = _blocks(data, "Q6_K", k)
    n = b.shape[0]
    ql, qh = b[..., 0:128], b[..., 128:192]
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    out = np.empty(b.shape[:2] + (2, 4, 32), np.int16)
    for h in range(2):  # each half of 128 values: 64 bytes of ql, 32 of qh
        lo, hi = ql[..., 64 * h:64 * h + 32], ql[..., 64 * h + 32:64 * h + 64]
        high = qh[..., 32 * h:32 * h + 32]
        out[..., h, 0, :] = (lo & 0xF) | (((high >> 0) & 3) << 4)
        out[..., h, 1, :] = (hi & 0xF) | (((high >> 2) & 3) << 4)
        out[..., h, 2, :] = (lo >> 4) | (((high >> 4) & 3) << 4)
        out[..., h, 3, :] = (hi >> 4) | (((high >> 6) & 3) << 4)
    q = (out.reshape(n, k) - 32)
    return _int8_words(q), (d * sc).reshape(n, -1), None, QuantSpec(8, 16)


REPACK = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}


def to_common(parts: list[tuple]) -> list[tuple]:
    """Repacked matrices of different formats, rewritten (exactly) in one format so they can be
    fused into one projection (a Q4_K_M file stores some v projections as Q6_K): int8 when any
    is int8, the smallest group size (sizes divide each other), offsets when any has them."""
    from .format import unpack

    specs = [p[3] for p in parts]
    if len(set(specs)) == 1:
        return parts
    bits = max(s.bits for s in specs)
    group = min(s.group_size for s in specs)
    offsets = any(s.has_offsets for s in specs)
    out = []
    for q, s, b, spec in parts:
        k = q.shape[1] * (32 // spec.bits)
        v = unpack(q, spec.bits, k)
        if spec.bits == 4 and not spec.has_offsets:
            v = v - 8  # the value (u - 8) * s as a signed integer
        repeat = spec.group_size // group
        s2 = np.repeat(s, repeat, axis=1)
        b2 = (np.repeat(b, repeat, axis=1) if b is not None
              else np.zeros_like(s2) if offsets else None)
        if bits == 8:
            q2 = _int8_words(v)
        else:  # all int4 here: mixed symmetric/offset int4 -> offsets, u = v (+ 8)
            q2 = pack(v + (8 if not spec.has_offsets else 0), 4)
            if not spec.has_offsets:
                b2 = -8 * s2
        out.append((q2, s2.astype(np.float32), None if b2 is None else b2.astype(np.float32),
                    QuantSpec(bits, group, offsets)))
    return out
