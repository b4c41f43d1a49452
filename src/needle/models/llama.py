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
  and nothing depends on a host integer: keys and values are added into the zeroed cache at
  rows computed on the device, and attention covers the whole cache with a mask of the
  positions not yet written. That is what lets a GPU backend capture the step once and
  replay it for every token (``needle.models.decoder``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

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


class KVCache:
    """Keys and values of every layer for up to ``capacity`` positions, preallocated.

    Both are stored (1, kv_heads, capacity, head_dim) (one sequence): the decode step's
    q·Kᵀ reads the keys as a transposed operand and p·V the values as they are, so neither
    is copied per token, and a new key or value is one row of ``head_dim`` per head.
    ``clear`` zeroes both, which the decode step relies on: it *adds* each new key and value
    into its (zero) slot.

    The cache has the model's dtype where the backend writes half-precision rows natively
    (feature ``half_scatter``: CUDA); elsewhere it is float32 whatever the model's dtype,
    because the device-indexed add that writes a slot is native for float32 on every backend
    (a half-precision one would convert the whole cache on each write). Half-precision keys
    and values are stored exactly either way.
    """

    dtype = "float32"  # the widest choice, which memory estimates assume

    def __init__(self, cfg: LlamaConfig, capacity: int, device, dtype: str = "float32"):
        self.capacity = capacity
        features = getattr(getattr(device.backend, "device", None), "features", ())
        if dtype in ("float16", "bfloat16") and "half_scatter" in features:
            self.dtype = dtype
        kv, d = cfg.num_kv_heads, cfg.head_dim
        self.keys = [nd.empty((1, kv, capacity, d), self.dtype, device)
                     for _ in range(cfg.num_layers)]
        self.values = [nd.empty((1, kv, capacity, d), self.dtype, device)
                       for _ in range(cfg.num_layers)]
        self.clear()

    def clear(self) -> None:
        for array in self.keys + self.values:
            array.fill(0)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)


class RotaryTables:
    """cos and sin of every position up to ``length``, (length, head_dim/2), on the device.

    A second pair is pre-multiplied by the attention scale 1/sqrt(head_dim): rotating the
    decode step's queries with it scales the scores for free (the step has no fused
    attention kernel to do it).
    """

    def __init__(self, cfg: LlamaConfig, length: int, device, dtype: str):
        cos, sin = cfg.rope.tables(cfg.head_dim, length)
        scale = np.float32(1 / math.sqrt(cfg.head_dim))
        self.cos, self.sin, self.q_cos, self.q_sin = (
            nd.array(t, dtype=dtype, device=device) for t in (cos, sin, cos * scale, sin * scale))

    def span(self, length: int) -> tuple[Tensor, Tensor]:
        """cos and sin of positions 0..length-1."""
        return _const(self.cos[:length]), _const(self.sin[:length])


class DecodeState:
    """The inputs of one decode step, in device buffers the host rewrites before each step,
    and the arrays derived from them on the device at the start of the step."""

    def __init__(self, cfg: LlamaConfig, capacity: int, device, dtype: str = "float32"):
        kv, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
        self.token = nd.zeros((1, 1), "int32", device)
        self.position = nd.zeros((1,), "int32", device)
        # rows of the caches viewed as (kv_heads * capacity) x head_dim
        self._rows = nd.array(np.arange(kv, dtype=np.int32) * capacity, device=device)
        slots = np.broadcast_to(np.arange(capacity, dtype=np.int32), (1, kv, group, capacity))
        self._slots = nd.array(slots, device=device)
        self._zero = nd.zeros(slots.shape, dtype, device)
        self._neg_inf = nd.full(slots.shape, -np.inf, dtype, device)

    def set(self, token: int, position: int) -> None:
        self.token[...] = token
        self.position[...] = position

    def derive(self, rope: RotaryTables) -> StepArrays:
        pos = self.position
        visible = self._slots <= pos.reshape((1, 1, 1, 1))
        return StepArrays(
            cos=_const(rope.cos.take(pos)), sin=_const(rope.sin.take(pos)),
            q_cos=_const(rope.q_cos.take(pos)), q_sin=_const(rope.q_sin.take(pos)),
            rows=self._rows + pos, mask=nd.where(visible, self._zero, self._neg_inf))


@dataclass
class StepArrays:
    """Position-dependent arrays of one decode step, shared by all layers: RoPE rows (the
    query's pre-scaled), the cache rows to write, and the attention mask."""

    cos: Tensor
    sin: Tensor
    q_cos: Tensor
    q_sin: Tensor
    rows: NDArray
    mask: NDArray


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with rotary positions."""

    def __init__(self, cfg: LlamaConfig, prefix: str, weights: WeightSource, shapes: dict):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            _linear(weights, shapes, f"{prefix}.{n}") for n in ("q_proj", "k_proj", "v_proj",
                                                                 "o_proj"))

    def _project(self, x: Tensor, cos, sin, q_cos, q_sin) -> tuple[Tensor, Tensor, Tensor]:
        b, s, _ = x.shape
        d = self.head_dim
        q = ops.reshape(self.q_proj(x), (b, s, self.num_heads, d))
        k = ops.reshape(self.k_proj(x), (b, s, self.num_kv_heads, d))
        v = ops.reshape(self.v_proj(x), (b, s, self.num_kv_heads, d))
        return ops.rope(q, q_cos, q_sin), ops.rope(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keys: NDArray | None = None,
                values: NDArray | None = None) -> Tensor:
        """Causal attention over positions 0..seq-1; stores keys/values when given a cache."""
        b, s, _ = x.shape
        q, k, v = self._project(x, cos, sin, cos, sin)
        if keys is not None:
            keys[:, :, :s, :] = k.realize_cached_data().permute((0, 2, 1, 3))
            values[:, :, :s, :] = v.realize_cached_data().permute((0, 2, 1, 3))
        heads_first = (0, 2, 1, 3)
        out = ops.scaled_dot_product_attention(ops.permute(q, heads_first),
                                               ops.permute(k, heads_first),
                                               ops.permute(v, heads_first), causal=True)
        out = ops.reshape(ops.permute(out, heads_first), (b, s, self.num_heads * self.head_dim))
        return self.o_proj(out)

    def decode(self, x: Tensor, step: StepArrays, keys: NDArray, values: NDArray) -> Tensor:
        """One position (x is (1, 1, hidden)) against the whole cache, masked."""
        q, k, v = (t.realize_cached_data() for t in self._project(
            x, step.cos, step.sin, step.q_cos, step.q_sin))
        kv, d = self.num_kv_heads, self.head_dim
        rows = keys.size // d
        for new, cache in ((k, keys), (v, values)):
            nd.scatter_add(step.rows, new.astype(cache.dtype).reshape((kv, d)), rows,
                           out=cache.reshape((rows, d)))
        q4 = q.reshape((1, kv, self.num_heads // kv, d))
        probs = ((q4 @ keys.permute((0, 1, 3, 2))) + step.mask).softmax()
        out = (probs @ values).astype(q.dtype).reshape((1, 1, self.num_heads * d))
        return self.o_proj(_const(out))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, prefix: str, weights: WeightSource, shapes: dict):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            _linear(weights, shapes, f"{prefix}.{n}") for n in ("gate_proj", "up_proj",
                                                                "down_proj"))

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


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

    def decode(self, x: Tensor, step: StepArrays, keys: NDArray, values: NDArray) -> Tensor:
        x = x + self.self_attn.decode(self.input_layernorm(x), step, keys, values)
        return x + self.mlp(self.post_attention_layernorm(x))


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
            step = state.derive(self.rope)
            x = self.model.embed_tokens(_const(state.token))
            for i, layer in enumerate(self.model.layers):
                x = layer.decode(x, step, cache.keys[i], cache.values[i])
            return self._logits(x).realize_cached_data().reshape((1, self.config.vocab_size))

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
