"""One batched forward step over many sequences: the tokens of every sequence in the step
(one per decoding sequence, a chunk of the prompt per prefilling one) laid end to end.

Every projection is one GEMM over all T tokens of the step; RoPE takes each token's own
position; keys and values go to each token's slot in the page pool (``nd.paged_write``);
attention reads each token's own sequence through its block table (``nd.paged_attention``).
Only the rows that choose a next token reach the LM head. The per-layer steps are
``Transformer.forward``'s, so every family that attention can serve this way runs here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import backend_ndarray as nd
from ..backend_ndarray import NDArray
from ..errors import NeedleError
from .pages import PagedKVCache


class UnsupportedModelError(NeedleError):
    """The model has layers the paged engine cannot run (soft-capped attention, or a sliding
    window shorter than its context)."""


@dataclass
class StepBatch:
    """Host arrays describing one step: T tokens of S sequences."""

    tokens: np.ndarray  # (T,) token ids
    positions: np.ndarray  # (T,) each token's position in its sequence
    seq_of: np.ndarray  # (T,) row of block_tables
    slots: np.ndarray  # (T,) pool slot each token's key and value go to
    block_tables: np.ndarray  # (S, max_pages), -1 past a sequence's pages
    logit_rows: np.ndarray  # (R,) tokens whose next-token logits are wanted


def check_supported(model) -> None:
    """UnsupportedModelError unless every layer can use the fused (plain causal) path."""
    tr = model.transformer
    if not all(tr.fused):
        bad = [i for i, f in enumerate(tr.fused) if not f]
        raise UnsupportedModelError(
            f"layers {bad} of this {model.config.arch.family} model use soft-capped attention "
            "or a sliding window shorter than max_seq_len, which the paged engine does not run "
            "yet; use model.generate for one sequence, or load the model with max_seq_len no "
            "longer than its window")


class DeviceBatch:
    """A StepBatch's arrays on the device, all int32 views of one buffer (so one upload
    refreshes them): tokens (1, T), positions, seq_of, slots, logit rows (T,) and block
    tables (T, max_pages). A captured step keeps one and the host rewrites it each step."""

    def __init__(self, tokens: int, max_pages: int, device):
        self.t, self.max_pages = tokens, max_pages
        self.packed = nd.zeros((tokens * (5 + max_pages),), "int32", device)
        part = [self.packed[i * tokens:(i + 1) * tokens] for i in range(5)]
        self.tokens = part[0].reshape((1, tokens))
        self.positions, self.seq_of, self.slots, self.rows = part[1:]
        self.tables = self.packed[5 * tokens:].reshape((tokens, max_pages))

    @staticmethod
    def pack(batch: StepBatch, tokens: int, max_pages: int) -> np.ndarray:
        """The host image of the buffer for ``batch`` padded to ``tokens`` tokens and rows
        and ``max_pages`` columns: padding tokens write nowhere (slot -1) and read position
        0 of row 0."""
        n, rows = len(batch.tokens), len(batch.logit_rows)
        out = np.zeros(tokens * (5 + max_pages), np.int32)
        cols = (batch.tokens, batch.positions, batch.seq_of)
        for i, col in enumerate(cols):
            out[i * tokens:i * tokens + n] = col
        out[3 * tokens:4 * tokens] = -1
        out[3 * tokens:3 * tokens + n] = batch.slots
        out[4 * tokens:4 * tokens + rows] = batch.logit_rows
        tables = -np.ones((tokens, max_pages), np.int32)
        s, p = batch.block_tables.shape
        tables[:s, :p] = batch.block_tables
        out[5 * tokens:] = tables.reshape(-1)
        return out

    def load(self, batch: StepBatch) -> None:
        host = self.pack(batch, self.t, self.max_pages)
        self.packed[...] = nd.array(host, device=self.packed.device)


def upload(batch: StepBatch, device) -> DeviceBatch:
    """A DeviceBatch of exactly the batch's size."""
    out = DeviceBatch(len(batch.tokens), batch.block_tables.shape[1], device)
    out.load(batch)
    return out


def forward(model, cache: PagedKVCache, batch: DeviceBatch, logit_rows: int) -> NDArray:
    """Logits (logit_rows, vocab) of the tokens at ``batch.rows[:logit_rows]``, after
    writing every token's key and value into the pool. Reads nothing on the host, so a
    backend can capture it (``captured.py``)."""
    cfg, tr = model.config, model.transformer
    w = tr.weights
    t = batch.t
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ids, positions, seq_of = batch.tokens, batch.positions, batch.seq_of
    slots, tables = batch.slots, batch.tables
    cos, sin = tr.rope.cos.take(positions), tr.rope.sin.take(positions)  # (T, d / 2)
    x = tr._embed(ids)  # (1, T, hidden)
    for i, layer in enumerate(w.layers):
        h = x.rmsnorm(layer.attn_norm, cfg.rms_norm_eps)
        qkv = layer.qkv(h)
        q = qkv[:, :, :hq * d].reshape((1, t, hq, d))
        k = qkv[:, :, hq * d:(hq + hkv) * d].reshape((1, t, hkv, d))
        v = qkv[:, :, (hq + hkv) * d:].reshape((t, hkv, d))
        if layer.q_norm is not None:  # Qwen3: each head normed before RoPE
            q, k = (q.rmsnorm(layer.q_norm, cfg.rms_norm_eps),
                    k.rmsnorm(layer.k_norm, cfg.rms_norm_eps))
        q, k = q.rope(cos, sin), k.rope(cos, sin)
        nd.paged_write(k.reshape((t, hkv, d)), v, slots, cache.keys[i], cache.values[i])
        a = nd.paged_attention(q.reshape((t, hq, d)), cache.keys[i], cache.values[i], tables,
                               seq_of, positions, cfg.attn_scale)
        a = layer.o(a.reshape((1, t, hq * d)))
        if layer.post_attn_norm is not None:
            a = a.rmsnorm(layer.post_attn_norm, cfg.rms_norm_eps)
        x = x + a
        h = x.rmsnorm(layer.mlp_norm, cfg.rms_norm_eps)
        m = layer.down(tr._gate(layer.gate_up(h)))
        if layer.post_mlp_norm is not None:
            m = m.rmsnorm(layer.post_mlp_norm, cfg.rms_norm_eps)
        x = x + m
    rows = batch.rows if logit_rows == t else batch.rows[:logit_rows]
    last = x.reshape((t, x.shape[-1])).take(rows)  # (R, hidden)
    return tr._logits(last.rmsnorm(w.final_norm, cfg.rms_norm_eps))
