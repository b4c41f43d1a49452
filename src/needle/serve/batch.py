"""One batched forward step over many sequences: the tokens of every sequence in the step
(one per decoding sequence, a chunk of the prompt per prefilling one) laid end to end.

Every projection is one GEMM over all T tokens of the step; RoPE takes each token's own
position; keys and values go to each token's slot in the page pool (``nd.paged_write``);
attention reads each token's own sequence through its block table (``nd.paged_attention``).
Only the rows that choose a next token reach the LM head. The per-layer steps are
``Transformer.forward``'s, so every family that attention can serve this way runs here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .. import backend_ndarray as nd
from ..backend_ndarray import NDArray
from ..models.transformer import _add_norm
from .choice import SamplingRows
from .pages import PagedKVCache


@dataclass
class StepBatch:
    """Host arrays describing one step: T tokens of S sequences."""

    tokens: np.ndarray  # (T,) token ids
    positions: np.ndarray  # (T,) each token's position in its sequence
    seq_of: np.ndarray  # (T,) row of block_tables
    slots: np.ndarray  # (T,) pool slot each token's key and value go to
    block_tables: np.ndarray  # (S, max_pages), -1 past a sequence's pages
    logit_rows: np.ndarray  # (R,) tokens whose next-token logits are wanted
    # Prompt chunks, after the decode tokens: (first token, count, slots of the sequence's
    # positions 0..end). Their attention runs as one dense causal attention per chunk over
    # the sequence's keys gathered from the pool (the fused, tensor-core kernel), not as a
    # paged walk per token; an empty list sends every token through paged_attention.
    chunks: list = dataclasses.field(default_factory=list)
    # how each logits row chooses its token (choice.py); None: every row takes its argmax
    sampling: SamplingRows | None = None
    # prompt tokens whose next-token distribution a request scores (scoring.py): their
    # logits are computed apart from the choosing rows', in slices
    score_rows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))


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
        self.chunks: list = []  # (first token, count, slots NDArray) of prompt chunks

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
        dev = self.packed.device
        self.chunks = [(first, count, nd.array(slots.astype(np.int32), device=dev))
                       for first, count, slots in batch.chunks]


def upload(batch: StepBatch, device) -> DeviceBatch:
    """A DeviceBatch of exactly the batch's size."""
    out = DeviceBatch(len(batch.tokens), batch.block_tables.shape[1], device)
    out.load(batch)
    return out


def forward(model, cache: PagedKVCache, batch: DeviceBatch, logit_rows: int) -> NDArray:
    """Logits (logit_rows, vocab) of the tokens at ``batch.rows[:logit_rows]``, after
    writing every token's key and value into the pool. Reads nothing on the host, so a
    backend can capture it (``captured.py``)."""
    return logits(model, hidden_states(model, cache, batch), batch, logit_rows)


def logits(model, hidden: NDArray, batch: DeviceBatch, logit_rows: int) -> NDArray:
    """The LM head's logits (logit_rows, vocab) of ``hidden_states``' choosing rows."""
    rows = batch.rows if logit_rows == batch.t else batch.rows[:logit_rows]
    return model.transformer._logits(hidden.take(rows))


def hidden_states(model, cache: PagedKVCache, batch: DeviceBatch) -> NDArray:
    """Every token's final normed hidden state (T, hidden), after writing every token's
    key and value into the pool."""
    cfg, tr = model.config, model.transformer
    w = tr.weights
    t = batch.t
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ids, positions, slots = batch.tokens, batch.positions, batch.slots
    # each table set's rows at the tokens' positions (T, d / 2), once for all its layers
    rotary = {id(r): (r.cos.take(positions), r.sin.take(positions))
              for r in tr.rope.distinct()}
    x = tr._embed(ids)  # (1, T, hidden)
    delta = None  # the last sublayer's output, added to x by the next norm (add_rmsnorm)
    delta_norm = None  # its post-norm (sandwich norms), taken in the same pass
    for i, layer in enumerate(w.layers):
        x, h = _add_norm(x, delta, layer.attn_norm, cfg, delta_norm)
        q, k, v = tr._roped_heads(layer, layer.qkv(h), *rotary[id(tr.rope.for_layer(i))])
        nd.paged_write(k.reshape((t, hkv, d)), v.reshape((t, hkv, d)), slots, cache.keys[i],
                       cache.values[i])
        a = _attention(cfg, q.reshape((t, hq, d)), cache.keys[i], cache.values[i], batch,
                       cfg.layer_windows[i])
        a = layer.o(a.reshape((1, t, hq * d)))
        x, h = _add_norm(x, a, layer.mlp_norm, cfg, layer.post_attn_norm)
        delta, delta_norm = layer.down(tr._gate(layer.gate_up(h))), layer.post_mlp_norm
    x, h = _add_norm(x, delta, w.final_norm, cfg, delta_norm)
    return h.reshape((t, x.shape[-1]))


def _attention(cfg, q: NDArray, keys: NDArray, values: NDArray, batch: DeviceBatch,
               window: int | None) -> NDArray:
    """Attention of every token of the step (tokens, q_heads, d): the decode tokens (and
    all of them when there are no prompt chunks) through their pages, each prompt chunk as
    a dense causal attention over its sequence's keys and values gathered from the pool
    (each with the layer's window and soft cap)."""
    if not batch.chunks:
        return nd.paged_attention(q, keys, values, batch.tables, batch.seq_of,
                                  batch.positions, cfg.attn_scale, window, cfg.attn_softcap)
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    first = batch.chunks[0][0]
    parts = []
    if first:
        parts.append(nd.paged_attention(q[:first], keys, values, batch.tables,
                                        batch.seq_of[:first], batch.positions[:first],
                                        cfg.attn_scale, window, cfg.attn_softcap))
    flat_k, flat_v = (x.reshape((x.shape[0] * x.shape[1], hkv * d)) for x in (keys, values))
    heads_first = (0, 2, 1, 3)
    for start, count, slots in batch.chunks:
        length = slots.size  # positions 0..length-1; the chunk is the last `count` of them
        k = flat_k.take(slots).reshape((1, length, hkv, d)).permute(heads_first)
        v = flat_v.take(slots).reshape((1, length, hkv, d)).permute(heads_first)
        qc = q[start:start + count].reshape((1, count, hq, d)).permute(heads_first)
        out = nd.attention(qc, k, v, scale=cfg.attn_scale, causal=True, window=window,
                           softcap=cfg.attn_softcap)
        parts.append(out.permute(heads_first).reshape((count, hq, d)))
    return parts[0] if len(parts) == 1 else nd.concatenate(parts, axis=0)
