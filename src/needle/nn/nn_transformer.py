"""Attention and Transformer layers.

Attention itself is one fused op (``ops.scaled_dot_product_attention``) with grouped-query
heads: ``num_kv_heads`` smaller than ``num_heads`` shares each key/value head among a group
of query heads, which shrinks the K/V projections. Layers take (batch, seq, dim) input;
``Transformer`` also accepts (seq, batch, dim) like needle's.
"""

from __future__ import annotations

import numpy as np

from .. import checks, ops
from ..autograd import Tensor
from ..backend_ndarray import NDArray
from ..errors import ShapeError
from .nn_basic import Dropout, LayerNorm1d, Linear, Module, ReLU, Sequential
from .nn_sequence import Embedding


class MultiHeadAttention(Module):
    """Multi-head (optionally grouped-query) attention with input and output projections.

    ``forward(x, context=None)`` attends from x (batch, q_len, dim) to ``context`` (batch,
    kv_len, dim), or to x itself. With ``causal``, position i sees positions <= i (the last
    q_len positions of the context). The fused kernel gives no access to the attention
    probabilities, so ``dropout`` applies to the output projection.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None,
                 causal: bool = False, dropout: float = 0.0, bias: bool = True, device=None,
                 dtype="float32"):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        dim = checks.positive(dim, "dim", "nn.MultiHeadAttention")
        num_heads = checks.positive(num_heads, "num_heads", "nn.MultiHeadAttention")
        num_kv_heads = checks.positive(num_kv_heads, "num_kv_heads", "nn.MultiHeadAttention")
        if dim % num_heads or num_heads % num_kv_heads:
            raise ShapeError(f"MultiHeadAttention needs dim ({dim}) divisible by num_heads "
                             f"({num_heads}) and num_heads by num_kv_heads ({num_kv_heads})")
        self.dim, self.num_heads, self.num_kv_heads = dim, num_heads, num_kv_heads
        self.head_dim, self.causal = dim // num_heads, causal
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = Linear(dim, dim, bias, device, dtype)
        self.k_proj = Linear(dim, kv_dim, bias, device, dtype)
        self.v_proj = Linear(dim, kv_dim, bias, device, dtype)
        self.out_proj = Linear(dim, dim, bias, device, dtype)
        self.dropout = Dropout(dropout)

    def _heads(self, x, heads: int):
        """(batch, seq, heads * head_dim) -> (batch, heads, seq, head_dim)."""
        batch, seq, _ = x.shape
        return ops.permute(ops.reshape(x, (batch, seq, heads, self.head_dim)), (0, 2, 1, 3))

    def forward(self, x, context=None):
        if x.ndim != 3 or x.shape[2] != self.dim:
            raise ShapeError(f"MultiHeadAttention needs input (batch, seq, {self.dim}), got "
                             f"{x.shape}")
        context = x if context is None else context
        q = self._heads(self.q_proj(x), self.num_heads)
        k = self._heads(self.k_proj(context), self.num_kv_heads)
        v = self._heads(self.v_proj(context), self.num_kv_heads)
        out = ops.scaled_dot_product_attention(q, k, v, causal=self.causal)
        batch, _, seq, _ = out.shape
        out = ops.reshape(ops.permute(out, (0, 2, 1, 3)), (batch, seq, self.dim))
        return self.dropout(self.out_proj(out))


class TransformerLayer(Module):
    """A pre-norm block: x + attention(norm(x)), then x + MLP(norm(x)) with a ReLU MLP of
    width ``hidden_size``."""

    def __init__(self, dim: int, num_heads: int, hidden_size: int,
                 num_kv_heads: int | None = None, dropout: float = 0.0, causal: bool = True,
                 device=None, dtype="float32"):
        super().__init__()
        checks.positive(hidden_size, "hidden_size", "nn.TransformerLayer")
        self.attn_norm = LayerNorm1d(dim, device=device, dtype=dtype)
        self.attn = MultiHeadAttention(dim, num_heads, num_kv_heads, causal, dropout,
                                       device=device, dtype=dtype)
        self.mlp_norm = LayerNorm1d(dim, device=device, dtype=dtype)
        self.mlp = Sequential(Linear(dim, hidden_size, device=device, dtype=dtype), ReLU(),
                              Dropout(dropout), Linear(hidden_size, dim, device=device,
                                                       dtype=dtype), Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(Module):
    """Learned positional embeddings, ``num_layers`` TransformerLayers and a final norm.

    Input is (seq, batch, dim), or (batch, seq, dim) with ``batch_first``; the output has the
    input's layout. Sequences may be up to ``max_len`` long.
    """

    def __init__(self, embedding_size: int, hidden_size: int, num_layers: int,
                 num_heads: int = 8, num_kv_heads: int | None = None, dropout: float = 0.0,
                 causal: bool = True, max_len: int = 2048, batch_first: bool = False,
                 device=None, dtype="float32"):
        super().__init__()
        checks.positive(num_layers, "num_layers", "nn.Transformer")
        checks.positive(max_len, "max_len", "nn.Transformer")
        self.batch_first, self.max_len = batch_first, max_len
        self.position = Embedding(max_len, embedding_size, device=device, dtype=dtype)
        self.layers = [TransformerLayer(embedding_size, num_heads, hidden_size, num_kv_heads,
                                        dropout, causal, device, dtype)
                       for _ in range(num_layers)]
        self.norm = LayerNorm1d(embedding_size, device=device, dtype=dtype)

    def forward(self, x):
        if not self.batch_first:
            x = ops.permute(x, (1, 0, 2))
        seq = x.shape[1]
        if seq > self.max_len:
            raise ShapeError(f"sequence of {seq} positions exceeds max_len {self.max_len}")
        ids = Tensor(NDArray(np.arange(seq), device=x.device, dtype="int64"),
                     requires_grad=False)
        x = x + ops.broadcast_to(self.position(ids), x.shape)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return x if self.batch_first else ops.permute(x, (1, 0, 2))
