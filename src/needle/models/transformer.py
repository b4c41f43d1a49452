"""The decoder's forward pass, on NDArrays only: a prompt (prefill) and one token (decode).

Read it as llama2.c's ``forward``: each line one named step. Every family runs this code;
where one departs from Llama (``architectures.py``) a branch says so. The decode step
keeps all shapes fixed and reads the token and its position from device buffers, so a GPU
backend can capture it once and replay it for every token (``decoder.py``). A plain Llama
layer is five fused array operations (``_fused_layer``): norm + QKV projection, attention
(RoPE, cache write and attention in one ``attention_decode``), output projection +
residual, norm + gate/up projection + SiLU·mul, down projection + residual (Qwen3 adds its
heads' norms, ``qk_rmsnorm``, as a sixth). Other layers (Gemma's extra norms and GeGLU)
compose the same steps from single operations, their residual adds riding on the next norm
(``add_rmsnorm``). The five-operation form is
used where the backend declares ``fused_matvec`` (its fused kernels are faster) or
``folded_norm_matvec`` (then each norm's scale is multiplied into the next projection's
weights at load, ``fold_norm``, and the projection takes the norm in the same pass), for
quantized weights where it declares ``fused_quant_matvec``; ``NEEDLE_FUSED_DECODE=1`` or
``0`` forces it on or off.
"""

from __future__ import annotations

import math
import os

import numpy as np

from .. import backend_ndarray as nd
from ..backend_ndarray import NDArray, dtypes
from ..backends.api import has
from .cache import DecodeState, KVCache, RotaryTables
from .config import ModelConfig
from .weights import LayerWeights, ModelWeights, Projection, fold_norm


class Transformer:
    """Weights, rotary tables and the per-layer choice of attention path of one model."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, rope: RotaryTables):
        self.cfg, self.weights, self.rope = cfg, weights, rope
        backend = weights.embed.device.backend
        self.packed_fused = has(backend, "fused_quant_matvec")
        # where a decode step keeps its residual stream: a fresh array (None), or one the
        # caller placed (tensor parallelism: in memory its all-reduces are fastest on)
        self.decode_residual: NDArray | None = None
        self.plan_decode()
        if has(backend, "folded_norm_matvec"):
            self._fold_norms()
        # Gemma scales embeddings by sqrt(hidden) rounded to the model's dtype
        dtype = dtypes.to_numpy_dtype(weights.embed.dtype)
        self.embed_scale = (float(np.asarray(math.sqrt(cfg.hidden_size), dtype))
                            if cfg.arch.scale_embeddings else None)

    def plan_decode(self) -> None:
        """Choose each layer's decode step: the five fused operations (``_fused_layer``)
        where the backend's fused projections are faster than the ops they fuse, or when
        asked (NEEDLE_FUSED_DECODE); call again after replacing projections (tensor
        parallelism's all-reducing ones are not plain)."""
        choice = os.environ.get("NEEDLE_FUSED_DECODE", "auto")
        backend = self.weights.embed.device.backend
        self.five_ops = [_fusable(self.cfg, layer, self.packed_fused)
                         and _fuse(choice, backend, layer) for layer in self.weights.layers]

    def _fold_norms(self) -> None:
        """Where the backend runs a norm inside the next projection (``folded_norm_matvec``):
        each five-operation dense layer's two norms, and the final norm unless the head is
        the embedding, are multiplied into the projections they feed (``fold_norm``), once;
        the prompt pass then norms with unit scales and reads the folded weights."""
        w = self.weights
        for i, layer in enumerate(w.layers):
            dense = isinstance(layer.qkv.weight, NDArray)
            if self.five_ops[i] and dense and not layer.norms_folded:
                layer.attn_norm = fold_norm(layer.attn_norm, layer.qkv)
                layer.mlp_norm = fold_norm(layer.mlp_norm, layer.gate_up)
                layer.norms_folded = True
        if (not w.head_folded and w.lm_head.weight is not w.embed
                and isinstance(w.lm_head.weight, NDArray)):
            w.final_norm = fold_norm(w.final_norm, w.lm_head)
            w.head_folded = True

    # --- a prompt ------------------------------------------------------------------------
    def forward(self, ids: NDArray, cache: KVCache | None = None,
                last_only: bool = False, last_row: NDArray | None = None) -> NDArray:
        """Logits (batch, seq, vocab) for token ids (batch, seq) from position 0, each
        position seeing those before it; with ``cache`` the keys and values are stored, and
        with ``last_only`` only the last position's logits (batch, vocab) are made.
        ``last_row`` (one sequence; an int32 (1,) device array) picks the position whose
        logits (1, vocab) are made instead of the last: a captured prefill of a padded
        prompt reads it from the device (``prefill_graphs.py``)."""
        cfg, w = self.cfg, self.weights
        x = self._embed(ids)
        delta = None  # the previous block's output, added to x by the next norm
        delta_norm = None  # its post-norm (sandwich norms), taken in the same pass
        for i, layer in enumerate(w.layers):
            x, h = _add_norm(x, delta, layer.attn_norm, cfg, delta_norm)
            a = self._attention(i, layer, h, cache)
            x, h = _add_norm(x, a, layer.mlp_norm, cfg, layer.post_attn_norm)
            delta, delta_norm = layer.down(self._gate_up(layer, h)), layer.post_mlp_norm
        if last_row is not None:  # that position's sum and norm only
            x = _row(x, last_row)
            delta = None if delta is None else _row(delta, last_row)
        elif last_only:  # the last position's sum and norm only
            last = x.shape[1] - 1
            x = x[:, last, :].compact()
            delta = None if delta is None else delta[:, last, :]
        return self._logits(_add_norm(x, delta, w.final_norm, cfg, delta_norm)[1])

    def _attention(self, i: int, layer: LayerWeights, h: NDArray,
                   cache: KVCache | None) -> NDArray:
        """Self-attention of a sequence h (batch, seq, hidden) from position 0 (its window
        and soft cap, where the layer has them, in the fused kernel)."""
        cfg = self.cfg
        b, s, _ = h.shape
        hq, d = cfg.num_heads, cfg.head_dim
        rope = self.rope.for_layer(i)
        q, k, v = self._roped_heads(layer, layer.qkv(h), rope.cos[:s], rope.sin[:s])
        heads_first = (0, 2, 1, 3)
        q, k, v = q.permute(heads_first), k.permute(heads_first), v.permute(heads_first)
        if cache is not None:
            cache.keys[i][:, :, :s, :] = k
            cache.values[i][:, :, :s, :] = v
            if b == cache.keys[i].shape[0]:
                # attend over the cache's first s rows as they are (compact arrays):
                # no heads-first copies of k and v besides the ones the cache holds
                k, v = cache.keys[i], cache.values[i]
        out = nd.attention(q, k, v, scale=cfg.attn_scale, causal=True, kv_len=s,
                           window=cfg.layer_windows[i], softcap=cfg.attn_softcap)
        return layer.o(out.permute(heads_first).reshape((b, s, hq * d)))

    def _roped_heads(self, layer: LayerWeights, qkv: NDArray, cos: NDArray,
                     sin: NDArray) -> tuple[NDArray, NDArray, NDArray]:
        """q (b, s, q_heads, d) and k (b, s, kv_heads, d) roped (Qwen3, Gemma 3: each head
        normed first), and v (b, s, kv_heads, d), out of the fused projection qkv (b, s, ...);
        cos and sin (s, d / 2)."""
        cfg = self.cfg
        b, s, _ = qkv.shape
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if layer.q_norm is not None:  # Qwen3, Gemma 3: each head normed before RoPE
            qkv = self._qk_norm(qkv, layer)
        v = qkv[:, :, (hq + hkv) * d:].reshape((b, s, hkv, d))
        # the query and key heads roped in one pass (one copy out of qkv, one launch)
        qk = qkv[:, :, :(hq + hkv) * d].reshape((b, s, hq + hkv, d)).rope(cos, sin)
        return qk[:, :, :hq], qk[:, :, hq:], v

    # --- one token -----------------------------------------------------------------------
    def decode_bands(self, cache: KVCache) -> tuple[int, ...]:
        """Where the decode attention over ``cache`` changes kernel
        (``nd.attention_decode_bands``; every layer's cache has one shape)."""
        return nd.attention_decode_bands(cache.keys[0], self.cfg.num_heads)

    def decode_step(self, state: DecodeState, cache: KVCache) -> NDArray:
        """Logits (1, vocab) for ``state.token`` at ``state.position``, extending ``cache``."""
        cfg, w = self.cfg, self.weights
        x = self._embed(state.token)
        if self.decode_residual is not None:  # the residual stream in the caller's buffer
            residual = self.decode_residual.reshape(x.shape)
            residual[...] = x
            x = residual
        delta = None  # the previous block's output, added to x by the next norm
        delta_norm = None  # its post-norm (sandwich norms), taken in the same pass
        for i, layer in enumerate(w.layers):
            if self.five_ops[i]:  # (a layer with sandwich norms never precedes one)
                x = self._fused_layer(i, layer, x if delta is None else x + delta, state, cache)
                delta = None
                continue
            x, h = _add_norm(x, delta, layer.attn_norm, cfg, delta_norm)
            a = layer.o(self._decode_attention(i, layer, h, state, cache))
            x, h = _add_norm(x, a, layer.mlp_norm, cfg, layer.post_attn_norm)
            delta, delta_norm = layer.down(self._gate_up(layer, h)), layer.post_mlp_norm
        if delta is None and _plain(w.lm_head, self.packed_fused, extended=True):
            norm = None if w.head_folded else w.final_norm  # after a five-op layer
            product = nd.rmsnorm_matvec(x, norm, w.lm_head.weight, cfg.rms_norm_eps)
            logits = _softcap(w.lm_head.whole(product), cfg.final_softcap)
        else:
            logits = self._logits(_add_norm(x, delta, w.final_norm, cfg, delta_norm)[1])
        return logits.reshape((1, cfg.vocab_size))

    def _fused_layer(self, i: int, layer: LayerWeights, x: NDArray, state: DecodeState,
                     cache: KVCache) -> NDArray:
        """One Llama layer for one token as five fused array operations (six with Qwen3's
        head norms); the residual stream x (1, 1, hidden) is updated in place and
        returned."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        folded = layer.norms_folded  # the norms' scales are in the weights: norm_weight None
        qkv = nd.rmsnorm_matvec(x, None if folded else layer.attn_norm, layer.qkv.weight, eps)
        if layer.qkv.bias is not None:  # Qwen2
            qkv = qkv + layer.qkv.bias
        if layer.q_norm is not None:  # Qwen3: a sixth operation, the heads' norms
            qkv = self._qk_norm(qkv, layer)
        rope = self.rope.for_layer(i)
        a = nd.attention_decode(qkv, rope.cos, rope.sin, state.position, cache.keys[i],
                                cache.values[i], cfg.num_heads, cfg.attn_scale,
                                state.max_positions, cfg.layer_windows[i], cfg.attn_softcap)
        layer.o.add_into(a.reshape(x.shape[:-1] + (a.size,)), x)
        gated = nd.rmsnorm_matvec(x, None if folded else layer.mlp_norm,
                                  layer.gate_up.weight, eps, activation="swiglu")
        return layer.down.add_into(gated, x)

    def _decode_attention(self, i: int, layer: LayerWeights, h: NDArray, state: DecodeState,
                          cache: KVCache) -> NDArray:
        """One token's attention block input h (1, 1, hidden) -> (1, 1, q_heads * d)."""
        cfg = self.cfg
        qkv = layer.qkv(h)
        if layer.q_norm is not None:
            qkv = self._qk_norm(qkv, layer)
        rope = self.rope.for_layer(i)
        out = nd.attention_decode(qkv, rope.cos, rope.sin, state.position, cache.keys[i],
                                  cache.values[i], cfg.num_heads, cfg.attn_scale,
                                  state.max_positions, cfg.layer_windows[i], cfg.attn_softcap)
        return out.reshape((1, 1, out.size))

    def _qk_norm(self, qkv: NDArray, layer: LayerWeights) -> NDArray:
        """qkv with each query and key head normed (Qwen3, Gemma 3), values untouched: one
        pass (``nd.qk_rmsnorm``)."""
        cfg = self.cfg
        return nd.qk_rmsnorm(qkv, layer.q_norm, layer.k_norm, cfg.num_heads, cfg.num_kv_heads,
                             cfg.rms_norm_eps)

    # --- shared steps --------------------------------------------------------------------
    def _embed(self, ids: NDArray) -> NDArray:
        x = self.weights.embed.take(ids)
        return x if self.embed_scale is None else x * self.embed_scale

    def _gate_up(self, layer: LayerWeights, h: NDArray) -> NDArray:
        """The gated activation of h's fused gate/up projection: one pass for plain weights
        (``nd.matmul_swiglu`` / ``nd.matmul_geglu``, no 2 x intermediate-wide product in
        memory where the backend fuses them), else the projection and then the activation."""
        gate_up = layer.gate_up
        if isinstance(gate_up.weight, NDArray) and gate_up.bias is None:
            glu = nd.matmul_swiglu if self.cfg.arch.activation == "silu" else nd.matmul_geglu
            return glu(h, gate_up.weight)
        return self._gate(gate_up(h))

    def _gate(self, gate_up: NDArray) -> NDArray:
        """The gated activation of a fused gate/up projection (..., 2 * intermediate)."""
        if self.cfg.arch.activation == "silu":
            return gate_up.swiglu()
        return gate_up.geglu()  # GELU's tanh form, computed in float32 as PyTorch's

    def _logits(self, h: NDArray) -> NDArray:
        return _softcap(self.weights.lm_head(h), self.cfg.final_softcap)


def _softcap(logits: NDArray, cap: float | None) -> NDArray:
    """Gemma 2's soft-capped logits, cap * tanh(x / cap) computed in float32; x as it is
    when cap is None."""
    if cap is None:
        return logits
    return ((logits.astype("float32") / cap).tanh() * cap).astype(logits.dtype)


def _fuse(choice: str, backend, layer: LayerWeights) -> bool:
    """Whether a fusable layer takes the five operations: as asked (NEEDLE_FUSED_DECODE), else
    where the backend's fused kernels are the faster way: ``fused_matvec`` or
    ``folded_norm_matvec`` for dense weights and ``fused_quant_matvec`` for packed ones (on
    CUDA the packed kernels save the separate norm and SwiGLU launches, and dense layers fold
    their norms into the weights; decode.cu's dense kernels with the norm weight are slower
    than gemv + add_rmsnorm)."""
    if choice in ("0", "1"):
        return choice == "1"
    if not isinstance(layer.qkv.weight, NDArray):
        return has(backend, "fused_quant_matvec")
    return has(backend, "fused_matvec") or has(backend, "folded_norm_matvec")


def _plain(projection, packed: bool, extended: bool = False) -> bool:
    """A projection the fused operations can read: a plain product (not a subclass that does
    more), dense weights (or packed ones, where the backend fuses those), no bias. With
    ``extended`` (the output and down projections, which the step applies through
    ``add_into``, and the head, whose product goes through ``whole``) a subclass is fine
    too: tensor parallelism's projections all-reduce or gather in those methods."""
    return ((type(projection) is Projection or extended) and projection.bias is None
            and (isinstance(projection.weight, NDArray) or packed))


def _fusable(cfg: ModelConfig, layer: LayerWeights, packed: bool) -> bool:
    """Whether a layer is a pre-norm Llama block (SwiGLU, no norms after its sublayers;
    weights dense or, with ``packed``, quantized; Qwen3's head norms allowed), which the five
    fused operations compute (six with the head norms)."""
    return (cfg.arch.activation == "silu"
            and layer.post_attn_norm is None and layer.post_mlp_norm is None
            and (isinstance(layer.qkv.weight, NDArray) or packed)
            and _plain(layer.gate_up, packed)
            and all(_plain(p, packed, extended=True) for p in (layer.o, layer.down)))


def _add_norm(x: NDArray, delta: NDArray | None, weight: NDArray, cfg: ModelConfig,
              delta_norm: NDArray | None = None) -> tuple[NDArray, NDArray]:
    """(x + delta, rmsnorm(x + delta)), the sum written into x; with ``delta_norm`` (Gemma's
    sandwich post-norms) delta is rmsnorm(delta) * delta_norm first, in the same pass."""
    if delta is None:
        return x, x.rmsnorm(weight, cfg.rms_norm_eps)
    return nd.add_rmsnorm(x, delta, weight, cfg.rms_norm_eps, inplace=True,
                          delta_weight=delta_norm)


def _row(x: NDArray, index: NDArray) -> NDArray:
    """Row ``index`` (an int32 (1,) device array) of one sequence's x (1, seq, hidden), as
    (1, hidden): a gather, so the row is chosen on the device."""
    return x.compact().reshape(x.shape[1:]).take(index)

