"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) as needle Modules.

Layers are needle's own ``Linear``, ``Embedding`` and ``RMSNorm``, built over checkpoint
weights instead of a random initialisation (loading 8 billion weights must not first draw
8 billion random numbers). Projection matrices stay in the checkpoint's (out, in) layout and
``Linear.weight`` is its transposed view, so nothing is copied at load time and a
matrix-vector product during decoding streams whole rows of the original matrix.

Three passes share the same modules:

* ``forward(ids)``: logits for every position, causal attention over the sequence (the
  ops are needle TensorOps, so this pass is differentiable).
* ``prefill``: the same pass over a prompt that also stores its keys and values in a
  ``KVCache`` and returns only the last position's logits.
* ``decode_step``: one token at the position held in a device buffer. Every shape is fixed
  and nothing depends on a host integer: ``attention_decode`` rotates the query and key at
  that position, stores the key and value in the cache and attends over positions 0..p in
  one call, the residual adds ride on the next RMSNorm (``add_rmsnorm``) and the gate and up
  projections are one matrix (``swiglu`` splits it). That is what lets a GPU backend capture
  the step once and replay it for every token (``needle.models.decoder``), with few kernels
  per layer.

The query, key and value projections are stored as one (q + k + v, hidden) matrix and the
gate and up projections as one (2 * intermediate, hidden) matrix, concatenated at load time:
a decode step reads each with one matrix-vector product. ``q_proj``, ``gate_proj`` etc.
remain available as views of them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import backend_ndarray as nd
from .. import nn, ops
from ..autograd import Tensor, no_grad
from ..backend_ndarray import NDArray
from ..errors import IndexOutOfRangeError, ShapeError
from .config import LlamaConfig

# (name, shape) -> the checkpoint tensor as an NDArray on the model's device and dtype
WeightSource = Callable[[str, tuple[int, ...]], NDArray]


def _const(array: NDArray) -> Tensor:
    return Tensor.make_const(array)


class Linear(nn.Linear):
    """``nn.Linear`` over a checkpoint's (out_features, in_features) weight, without a copy."""

    def __init__(self, weight: NDArray, bias: NDArray | None = None):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.transpose())
        self.bias = nn.Parameter(bias) if bias is not None else None


class Embedding(nn.Embedding):
    """``nn.Embedding`` over a checkpoint's (vocab, hidden) table."""

    def __init__(self, weight: NDArray):
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = weight.shape
        self.weight = nn.Parameter(weight)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` over a checkpoint's scale vector."""

    def __init__(self, weight: NDArray, eps: float):
        nn.Module.__init__(self)
        self.dim, self.eps = weight.shape[0], eps
        self.weight = nn.Parameter(weight)


def _linear(weights: WeightSource, shapes: dict, name: str) -> Linear:
    bias = f"{name}.bias"
    return Linear(weights(f"{name}.weight", shapes[f"{name}.weight"]),
                  weights(bias, shapes[bias]) if bias in shapes else None)


def _fused(weights: WeightSource, shapes: dict, names: list[str]) -> tuple[Linear, list[int]]:
    """One Linear over the checkpoint matrices ``names`` stacked along their output axis
    (and their biases, when every one has one), and the output sizes of the parts."""
    parts = [weights(f"{n}.weight", shapes[f"{n}.weight"]) for n in names]
    biases = [f"{n}.bias" for n in names]
    bias = None
    if all(b in shapes for b in biases):
        bias = nd.concatenate([weights(b, shapes[b]) for b in biases])
    sizes = [w.shape[0] for w in parts]
    fused = Linear(nd.concatenate(parts), bias)
    del parts  # the separate matrices are freed as soon as the fused one exists
    return fused, sizes


def _part(fused: Linear, start: int, stop: int) -> Linear:
    """A Linear over rows start..stop-1 of a fused projection (a view, no copy)."""
    weight = fused.weight.realize_cached_data().transpose()[start:stop]
    bias = fused.bias.realize_cached_data()[start:stop] if fused.bias is not None else None
    return Linear(weight, bias)


class KVCache:
    """Keys and values of every layer for up to ``capacity`` positions, preallocated.

    Both are stored (1, kv_heads, capacity, head_dim) in the model's dtype (one sequence):
    prefill writes positions 0..n-1, and each decode step's ``attention_decode`` writes its
    position and reads positions 0..p, so nothing past the current length is ever read.
    """

    def __init__(self, cfg: LlamaConfig, capacity: int, device, dtype: str = "float32"):
        self.capacity, self.dtype = capacity, dtype
        kv, d = cfg.num_kv_heads, cfg.head_dim
        self.keys = [nd.empty((1, kv, capacity, d), dtype, device)
                     for _ in range(cfg.num_layers)]
        self.values = [nd.empty((1, kv, capacity, d), dtype, device)
                       for _ in range(cfg.num_layers)]
        self.clear()

    def clear(self) -> None:
        for array in self.keys + self.values:
            array.fill(0)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)


class RotaryTables:
    """cos and sin of every position up to ``length``, (length, head_dim/2), on the device."""

    def __init__(self, cfg: LlamaConfig, length: int, device, dtype: str):
        cos, sin = cfg.rope.tables(cfg.head_dim, length)
        self.cos, self.sin = (nd.array(t, dtype=dtype, device=device) for t in (cos, sin))

    def span(self, length: int) -> tuple[Tensor, Tensor]:
        """cos and sin of positions 0..length-1."""
        return _const(self.cos[:length]), _const(self.sin[:length])


class DecodeState:
    """The inputs of one decode step, in device buffers the host rewrites before each step."""

    def __init__(self, cfg: LlamaConfig, capacity: int, device, dtype: str = "float32"):
        self.token = nd.zeros((1, 1), "int32", device)
        self.position = nd.zeros((1,), "int32", device)

    def set(self, token: int, position: int) -> None:
        self.token[...] = token
        self.position[...] = position


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with rotary positions; q, k and v in one projection."""

    def __init__(self, cfg: LlamaConfig, prefix: str, weights: WeightSource, shapes: dict):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim)
        self.qkv_proj, self._sizes = _fused(weights, shapes, [f"{prefix}.{n}" for n in
                                                              ("q_proj", "k_proj", "v_proj")])
        self.o_proj = _linear(weights, shapes, f"{prefix}.o_proj")

    def _view(self, i: int) -> Linear:
        start = sum(self._sizes[:i])
        return _part(self.qkv_proj, start, start + self._sizes[i])

    q_proj = property(lambda self: self._view(0), doc="the query projection (a view)")
    k_proj = property(lambda self: self._view(1), doc="the key projection (a view)")
    v_proj = property(lambda self: self._view(2), doc="the value projection (a view)")

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keys: NDArray | None = None,
                values: NDArray | None = None) -> Tensor:
        """Causal attention over positions 0..seq-1; stores keys/values when given a cache."""
        b, s, _ = x.shape
        d, hq, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)
        q = ops.rope(ops.reshape(qkv[:, :, :hq * d], (b, s, hq, d)), cos, sin)
        k = ops.rope(ops.reshape(qkv[:, :, hq * d:(hq + hkv) * d], (b, s, hkv, d)), cos, sin)
        v = ops.reshape(qkv[:, :, (hq + hkv) * d:], (b, s, hkv, d))
        if keys is not None:
            keys[:, :, :s, :] = k.realize_cached_data().permute((0, 2, 1, 3))
            values[:, :, :s, :] = v.realize_cached_data().permute((0, 2, 1, 3))
        heads_first = (0, 2, 1, 3)
        out = ops.scaled_dot_product_attention(ops.permute(q, heads_first),
                                               ops.permute(k, heads_first),
                                               ops.permute(v, heads_first), causal=True)
        out = ops.reshape(ops.permute(out, heads_first), (b, s, hq * d))
        return self.o_proj(out)

    def decode(self, h: NDArray, rope: RotaryTables, position: NDArray, keys: NDArray,
               values: NDArray) -> NDArray:
        """One token (h: its normed hidden state, (1, 1, hidden)) against the cache; the
        attention block's output (1, 1, hidden)."""
        qkv = self.qkv_proj(_const(h)).realize_cached_data()
        out = nd.attention_decode(qkv, rope.cos, rope.sin, position, keys, values,
                                  self.num_heads)
        return self.o_proj(_const(out.reshape((1, 1, out.size)))).realize_cached_data()


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)), with gate and up in one projection."""

    def __init__(self, prefix: str, weights: WeightSource, shapes: dict):
        super().__init__()
        self.gate_up_proj, sizes = _fused(weights, shapes, [f"{prefix}.gate_proj",
                                                            f"{prefix}.up_proj"])
        self.intermediate = sizes[0]
        self.down_proj = _linear(weights, shapes, f"{prefix}.down_proj")

    gate_proj = property(lambda self: _part(self.gate_up_proj, 0, self.intermediate),
                         doc="the gate projection (a view)")
    up_proj = property(lambda self: _part(self.gate_up_proj, self.intermediate,
                                          2 * self.intermediate), doc="the up projection (a view)")

    def forward(self, x: Tensor) -> Tensor:
        gu, i = self.gate_up_proj(x), self.intermediate
        return self.down_proj(ops.silu_mul(gu[..., :i], gu[..., i:]))

    def decode(self, h: NDArray) -> NDArray:
        gu = self.gate_up_proj(_const(h)).realize_cached_data()
        return self.down_proj(_const(gu.swiglu())).realize_cached_data()


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig, index: int, weights: WeightSource, shapes: dict):
        super().__init__()
        p = f"model.layers.{index}"
        self.input_layernorm = RMSNorm(weights(f"{p}.input_layernorm.weight",
                                               (cfg.hidden_size,)), cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, f"{p}.self_attn", weights, shapes)
        self.post_attention_layernorm = RMSNorm(
            weights(f"{p}.post_attention_layernorm.weight", (cfg.hidden_size,)),
            cfg.rms_norm_eps)
        self.mlp = LlamaMLP(f"{p}.mlp", weights, shapes)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keys: NDArray | None = None,
                values: NDArray | None = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, keys, values)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(self, x: NDArray, delta: NDArray | None, rope: RotaryTables,
               position: NDArray, keys: NDArray, values: NDArray) -> tuple[NDArray, NDArray]:
        """One token: the residual stream ``x`` plus the previous layer's pending ``delta``
        (added here, in place, by the first norm); returns (x, this layer's delta)."""
        x, h = _add_norm(x, delta, self.input_layernorm)
        x, h = _add_norm(x, self.self_attn.decode(h, rope, position, keys, values),
                         self.post_attention_layernorm)
        return x, self.mlp.decode(h)


def _add_norm(x: NDArray, delta: NDArray | None, norm: RMSNorm) -> tuple[NDArray, NDArray]:
    """(x + delta, norm(x + delta)), the sum written into x."""
    w = norm.weight.realize_cached_data()
    if delta is None:
        return x, x.rmsnorm(w, norm.eps)
    return nd.add_rmsnorm(x, delta, w, norm.eps, inplace=True)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (the Hugging Face ``model.`` prefix)."""

    def __init__(self, cfg: LlamaConfig, weights: WeightSource, shapes: dict):
        super().__init__()
        self.embed_tokens = Embedding(weights("model.embed_tokens.weight",
                                              (cfg.vocab_size, cfg.hidden_size)))
        self.layers = [LlamaDecoderLayer(cfg, i, weights, shapes) for i in range(cfg.num_layers)]
        self.norm = RMSNorm(weights("model.norm.weight", (cfg.hidden_size,)), cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """A Llama-family language model: token ids in, next-token logits out.

    ``weights(name, shape)`` supplies each checkpoint tensor on the target device and dtype
    (``needle.models.load_pretrained`` reads them from safetensors files). ``max_seq_len``
    bounds prompt plus generated tokens; it sizes the rotary tables and the KV cache.
    """

    def __init__(self, cfg: LlamaConfig, weights: WeightSource, max_seq_len: int, device,
                 dtype: str):
        super().__init__()
        self.config, self.max_seq_len, self.device, self.dtype = cfg, max_seq_len, device, dtype
        shapes = cfg.tensor_shapes()
        self.model = LlamaModel(cfg, weights, shapes)
        head = (self.model.embed_tokens.weight.realize_cached_data()
                if cfg.tie_word_embeddings else weights("lm_head.weight", shapes["lm_head.weight"]))
        self.lm_head = Linear(head)
        self.rope = RotaryTables(cfg, max_seq_len, device, dtype)
        self.tokenizer = None  # set by load_pretrained when the model ships tokenizer.json
        self._decoder = None
        self.eval()

    # --- passes ----------------------------------------------------------------------------
    def _ids(self, ids) -> NDArray:
        """Token ids as a (batch, seq) int32 array on the device, checked on the host."""
        if isinstance(ids, Tensor):
            ids = ids.realize_cached_data()
        host = np.asarray(ids.numpy() if isinstance(ids, NDArray) else ids)
        if host.ndim == 1:
            host = host[None, :]
        if host.ndim != 2 or host.shape[1] == 0 or host.dtype.kind not in "iu":
            raise ShapeError(f"token ids must be a non-empty (batch, seq) array of ints, got "
                             f"shape {host.shape} of {host.dtype}")
        if host.shape[1] > self.max_seq_len:
            raise ShapeError(f"{host.shape[1]} tokens exceed max_seq_len {self.max_seq_len}; "
                             "load the model with a larger max_seq_len")
        if host.min() < 0 or host.max() >= self.config.vocab_size:
            bad = int(host.min() if host.min() < 0 else host.max())
            raise IndexOutOfRangeError(f"token id {bad} is outside the vocabulary "
                                       f"(0..{self.config.vocab_size - 1})")
        return nd.array(host.astype(np.int32), device=self.device)

    def _hidden(self, ids: NDArray, cache: KVCache | None) -> Tensor:
        x = self.model.embed_tokens(_const(ids))
        cos, sin = self.rope.span(ids.shape[1])
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, *((cache.keys[i], cache.values[i]) if cache else ()))
        return x

    def _logits(self, x: Tensor) -> Tensor:
        return self.lm_head(self.model.norm(x))

    def forward(self, ids) -> Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq), each position seeing only
        the positions before it."""
        return self._logits(self._hidden(self._ids(ids), None))

    def prefill(self, ids, cache: KVCache) -> NDArray:
        """Run the prompt ``ids`` (1, seq) from position 0, filling ``cache``; the logits of
        its last position, shape (1, vocab)."""
        with no_grad():
            x = self._hidden(self._ids(ids), cache)
            return self._logits(x[:, x.shape[1] - 1, :]).realize_cached_data()

    def decode_step(self, state: DecodeState, cache: KVCache) -> NDArray:
        """Logits (1, vocab) for ``state.token`` at ``state.position``, extending ``cache``."""
        with no_grad():
            x = self.model.embed_tokens(_const(state.token)).realize_cached_data()
            delta = None
            for i, layer in enumerate(self.model.layers):
                x, delta = layer.decode(x, delta, self.rope, state.position, cache.keys[i],
                                        cache.values[i])
            _, h = _add_norm(x, delta, self.model.norm)
            return self.lm_head(_const(h)).realize_cached_data().reshape(
                (1, self.config.vocab_size))

    # --- generation ----------------------------------------------------------------------
    def decoder(self):
        """The model's Decoder (KV cache and, on GPUs, the captured decode step), made once
        and reused by every generation."""
        if self._decoder is None:
            from .decoder import Decoder

            self._decoder = Decoder(self)
        return self._decoder

    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop=None, callback=None, stats=None) -> list[int]:
        """New token ids after ``prompt_ids`` (greedy when temperature is 0); see
        ``needle.models.generate.generate``."""
        from .generate import generate

        return generate(self, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed,
                        stop, callback, stats)

    def stream(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               stop=None, stats=None):
        """An iterator over the new token ids, each yielded as soon as it is chosen."""
        from .generate import stream

        return stream(self, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, stop,
                      stats)
