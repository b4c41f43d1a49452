"""Transformer kernels (kernel file ``nn``): softmax and norms per row, RoPE, attention over
a sequence (fused, or composed from matmul and softmax when the fused kernel's tiles do not
fit the device's group memory) and one decode step's attention against a KV cache."""

from __future__ import annotations

import numpy as np

from ...backend_ndarray.dtypes import ITEMSIZE
from ...errors import ShapeError
from .array import (
    ACC,
    ATTN,
    DECODE,
    FLOATS,
    MAX_GRID_YZ,
    NORM,
    QK_NORM,
    ROPE,
    ROW,
    SUFFIX,
    GpuArray,
    cdiv,
    split_scale,
)
from .base import GpuBase


class NNOps(GpuBase):
    # --- rows ------------------------------------------------------------------------------
    def _row_kernel(self, name: str, dtype: str, rows: int, dim: int, buffers, params,
                    scratch_per_warp: int) -> None:
        self._need(dtype, FLOATS, name)
        k = self._kernel("nn", f"{name}_{SUFFIX[dtype]}")
        tx, ty = self._row_geometry(k, dim)
        shared = ty * (tx // 32) * scratch_per_warp
        self.queue.dispatch(k, (cdiv(rows, ty), 1, 1), (tx, ty, 1), buffers, params, shared)

    def softmax(self, a: GpuArray, out: GpuArray, dim: int) -> None:
        rows = a.size // dim
        self._row_kernel("softmax", a.dtype, rows, dim, (a.buffer, out.buffer),
                         ROW.pack(rows, dim), 2 * ACC[a.dtype])

    def log_softmax(self, a: GpuArray, out: GpuArray, dim: int) -> None:
        rows = a.size // dim
        self._row_kernel("log_softmax", a.dtype, rows, dim, (a.buffer, out.buffer),
                         ROW.pack(rows, dim), 2 * ACC[a.dtype])

    def rmsnorm(self, x: GpuArray, w: GpuArray, out: GpuArray, dim: int, eps: float) -> None:
        """out = x / sqrt(mean(x**2) + eps) * w, per row."""
        rows = x.size // dim
        self._row_kernel("rmsnorm", x.dtype, rows, dim, (x.buffer, w.buffer, out.buffer),
                         NORM[x.dtype].pack(rows, dim, eps), ACC[x.dtype])

    def qk_rmsnorm(self, x: GpuArray, q_weight: GpuArray, k_weight: GpuArray, out: GpuArray,
                   rows: int, q_heads: int, kv_heads: int, head_dim: int, eps: float) -> None:
        """numpy_ref.qk_rmsnorm: a warp (CUDA) or a thread (Metal) a head row."""
        self._need(x.dtype, FLOATS, "qk_rmsnorm")
        if rows:
            self._launch_1d(f"qk_rmsnorm_{SUFFIX[x.dtype]}", 32 * rows,
                            (x.buffer, q_weight.buffer, k_weight.buffer, out.buffer),
                            QK_NORM[x.dtype].pack(rows, q_heads, kv_heads, head_dim, eps), "nn")

    def add_rmsnorm(self, x: GpuArray, delta: GpuArray, w: GpuArray, total: GpuArray,
                    out: GpuArray, dim: int, eps: float) -> None:
        """total = x + delta (rounded), out = rmsnorm(total) * w, per row; total may be x."""
        rows = x.size // dim
        self._row_kernel("add_rmsnorm", x.dtype, rows, dim,
                         (x.buffer, delta.buffer, w.buffer, total.buffer, out.buffer),
                         NORM[x.dtype].pack(rows, dim, eps), ACC[x.dtype])

    def add_rmsnorm_post(self, x: GpuArray, delta: GpuArray, dw: GpuArray, w: GpuArray,
                         total: GpuArray, out: GpuArray, dim: int, eps: float) -> None:
        """add_rmsnorm of rmsnorm(delta) * dw (numpy_ref.add_rmsnorm_post)."""
        rows = x.size // dim
        self._row_kernel("add_rmsnorm_post", x.dtype, rows, dim,
                         (x.buffer, delta.buffer, dw.buffer, w.buffer, total.buffer, out.buffer),
                         NORM[x.dtype].pack(rows, dim, eps), ACC[x.dtype])

    def layernorm(self, x: GpuArray, w: GpuArray, b: GpuArray, out: GpuArray, dim: int,
                  eps: float) -> None:
        """out = (x - mean) / sqrt(var + eps) * w + b, per row (biased variance)."""
        rows = x.size // dim
        self._row_kernel("layernorm", x.dtype, rows, dim,
                         (x.buffer, w.buffer, b.buffer, out.buffer),
                         NORM[x.dtype].pack(rows, dim, eps), ACC[x.dtype])

    def rope(self, x: GpuArray, cos: GpuArray, sin: GpuArray, out: GpuArray, batch: int,
             seq: int, heads: int, head_dim: int) -> None:
        """Rotary embedding, half-split layout (see numpy_ref.rope)."""
        self._need(x.dtype, FLOATS, "rope")
        work = batch * seq * heads * (head_dim // 2)
        if work:
            self._launch_1d(f"rope_{SUFFIX[x.dtype]}", work,
                            (x.buffer, cos.buffer, sin.buffer, out.buffer),
                            ROPE.pack(batch, seq, heads, head_dim), "nn")

    # --- attention -------------------------------------------------------------------------
    def attention(self, q: GpuArray, k: GpuArray, v: GpuArray, out: GpuArray, batch: int,
                  q_heads: int, kv_heads: int, q_len: int, kv_len: int, kv_capacity: int,
                  head_dim: int, scale: float, causal: bool, window: int = 0,
                  softcap: float = 0.0) -> None:
        """Scaled dot-product attention with grouped-query heads (see numpy_ref.attention):
        a device's own kernel where it has one (none caps scores), else the ``nn`` kernel,
        else composed from products and a softmax."""
        dt = self._need(q.dtype, FLOATS, "attention")
        if head_dim > 256:
            raise ShapeError(f"attention on the GPU supports head_dim <= 256, got {head_dim}")
        shape = (batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim, scale, causal,
                 window)
        if not softcap and self._attention_special(q, k, v, out, *shape):
            return
        group = q_heads // kv_heads
        kern = self._kernel("nn", f"attention_{SUFFIX[dt]}")
        kern.check_threads(256)
        gx, gy = cdiv(group * q_len, 32), batch * kv_heads
        if gy > MAX_GRID_YZ:
            raise ShapeError(f"attention over {gy} (batch x kv heads) exceeds the GPU grid")
        splits = 1
        target = 2 * self.device.compute_units
        if dt != "float64" and gx * gy < target and kv_len > 128:
            splits = min(cdiv(target, gx * gy), cdiv(kv_len, 64), MAX_GRID_YZ)
        chunk = cdiv(cdiv(kv_len, splits), 32) * 32
        splits = cdiv(kv_len, chunk)
        shared = (32 * head_dim + 32 * (head_dim + 1) + 32 * head_dim) * ACC[dt]
        if shared + kern.static_shared > self.device.max_shared_bytes:
            # the fused kernel's tiles do not fit (Metal's 32 KiB with head_dim above ~72)
            self._attention_composed(q, k, v, out, *shape, softcap)
            return
        kern.reserve_shared(shared)
        rows_out = batch * q_heads * q_len
        part_o = part_ml = out.buffer
        if splits > 1:
            part_o = self._workspace(rows_out * splits * head_dim * 4)
            part_ml = self._workspace(rows_out * splits * 2 * 4)
        hi, lo = split_scale(scale)
        params = ATTN.pack(batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim,
                           splits, chunk, hi, int(bool(causal)), window, lo, softcap)
        self.queue.dispatch(kern, (gx, gy, splits), (32, 8, 1),
                            (q.buffer, k.buffer, v.buffer, out.buffer, part_o, part_ml),
                            params, shared)
        if splits > 1:
            kc = self._kernel("nn", f"attention_combine_{SUFFIX[dt]}")
            self.queue.dispatch(kc, (cdiv(rows_out, 8), 1, 1), (32, 8, 1),
                                (part_o, part_ml, out.buffer), params)

    def _attention_special(self, q, k, v, out, batch, q_heads, kv_heads, q_len, kv_len,
                           kv_capacity, head_dim, scale, causal, window) -> bool:
        """A device's own attention kernel for the shapes it suits; True when one ran."""
        return False

    def _attention_composed(self, q, k, v, out, batch, q_heads, kv_heads, q_len, kv_len,
                            kv_capacity, head_dim, scale, causal, window,
                            softcap: float = 0.0) -> None:
        """Attention from existing kernels, one KV head at a time: scores = Q Kᵀ · scale
        (soft-capped: cap · tanh(scores / cap)) (+ a causal mask of -inf), softmax, then
        P V. For head sizes whose fused kernel does not fit in the device's group memory; it
        moves the scores through memory."""
        dt, group = q.dtype, q_heads // kv_heads
        rows = group * q_len  # the query rows of the heads that share one KV head
        item = ITEMSIZE[dt]

        def part(x: GpuArray, start: int, count: int) -> GpuArray:
            return GpuArray(x.buffer.view(start * item, count * item), count, dt)

        scores, probs = self._new_array(rows * kv_len, dt), self._new_array(rows * kv_len, dt)
        mask = None
        if causal:
            i = np.arange(rows)[:, None] % q_len + (kv_len - q_len)
            key = np.arange(kv_len)[None, :]
            seen = (key <= i) & (key > i - window) if window else key <= i
            mask = self._new_array(rows * kv_len, dt)
            self.from_numpy(np.where(seen, 0.0, -np.inf), mask)
        for slot in range(batch * kv_heads):  # slot = b * kv_heads + kv head
            qs = part(q, slot * rows * head_dim, rows * head_dim)
            ks = part(k, slot * kv_capacity * head_dim, kv_len * head_dim)
            vs = part(v, slot * kv_capacity * head_dim, kv_len * head_dim)
            self.matmul(qs, ks, scores, rows, head_dim, kv_len, transpose_b=True)
            self.scalar_mul(scores, scale / softcap if softcap else scale, scores)
            if softcap:
                self.ewise_tanh(scores, scores)
                self.scalar_mul(scores, softcap, scores)
            if mask is not None:
                self.ewise_add(scores, mask, scores)
            self.softmax(scores, probs, kv_len)
            self.matmul(probs, vs, part(out, slot * rows * head_dim, rows * head_dim),
                        rows, kv_len, head_dim)

    # --- one decode step -------------------------------------------------------------------
    def _decode_plan(self, dtype: str, q_heads: int, kv_heads: int, head_dim: int,
                     capacity: int) -> tuple[int, int, int, int]:
        """(group, chunk, splits, shared bytes of the scores and query): the cache split into
        chunks of positions, one group per (KV head, chunk)."""
        group = q_heads // kv_heads
        chunk = max(64, cdiv(cdiv(capacity, 256), 64) * 64)
        return group, chunk, cdiv(capacity, chunk), group * (head_dim + chunk) * ACC[dtype]

    def _decode_launch_state(self, dt: str, q_heads: int, kv_heads: int, head_dim: int,
                             capacity: int, table_rows: int, splits: int, chunk: int,
                             scale: float, window: int = 0, softcap: float = 0.0) -> tuple:
        """(part_o, part_ml, params): the per-split partial outputs (heads, splits, d) and
        softmax statistics (heads, splits, [m, l]) both decode kernels use, and their params."""
        part_o = self._workspace(q_heads * splits * head_dim * ACC[dt])
        part_ml = self._workspace(q_heads * splits * 2 * ACC[dt])
        params = DECODE.pack(q_heads, kv_heads, head_dim, capacity, table_rows, splits, chunk,
                             window, *split_scale(scale), softcap)
        return part_o, part_ml, params

    def _decode_check(self, kern, group: int, head_dim: int, shared: int, splits: int) -> None:
        if head_dim > 256 or shared + kern.static_shared > self.device.max_shared_bytes \
                or splits > MAX_GRID_YZ:
            raise ShapeError(f"attention_decode: {group} query heads per KV head of size "
                             f"{head_dim} need {shared} bytes of group memory; "
                             f"{self.device.name} has {self.device.max_shared_bytes}")
        kern.check_threads(128)
        kern.reserve_shared(shared)

    def attention_decode(self, qkv: GpuArray, cos: GpuArray, sin: GpuArray,
                         position: GpuArray, keys: GpuArray, values: GpuArray, out: GpuArray,
                         q_heads: int, kv_heads: int, head_dim: int, capacity: int,
                         table_rows: int, scale: float, window: int = 0,
                         softcap: float = 0.0) -> None:
        """One decode step's attention (see numpy_ref.attention_decode): a group per (KV
        head, chunk of the cache) computes every query head of its group (chunks past the
        position, or before a sliding window, return at once), then a second launch merges
        per query head. Both read the
        position from device memory, so a captured step replays for any position."""
        dt = self._need(qkv.dtype, FLOATS, "attention_decode")
        group, chunk, splits, shared = self._decode_plan(dt, q_heads, kv_heads, head_dim,
                                                         capacity)
        kern = self._kernel("nn", f"attention_decode_{SUFFIX[dt]}")
        self._decode_check(kern, group, head_dim, shared, splits)
        part_o, part_ml, params = self._decode_launch_state(
            dt, q_heads, kv_heads, head_dim, capacity, table_rows, splits, chunk, scale, window,
            softcap)
        self.queue.dispatch(kern, (kv_heads, splits, 1), (128, 1, 1),
                            (qkv.buffer, cos.buffer, sin.buffer, position.buffer, keys.buffer,
                             values.buffer, part_o, part_ml), params, shared)
        kc = self._kernel("nn", f"attention_decode_combine_{SUFFIX[dt]}")
        self.queue.dispatch(kc, (q_heads, 1, 1), (cdiv(head_dim, 32) * 32, 1, 1),
                            (position.buffer, part_o, part_ml, out.buffer), params)
