"""Paged attention (kernel file ``paged``; capability ``paged_attention``): the KV cache of
many sequences in one pool of pages (``needle.serve``). See ``numpy_ref/paged.py``."""

from __future__ import annotations

import struct

from ...errors import ShapeError
from .array import FLOATS, SUFFIX, GpuArray, padded
from .base import GpuBase

WRITE = struct.Struct("3q")  # PagedWriteParams: tokens, row, num_slots
PAGED = padded("7qfif")  # PagedParams: tokens, heads, kv heads, head dim, page size, max pages,
# pages, scale, window (0: none), softcap (0: none)
PAGED_FLASH = padded("7qfif")  # PagedFlashParams (paged.cu): tokens, heads, kv heads, page size,
# max pages, pages, splits, scale, window, softcap
THREADS = 128  # the kernels' group size (paged.cu, paged.metal)
MAX_HEAD_DIM = 256


class PagedOps(GpuBase):
    def paged_write(self, k: GpuArray, v: GpuArray, slots: GpuArray, key_pages: GpuArray,
                    value_pages: GpuArray, tokens: int, row: int, num_slots: int) -> None:
        """A group per token copies its rows into the slot (padding slots are skipped)."""
        dt = self._need(k.dtype, FLOATS, "paged_write")
        kern = self._kernel("paged", f"paged_write_{SUFFIX[dt]}")
        kern.check_threads(THREADS)
        if tokens:
            self.queue.dispatch(kern, (tokens, 1, 1), (THREADS, 1, 1),
                                (k.buffer, v.buffer, slots.buffer, key_pages.buffer,
                                 value_pages.buffer), WRITE.pack(tokens, row, num_slots))

    def paged_attention(self, q: GpuArray, key_pages: GpuArray, value_pages: GpuArray,
                        block_tables: GpuArray, seq_of: GpuArray, positions: GpuArray,
                        out: GpuArray, tokens: int, q_heads: int, kv_heads: int,
                        head_dim: int, page_size: int, max_pages: int, num_pages: int,
                        scale: float, window: int = 0, softcap: float = 0.0) -> None:
        """A device's own kernel where it has one; else a group per (token, query head)
        walks the token's pages (from its window's start) in chunks of 128."""
        dt = self._need(q.dtype, FLOATS, "paged_attention")
        if head_dim > MAX_HEAD_DIM:
            raise ShapeError(f"paged_attention supports head_dim up to {MAX_HEAD_DIM} on the "
                             f"GPU, got {head_dim}")
        if not (tokens and q_heads):
            return
        if self._paged_attention_special(dt, q, key_pages, value_pages, block_tables, seq_of,
                                         positions, out, tokens, q_heads, kv_heads, head_dim,
                                         page_size, max_pages, num_pages, scale, window,
                                         softcap):
            return
        kern = self._kernel("paged", f"paged_attention_{SUFFIX[dt]}")
        kern.check_threads(THREADS)
        params = PAGED.pack(tokens, q_heads, kv_heads, head_dim, page_size, max_pages,
                            num_pages, scale, window, softcap)
        self.queue.dispatch(kern, (tokens, q_heads, 1), (THREADS, 1, 1),
                            (q.buffer, key_pages.buffer, value_pages.buffer,
                             block_tables.buffer, seq_of.buffer, positions.buffer,
                             out.buffer), params)

    def _paged_attention_special(self, dt, q, key_pages, value_pages, block_tables, seq_of,
                                 positions, out, tokens, q_heads, kv_heads, head_dim,
                                 page_size, max_pages, num_pages, scale, window,
                                 softcap) -> bool:
        """A device's faster kernel for the shapes it suits; True when one ran."""
        return False
