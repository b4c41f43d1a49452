"""Entry points of the paged-attention family (capability ``paged_attention``): a KV cache
kept in fixed-size pages shared by many sequences (``needle.serve``). The semantics are
``backends/numpy_ref/paged.py``'s; this module checks shapes, dtypes and devices and
hands compact buffers to the backend."""

from __future__ import annotations

import math

import numpy as np

from ..backends.api import has
from ..errors import DeviceError, DTypeError, IndexOutOfRangeError, ShapeError
from . import dtypes
from .functions import softcap_arg, window_arg
from .ndarray import NDArray


def _need_capability(device, what: str) -> None:
    if not has(device.backend, "paged_attention"):
        raise DeviceError(f"{what}: the {device.name} backend has no paged attention "
                          "(capability paged_attention); use another device")


def _int32(x, device, what: str, length: int | None = None) -> NDArray:
    """An int32 index array on ``device`` (host values are uploaded)."""
    if not isinstance(x, NDArray):
        host = np.asarray(x)
        if host.dtype.kind not in "iu":
            raise DTypeError(f"{what} must hold integers, got {host.dtype}")
        x = NDArray(host.astype(np.int32), device=device)
    if x.dtype != "int32":
        raise DTypeError(f"{what} must be int32, got {x.dtype}")
    if x.device != device:
        raise DeviceError(f"{what} is on {x.device.name}, the pages on {device.name}")
    if length is not None and x.size != length:
        raise ShapeError(f"{what} must have {length} entries (one per token), got {x.size}")
    return x.compact()


def _check_pages(key_pages: NDArray, value_pages: NDArray, what: str) -> tuple[int, ...]:
    if key_pages.ndim != 4 or key_pages.shape != value_pages.shape:
        raise ShapeError(f"{what}: key and value pages must both be (num_pages, page_size, "
                         f"kv_heads, head_dim), got {key_pages.shape} and {value_pages.shape}")
    if not (key_pages.is_compact() and value_pages.is_compact()):
        raise ShapeError(f"{what}: the page pools must be compact (whole) arrays")
    if key_pages.dtype != value_pages.dtype or not dtypes.is_floating(key_pages.dtype):
        raise DTypeError(f"{what}: pages must share one floating dtype, got {key_pages.dtype} "
                         f"and {value_pages.dtype}")
    return key_pages.shape


def paged_write(k: NDArray, v: NDArray, slots, key_pages: NDArray,
                value_pages: NDArray) -> None:
    """Store k[t] and v[t] (tokens, kv_heads, head_dim) into slot ``slots[t]`` of the page
    pools (num_pages, page_size, kv_heads, head_dim), in place. Slot -1 skips a token."""
    _need_capability(k.device, "paged_write")
    num_pages, page_size, kv_heads, d = _check_pages(key_pages, value_pages, "paged_write")
    row, num_slots = kv_heads * d, num_pages * page_size
    if k.shape != v.shape or k.size % row or k.ndim < 1:
        raise ShapeError(f"paged_write: k {k.shape} and v {v.shape} must be (tokens, "
                         f"{kv_heads}, {d})")
    tokens = k.size // row
    if not isinstance(slots, NDArray):
        host = np.asarray(slots).reshape(-1)
        if host.size and (host.min() < -1 or host.max() >= num_slots):
            raise IndexOutOfRangeError(f"paged_write: slot {int(host.max())} is outside the "
                                       f"pool's {num_slots} slots")
    s = _int32(slots, k.device, "paged_write slots", tokens)
    kc, vc = (x.astype(key_pages.dtype).compact() for x in (k, v))
    if tokens:
        k.device.backend.paged_write(kc._handle, vc._handle, s._handle, key_pages._handle,
                                     value_pages._handle, tokens, row, num_slots)


def paged_attention(q: NDArray, key_pages: NDArray, value_pages: NDArray, block_tables,
                    seq_of, positions, scale: float | None = None,
                    window: int | None = None, softcap: float | None = None) -> NDArray:
    """Causal attention of q (tokens, q_heads, head_dim), token t over positions
    0..positions[t] of the sequence whose block-table row is seq_of[t] (with a sliding
    ``window``, a positive int: over positions[t] - window + 1..positions[t]; with
    ``softcap``, scores soft-capped as Gemma 2's); returns q's shape. See
    ``numpy_ref.paged_attention``."""
    _need_capability(q.device, "paged_attention")
    num_pages, page_size, kv_heads, d = _check_pages(key_pages, value_pages, "paged_attention")
    if q.ndim != 3 or q.shape[2] != d or kv_heads == 0 or q.shape[1] % kv_heads:
        raise ShapeError(f"paged_attention: q must be (tokens, q_heads, {d}) with q_heads a "
                         f"multiple of {kv_heads}, got {q.shape}")
    if q.dtype != key_pages.dtype:
        raise DTypeError(f"paged_attention: q is {q.dtype}, the pages {key_pages.dtype}")
    tokens, q_heads, _ = q.shape
    tables = _int32(block_tables, q.device, "block_tables")
    if tables.ndim != 2 or tables.shape[1] == 0:
        raise ShapeError(f"paged_attention: block_tables must be (sequences, max_pages), got "
                         f"{tables.shape}")
    seqs, max_pages = tables.shape
    for host, limit, name in ((seq_of, seqs, "seq_of"),
                              (positions, max_pages * page_size, "positions")):
        if not isinstance(host, NDArray):
            h = np.asarray(host).reshape(-1)
            if h.size and (h.min() < 0 or h.max() >= limit):
                raise IndexOutOfRangeError(f"paged_attention: {name} holds {int(h.max())}, "
                                           f"outside 0..{limit - 1}")
    rows = _int32(seq_of, q.device, "seq_of", tokens)
    pos = _int32(positions, q.device, "positions", tokens)
    scale = 1 / math.sqrt(d) if scale is None else float(scale)
    window = window_arg(window, "paged_attention")
    cap = softcap_arg(softcap, "paged_attention")
    qc = q.compact()
    out = qc._empty_like()
    if out.size:
        q.device.backend.paged_attention(qc._handle, key_pages._handle, value_pages._handle,
                                         tables._handle, rows._handle, pos._handle,
                                         out._handle, tokens, q_heads, kv_heads, d, page_size,
                                         max_pages, num_pages, scale, window, softcap=cap)
    return out
