"""CUDA's attention kernels (a mixin of ``CudaBackend``): prefill and training attention
on tensor cores (half precisions, ``nn.cu``'s attention_tc) or as float32 tiled products
(``attention_simt.cu``), token-major rows read and written directly; one token's attention
against the cache (``decode.cu``, ``decode_tc.cu``); paged attention by flash decoding
(``paged.cu``). Each path returns False (or is skipped) where its kernel does not apply, and
the generic GPU backend's kernels run instead.
"""

from __future__ import annotations

import struct

from ...backend_ndarray.dtypes import ITEMSIZE
from ...errors import DTypeError, ShapeError
from ..gpu.array import ACC, ATTN, MAX_GRID_YZ, SUFFIX, aligned16, cdiv, split_scale
from ..gpu.nn import NNOps
from ..gpu.paged import PAGED_FLASH

HALF = ("float16", "bfloat16")
FUSED_DTYPES = ("float16", "bfloat16", "float32")  # dtypes of the fused decode kernels
_ATTN_ROWS = struct.Struct("6q")  # attention.cuh's AttnRows: q's and out's row strides
_ATTN_SIMT_SHARED = ((64 + 2 * 64) * 68 + 64 * 80) * 4  # attention_simt.cu's tiles
_ATTN_GRADS = struct.Struct("33q")  # attention_simt_bwd.cu's AttnGrads: strides, offsets, slab
_ATTN_BWD_SHARED = (5 * 64 * 68 + 64 * 80 + 4 * 64) * 4  # attention_simt_bwd.cu's tiles
TC_BACKWARD_DIMS = (64, 128)  # head sizes of attention_tc_bwd.cu's kernels (half types)
_DECODE_TC_TILES = {64: 4, 128: 2}  # decode_tc.cu's Smem::NS: tiles a group keeps in flight
_DECODE_CLUSTER = 8  # decode_tc.cu's dtc::CLUSTER: the most ranges its ...c kernels merge


def _attn_params(batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim, scale,
                 causal, window: int = 0, splits: int = 1) -> bytes:
    """attention.cuh's AttnParams of a one-pass kernel (one chunk of kv_len; splits 1 but
    where a kernel reads it), the scale as float32 hi + lo; these kernels do not soft-cap
    (softcap 0)."""
    hi, lo = split_scale(scale)
    return ATTN.pack(batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim, splits,
                     kv_len, hi, int(bool(causal)), window, lo, 0.0)


class AttentionOps(NNOps):
    def _attention_special(self, q, k, v, out, batch, q_heads, kv_heads, q_len, kv_len,
                           kv_capacity, head_dim, scale, causal, window) -> bool:
        heads_first = (q_heads * q_len * head_dim, q_len * head_dim, head_dim)
        shape = (batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim, scale, causal,
                 window)
        return (self._attention_tc(q, k, v, out, *shape, heads_first, heads_first)
                or self._attention_simt(q, k, v, out, *shape, heads_first, heads_first))

    def attention_token_major(self, q, k, v, out, batch, q_heads, kv_heads, q_len, kv_len,
                              kv_capacity, head_dim, scale, causal, q_row,
                              window: int = 0, softcap: float = 0.0) -> None:
        """numpy_ref.attention_token_major: the tensor-core kernel reads and writes the
        token-major rows directly; other shapes and dtypes, and soft-capped scores (which
        only nn.cu's kernel caps), go through heads-first copies and the other kernels."""
        shape = (batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim, scale, causal,
                 window)
        rows = ((q_len * q_row, head_dim, q_row),
                (q_len * q_heads * head_dim, head_dim, q_heads * head_dim))
        if not softcap and (self._attention_tc(q, k, v, out, *shape, *rows)
                            or self._attention_simt(q, k, v, out, *shape, *rows)):
            return
        shape = (batch, q_heads, q_len, head_dim)
        qh = self._new_array(out.size, q.dtype)
        self.compact(q, qh, shape, (q_len * q_row, head_dim, q_row, 1), 0)
        oh = self._new_array(out.size, out.dtype)
        self.attention(qh, k, v, oh, batch, q_heads, kv_heads, q_len, kv_len, kv_capacity,
                       head_dim, scale, causal, window, softcap)
        self.compact(oh, out, (batch, q_len, q_heads, head_dim),
                     (q_heads * q_len * head_dim, head_dim, q_len * head_dim, 1), 0)

    def _attention_simt(self, q, k, v, out, batch, q_heads, kv_heads, q_len, kv_len,
                        kv_capacity, head_dim, scale, causal, window, q_rows,
                        out_rows) -> bool:
        """Prefill- and training-sized float32 attention with head_dim 64 as tiled products
        (attention_simt.cu: 64 query rows x 64-key tiles a group of 256 threads); q's and
        out's rows where ``q_rows`` and ``out_rows`` say, as for _attention_tc. False where
        the kernel does not apply (nn.cu's attention_f32 then runs)."""
        if not (self.tuning.attention_simt and q.dtype == "float32" and head_dim == 64
                and not window  # its tiles take no sliding window: nn.cu's kernel does
                and q_heads // kv_heads * q_len >= 64 and kv_len >= 1
                and all(s % 4 == 0 for s in q_rows + out_rows)  # 16-byte rows
                and all(aligned16(x.buffer) for x in (q, k, v, out))):
            return False
        kern = self._kernel("attention_simt", "attention_simt64_f32")
        self._launch_row_attention(kern, 256, _ATTN_SIMT_SHARED,
                                   (q.buffer, k.buffer, v.buffer, out.buffer), batch, q_heads,
                                   kv_heads, q_len, kv_len, kv_capacity, head_dim, scale, causal,
                                   q_rows, out_rows)
        return True

    def attention_backward_supported(self, dtype: str, head_dim: int,
                                     rows: tuple[int, ...]) -> bool:
        """Float32 with head_dim 64 (attention_simt_bwd.cu), float16 and bfloat16 with
        head_dim 64 or 128 on tensor cores (attention_tc_bwd.cu), with 16-byte rows
        (tuning ``attention_backward``)."""
        if not self.tuning.attention_backward:
            return False
        if dtype == "float32":
            return head_dim == 64 and all(s % 4 == 0 for s in rows)
        return (dtype in HALF and head_dim in TC_BACKWARD_DIMS and self.tuning.mma
                and all(s % 8 == 0 for s in rows))

    def _require_backward(self, op: str, dtype: str, head_dim: int, rows) -> None:
        if not self.attention_backward_supported(dtype, head_dim, rows):
            raise DTypeError(f"{op}: no kernel for {dtype} with head_dim {head_dim} and these "
                             "rows; ask attention_backward_supported")

    def attention_with_stats(self, q, k, v, out, stats, batch, q_heads, kv_heads, q_len,
                             kv_len, head_dim, scale, causal, q_rows, out_rows,
                             kv_rows) -> None:
        """numpy_ref.attention_with_stats: the forward kernel also writing each row's max and
        1 / sum, K and V read through their strides, for any number of rows: float32 on
        attention_simt.cu's tiles (attention_simt64_train_f32), half types on tensor cores
        (attention_tc_bwd.cu's attention_tc{64,128}_train_*)."""
        self._require_backward("attention_with_stats", q.dtype, head_dim,
                               q_rows + out_rows + kv_rows)
        if q.dtype in HALF:
            kern, threads = self._kernel(
                "attention_tc_bwd", f"attention_tc{head_dim}_train_{SUFFIX[q.dtype]}"), 128
            shared = (64 + 4 * 64) * head_dim * 2  # Q tile + two stages of K and V tiles
        else:
            kern, threads = self._kernel("attention_simt", "attention_simt64_train_f32"), 256
            shared = _ATTN_SIMT_SHARED
        self._launch_row_attention(kern, threads, shared,
                                   (q.buffer, k.buffer, v.buffer, out.buffer, stats.buffer),
                                   batch, q_heads, kv_heads, q_len, kv_len, kv_len, head_dim,
                                   scale, causal, q_rows, out_rows, kv_rows)

    def attention_backward(self, q, k, v, out, dout, dq, dk, dv, batch, q_heads, kv_heads,
                           q_len, kv_len, head_dim, scale, causal, rows, stats=None) -> None:
        """numpy_ref.attention_backward (attention_simt_bwd.cu): each row's softmax
        statistics (unless the forward kept them: ``stats``), then a group per 64 keys of a
        (batch, KV head) walking the query tiles that see them (each row's dO . O computed
        as its tile is loaded), dK and dV in registers, each key block's share of dQ into
        its own slab, summed here in block order (deterministic)."""
        self._require_backward("attention_backward", q.dtype, head_dim, rows)
        gy, blocks = batch * kv_heads, cdiv(kv_len, 64)
        if gy > MAX_GRID_YZ:
            raise ShapeError(f"attention_backward over {gy} (batch x kv heads) exceeds the "
                             "GPU grid")
        if q.dtype in HALF:
            self._attention_backward_tc(q, k, v, out, dout, dq, dk, dv, batch, q_heads,
                                        kv_heads, q_len, kv_len, head_dim, scale, causal, rows,
                                        stats)
            return
        params = _attn_params(batch, q_heads, kv_heads, q_len, kv_len, kv_len, head_dim, scale,
                              causal)
        slabs = self._new_array(blocks * dq.size, "float32") if blocks > 1 else dq
        grads = _ATTN_GRADS.pack(*rows, dq.size if blocks > 1 else 0)
        if stats is None:
            stats = self._new_array(2 * batch * q_heads * q_len, "float32")
            kern = self._kernel("attention_simt_bwd", "attention_simt64_stats_f32")
            kern.check_threads(256)
            self.queue.dispatch(kern, (cdiv(q_heads // kv_heads * q_len, 64), gy, 1),
                                (256, 1, 1), (q.buffer, k.buffer, stats.buffer), params,
                                raw_args=(grads,))
        kern = self._kernel("attention_simt_bwd", "attention_simt64_bwd_f32")
        kern.check_threads(256)
        kern.reserve_shared(_ATTN_BWD_SHARED)
        self.queue.dispatch(kern, (blocks, gy, 1), (256, 1, 1),
                            (q.buffer, k.buffer, v.buffer, out.buffer, dout.buffer,
                             stats.buffer, slabs.buffer, dk.buffer, dv.buffer), params,
                            _ATTN_BWD_SHARED,
                            raw_args=(grads,))
        if blocks > 1:
            self._reduce("sum", slabs, dq, 1, blocks, dq.size)

    def _attention_backward_tc(self, q, k, v, out, dout, dq, dk, dv, batch, q_heads,
                               kv_heads, q_len, kv_len, head_dim, scale, causal, rows,
                               stats) -> None:
        """attention_backward in half types on tensor cores (attention_tc_bwd.cu): a group
        per 64 query rows computes each row's D = dO . O and dQ (recomputing the rows'
        statistics first where the forward kept none), then a group per 64 keys dK and dV,
        each summing over every query head of its KV head: no atomics, no slabs."""
        rows_total, sfx = q_heads // kv_heads * q_len, SUFFIX[q.dtype]
        drow = self._new_array(batch * q_heads * q_len, "float32")
        recompute = stats is None
        if recompute:
            stats = self._new_array(2 * batch * q_heads * q_len, "float32")
        grads = _ATTN_GRADS.pack(*rows, 0)
        # few key blocks (one sequence, few KV heads): the dK/dV walk over the grouped query
        # heads split into parts, enough groups for ~4 a multiprocessor, their float32 sums
        # added after; AttnParams' splits carries the parts (the dQ kernel ignores it)
        blocks, group = cdiv(kv_len, 64) * batch * kv_heads, q_heads // kv_heads
        parts = 1
        if self.tuning.attention_backward_parts:
            parts = cdiv(group, cdiv(group, min(group, cdiv(4 * self.device.compute_units,
                                                            blocks))))
        params = _attn_params(batch, q_heads, kv_heads, q_len, kv_len, kv_len, head_dim, scale,
                              causal, splits=parts)
        tile = 64 * head_dim * 2
        kern = self._kernel("attention_tc_bwd",
                            f"attention_tc{head_dim}_bwd_{'dqs' if recompute else 'dq'}_{sfx}")
        kern.check_threads(128)
        shared = 6 * tile + 64 * 4  # Q, dO, two stages of K and V; each row's D
        kern.reserve_shared(shared)
        if max(cdiv(rows_total, 64), cdiv(kv_len, 64)) > MAX_GRID_YZ:
            raise ShapeError(f"attention_backward over {rows_total} query rows or {kv_len} "
                             "keys a KV head exceeds the GPU grid")
        # groups (batch x KV head, tile): each KV head's longest causal walks first
        self.queue.dispatch(kern, (batch * kv_heads, cdiv(rows_total, 64), 1), (128, 1, 1),
                            (q.buffer, k.buffer, v.buffer, out.buffer, dout.buffer,
                             stats.buffer, drow.buffer, dq.buffer), params, shared,
                            raw_args=(grads,))
        kern = self._kernel("attention_tc_bwd", f"attention_tc{head_dim}_bwd_dkv_{sfx}")
        kern.check_threads(128)
        shared = 6 * tile + 2 * 4 * 64 * 4  # K, V, two stages of Q, dO and the rows' info
        kern.reserve_shared(shared)
        n = batch * kv_heads * kv_len * head_dim
        part = self._new_array(2 * parts * n, "float32") if parts > 1 else dk
        self.queue.dispatch(kern, (batch * kv_heads * parts, cdiv(kv_len, 64), 1), (128, 1, 1),
                            (q.buffer, k.buffer, v.buffer, dout.buffer, stats.buffer,
                             drow.buffer, dk.buffer, dv.buffer, part.buffer), params, shared,
                            raw_args=(grads,))
        if parts > 1:
            kern = self._kernel("attention_tc_bwd", f"attention_tc{head_dim}_sum_parts_{sfx}")
            kern.check_threads(256)
            self.queue.dispatch(kern, (min(cdiv(n, 4 * 256), 8 * self.device.compute_units), 1, 1),
                                (256, 1, 1), (part.buffer, dk.buffer, dv.buffer), params,
                                raw_args=(grads,))

    def _attention_tc(self, q, k, v, out, batch, q_heads, kv_heads, q_len, kv_len,
                      kv_capacity, head_dim, scale, causal, window, q_rows, out_rows) -> bool:
        """Prefill-sized attention on tensor cores (mma.sync): groups of 64 query rows,
        K/V in 64-key tiles through two shared-memory stages, P kept in registers; q's and
        out's rows where ``q_rows`` and ``out_rows`` (batch, head, position strides in
        elements: attention.cuh's AttnRows) say. False where the kernel does not apply."""
        if not (self.tuning.mma and q.dtype in HALF and head_dim in (64, 128)
                and q_heads // kv_heads * q_len >= 64
                and all(s % 8 == 0 for s in q_rows + out_rows)  # 16-byte rows
                and all(aligned16(x.buffer) for x in (q, k, v, out))):
            return False
        kern = self._kernel("nn", f"attention_tc{head_dim}_{SUFFIX[q.dtype]}")
        shared = (64 + 4 * 64) * head_dim * 2  # Q tile + two stages of K and V tiles
        buffers = (q.buffer, k.buffer, v.buffer, out.buffer,
                   out.buffer, out.buffer)  # part_o, part_ml: nn.cu's slots, unused here
        self._launch_row_attention(kern, 128, shared, buffers, batch, q_heads, kv_heads, q_len,
                                   kv_len, kv_capacity, head_dim, scale, causal, q_rows,
                                   out_rows, window=window)
        return True

    def _launch_row_attention(self, kern, threads: int, shared: int, buffers, batch, q_heads,
                              kv_heads, q_len, kv_len, kv_capacity, head_dim, scale, causal,
                              q_rows, out_rows, kv_rows=None, window: int = 0) -> None:
        """One launch of a 64-query-row attention kernel (tensor-core or float32 tiles):
        groups (64 rows of a KV head's queries, batch x KV heads), AttnParams, then AttnRows
        (and KVRows, where given) by value."""
        kern.check_threads(threads)
        gx, gy = cdiv(q_heads // kv_heads * q_len, 64), batch * kv_heads
        if gy > MAX_GRID_YZ:
            raise ShapeError(f"attention over {gy} (batch x kv heads) exceeds the GPU grid")
        kern.reserve_shared(shared)
        params = _attn_params(batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim,
                              scale, causal, window)
        raw = (_ATTN_ROWS.pack(*q_rows, *out_rows),)
        if kv_rows is not None:  # attention_simt.cu's KVRows
            raw += (_ATTN_ROWS.pack(*kv_rows),)
        self.queue.dispatch(kern, (gx, gy, 1), (threads, 1, 1), buffers, params, shared,
                            raw_args=raw)

    def _flash_plan(self, dt, q_heads: int, kv_heads: int, head_dim: int,
                    span: int, softcap: float = 0.0) -> tuple[str, str, int] | None:
        """(family, kernel, ranges a KV head) of flash decoding (tuning ``decode_attention``)
        for a cache read up to ``span`` positions, or None where it does not apply: head
        sizes 64 and 128, and 256 in half types (Gemma's; the warp-per-head kernel alone,
        two 64 KiB tiles in flight), at most 16 query heads per KV head (and 16-byte aligned
        caches, which the caller checks). Soft-capped scores (Gemma 2) take the warp-per-head
        kernel: the tensor-core one does not cap."""
        kind = self.tuning.decode_attention
        sizes = (64, 128, 256) if dt in HALF else (64, 128)
        if not (kind in ("flash", "tc") and dt in FUSED_DTYPES and head_dim in sizes
                and q_heads // kv_heads <= 16):
            return None
        most = min(self.tuning.decode_splits, cdiv(span, 64))  # <= 64: the merge
        if head_dim == 256 or softcap or not (kind == "tc" and self.tuning.mma
                                              and dt in HALF):
            return "decode", f"attention_decode_flash{head_dim}_{SUFFIX[dt]}", most
        # a range is at least the tiles a group keeps in flight
        ranges = min(most, cdiv(cdiv(span, 64), _DECODE_TC_TILES[head_dim]))
        # sm_90: a cache of at most _DECODE_CLUSTER ranges a KV head merges them in one
        # cluster, where a range may be one tile: up to a cluster of them
        cluster = self.tuning.decode_cluster and 1 < ranges <= _DECODE_CLUSTER
        if cluster:
            ranges = min(most, _DECODE_CLUSTER)
        return ("decode_tc", f"attention_decode_tc{head_dim}{'c' if cluster else ''}_"
                f"{SUFFIX[dt]}", ranges)

    def _launch_decode(self, kern, threads: int, shared: int, splits: int, chunk: int, dt,
                       qkv, cos, sin, position, keys, values, out, q_heads: int,
                       kv_heads: int, head_dim: int, capacity: int, table_rows: int,
                       scale: float, window: int, softcap: float) -> None:
        """One launch of a one-kernel attention_decode (the ABI of docs/kernels.md's
        attention_decode_fused): groups (KV head, split), partials, one counter per KV
        head for the merging group."""
        part_o, part_ml, params = self._decode_launch_state(
            dt, q_heads, kv_heads, head_dim, capacity, table_rows, splits, chunk, scale, window,
            softcap)
        height = kern.cluster_height  # decode_tc on sm_90: clusters of a KV head's ranges
        self.queue.dispatch(kern, (kv_heads, cdiv(splits, height) * height, 1), (threads, 1, 1),
                            (qkv.buffer, cos.buffer, sin.buffer, position.buffer,
                             keys.buffer, values.buffer, part_o, part_ml, out.buffer,
                             self._counters(kv_heads)), params, shared)

    def attention_decode(self, qkv, cos, sin, position, keys, values, out, q_heads: int,
                         kv_heads: int, head_dim: int, capacity: int, table_rows: int,
                         scale: float, window: int = 0, softcap: float = 0.0) -> None:
        """One launch. Flash decoding where it applies (tuning ``decode_attention``): the
        cache up to the position cut into at most 32 (or 64) ranges per KV head, 64-position
        tiles of keys and values staged in shared memory with an online softmax, the last
        group per KV head merging; on tensor cores in fp16/bf16 (kernels/decode_tc.cu: the
        KV head's query heads are the 16 rows of an mma tile, 4 warps take 16 keys each of
        every tile), else a warp per query head (kernels/decode.cu: 3 tiles in flight, 2 in
        float32). Otherwise nn.cu's split kernel: the generic plan's groups also stage each
        chunk's keys and values (padded rows) and the merge weights in shared memory, and
        the last group of each KV head to finish merges."""
        self._attention_decode(capacity, qkv, cos, sin, position, keys, values, out, q_heads,
                               kv_heads, head_dim, capacity, table_rows, scale, window, softcap)

    def attention_decode_within(self, qkv, cos, sin, position, keys, values, out,
                                q_heads: int, kv_heads: int, head_dim: int, capacity: int,
                                table_rows: int, scale: float, window: int,
                                max_positions: int, softcap: float = 0.0) -> None:
        """Capability ``decode_bands``: ``attention_decode`` with the kernel and its ranges
        chosen for a cache read up to ``max_positions``. Exact past it too: the kernels cut
        the positions up to the one on the device into their ranges, whatever the bound."""
        self._attention_decode(min(capacity, max(1, max_positions)), qkv, cos, sin, position,
                               keys, values, out, q_heads, kv_heads, head_dim, capacity,
                               table_rows, scale, window, softcap)

    def attention_decode_bands(self, dtype: str, q_heads: int, kv_heads: int,
                               head_dim: int, capacity: int) -> tuple[int, ...]:
        """Capability ``decode_bands``. The one bound where the choice changes: a cluster's
        ranges of NS tiles (2,048 positions at head size 64, 1,024 at 128): below it the
        cluster kernel (its merge in distributed shared memory, single-tile ranges), above
        it the kernel that merges up to 32 ranges through memory (cuda_notes v39-v41)."""
        bound = _DECODE_CLUSTER * _DECODE_TC_TILES.get(head_dim, 0) * 64
        if not (self.tuning.decode_bands and 0 < bound < capacity):
            return (capacity,)
        below, above = (self._flash_plan(dtype, q_heads, kv_heads, head_dim, n)
                        for n in (bound, capacity))
        # another kernel, not only other ranges of the same one
        return (bound, capacity) if below and above and below[1] != above[1] else (capacity,)

    def _attention_decode(self, span: int, qkv, cos, sin, position, keys, values, out,
                          q_heads: int, kv_heads: int, head_dim: int, capacity: int,
                          table_rows: int, scale: float, window: int = 0,
                          softcap: float = 0.0) -> None:
        """attention_decode with the kernel chosen for a cache read up to ``span`` (at most
        ``window`` positions, where a sliding window is given)."""
        dt = self._need(qkv.dtype, ("float16", "bfloat16", "float32", "float64"),
                        "attention_decode")
        args = (dt, qkv, cos, sin, position, keys, values, out, q_heads, kv_heads, head_dim,
                capacity, table_rows, scale, window, softcap)
        if window:
            span = min(span, window)
        group, item = q_heads // kv_heads, ITEMSIZE[dt]
        plan = self._flash_plan(dt, q_heads, kv_heads, head_dim, span, softcap)
        if plan is not None and aligned16(keys.buffer) and aligned16(values.buffer):
            family, name, ranges = plan
            kern = self._kernel(family, name)
            if family == "decode_tc":
                # Q tile (16 rows), 64 KiB of key and value tiles, the new row (Smem there)
                threads, shared = 128, 16 * head_dim * 2 + 64 * 1024 + 2 * head_dim * 2
            else:
                kern.check_threads(32 * group)
                stages = 2 if dt == "float32" or head_dim == 256 else 3  # decode.cu's Stages
                # the staged key and value tiles, each warp's roped query and scores, the
                # new row
                threads = 32 * group
                shared = (stages * 2 * 64 * head_dim * item + group * (head_dim + 64) * 4
                          + 2 * head_dim * item)
            kern.reserve_shared(shared)
            self._launch_decode(kern, threads, shared, ranges, 64, *args)
            return
        _, chunk, splits, shared = self._decode_plan(dt, q_heads, kv_heads, head_dim, capacity)
        stride = head_dim + (2 if item == 2 else 1)
        shared = cdiv(shared + 2 * chunk * stride * item, 16) * 16
        shared += group * (splits + 1) * ACC[dt]
        kern = self._kernel("nn", f"attention_decode_fused_{SUFFIX[dt]}")
        self._decode_check(kern, group, head_dim, shared, splits)
        self._launch_decode(kern, 128, shared, splits, chunk, *args)

    def _paged_attention_special(self, dt, q, key_pages, value_pages, block_tables, seq_of,
                                 positions, out, tokens, q_heads, kv_heads, head_dim,
                                 page_size, max_pages, num_pages, scale, window,
                                 softcap) -> bool:
        """paged_attention_flash (kernels/paged.cu): flash decoding through the block
        tables, a group per (token, KV head, range of positions) with a warp per query head
        of the group; ranges enough for about two groups per SM, merged in the kernel."""
        group = q_heads // kv_heads
        sizes = (64, 128, 256) if dt in HALF else (64, 128)  # 256: Gemma's, half types
        if not (self.tuning.paged_flash and head_dim in sizes and group <= 16
                and dt in ("float16", "bfloat16", "float32") and kv_heads <= MAX_GRID_YZ
                and all(aligned16(x.buffer) for x in (q, key_pages, value_pages))):
            return False
        kern = self._kernel("paged", f"paged_attention_flash{head_dim}_{SUFFIX[dt]}")
        kern.check_threads(32 * group)
        # the tile's keys and values (64 rows each) and slots; per warp its query and scores
        shared = 2 * 64 * head_dim * ITEMSIZE[dt] + 64 * 4 + group * (head_dim + 64) * 4
        kern.reserve_shared(shared)
        splits = max(1, min(32, cdiv(2 * self.device.compute_units, tokens * kv_heads)))
        heads = tokens * q_heads
        part_o = self._workspace(heads * splits * head_dim * 4)
        part_ml = self._workspace(heads * splits * 2 * 4)
        params = PAGED_FLASH.pack(tokens, q_heads, kv_heads, page_size, max_pages, num_pages,
                                  splits, scale, window, softcap)
        self.queue.dispatch(kern, (tokens, kv_heads, splits), (32 * group, 1, 1),
                            (q.buffer, key_pages.buffer, value_pages.buffer,
                             block_tables.buffer, seq_of.buffer, positions.buffer, part_o,
                             part_ml, out.buffer, self._counters(tokens * kv_heads)), params,
                            shared)
        return True
