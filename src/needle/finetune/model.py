"""A Hugging Face checkpoint as a needle Module that trains (the Tensor / autograd path).

Inference runs on NDArrays through fused kernels (``models/transformer.py``); training needs
gradients, so this is the same decoder written with ``ops`` and ``nn``: every family of
``models/architectures.py`` (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3, Phi-3),
read from the same checkpoints ``load_pretrained`` reads.

The module tree mirrors transformers' (``model.layers.3.self_attn.q_proj.weight``), so
``named_parameters()`` gives the checkpoint's names, and saving (``save.py``) writes a
checkpoint that transformers and ``load_pretrained`` read back. Projections keep PyTorch's
(out, in) layout, so nothing is transposed on the way in or out.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .. import backend_ndarray as nd
from .. import checkpointing, ops
from ..autograd import Tensor
from ..backend_ndarray import Device, dtypes
from ..errors import ArgumentError, ShapeError
from ..models.checkpoint import Checkpoint
from ..models.config import ModelConfig, read_json_object
from ..models.loader import resolve_device
from ..models.quantized import QuantConfig
from ..nn import CrossEntropyLoss, Module, Parameter
from .data import IGNORE
from .lora_projection import lora_projection

TRAIN_DTYPES = ("float32", "float16", "bfloat16")


class Linear(Module):
    """y = x @ weight.T (+ bias) with weight (out, in) as the checkpoint stores it, plus a
    LoRA adapter's update where one is attached (``lora.py``)."""

    def __init__(self, weight: Parameter, bias: Parameter | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.lora = None  # a lora.LoRA, set by lora.add_lora

    def forward(self, x: Tensor) -> Tensor:
        if self.lora is not None:
            # one graph node where it applies: the base product and the update are not kept
            fused = lora_projection(x, self.weight, self.bias, self.lora)
            if fused is not None:
                return fused
        y = x @ ops.transpose(self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y if self.lora is None else y + self.lora(x)


class Norm(Module):
    """RMSNorm over the last axis, scaling by (offset + weight): Gemma stores weight - 1."""

    def __init__(self, weight: Parameter, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight, self.eps, self.offset = weight, eps, offset

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight + self.offset if self.offset else self.weight
        return ops.rmsnorm(x, w, self.eps)


class Embedding(Module):
    def __init__(self, weight: Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, ids: Tensor) -> Tensor:
        return ops.embedding(self.weight, ids)


class Attention(Module):
    """Grouped-query self-attention with rotary positions over a whole sequence from
    position 0 (causal; a sliding window and Gemma 2's soft cap where the layer has them)."""

    def __init__(self, cfg: ModelConfig, layer: int, get):
        super().__init__()
        p = f"model.layers.{layer}.self_attn."
        self.cfg, self.window = cfg, cfg.layer_windows[layer]
        if cfg.arch.fused_checkpoint:  # Phi-3: one (q + k + v, hidden) matrix
            self.qkv_proj = get.linear(p + "qkv_proj")
        else:
            self.q_proj, self.k_proj, self.v_proj = (get.linear(f"{p}{n}_proj") for n in "qkv")
        self.o_proj = get.linear(p + "o_proj")
        if cfg.arch.qk_norm:  # Qwen3, Gemma 3: each head normed before RoPE
            self.q_norm = get.norm(p + "q_norm.weight")
            self.k_norm = get.norm(p + "k_norm.weight")
        self.rope = _Rotary(cfg.layer_rope(layer), cfg.head_dim)
        self.masks: dict[tuple, Tensor] = {}  # the composed attention's, by length

    def forward(self, h: Tensor) -> Tensor:
        cfg = self.cfg
        b, s, _ = h.shape
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = self._qkv(h)
        q, k, v = (ops.reshape(t, (b, s, n, d)) for t, n in ((q, hq), (k, hkv), (v, hkv)))
        if cfg.arch.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rope.tables(s, q.dtype, q.device)
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        heads_first = (0, 2, 1, 3)
        q, k, v = (ops.permute(t, heads_first) for t in (q, k, v))
        if cfg.attn_softcap is None and (self.window is None or s <= self.window):
            out = ops.scaled_dot_product_attention(q, k, v, causal=True, scale=cfg.attn_scale)
        else:
            out = self._composed(q, k, v)
        return self.o_proj(ops.reshape(ops.permute(out, heads_first), (b, s, hq * d)))

    def _qkv(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if not self.cfg.arch.fused_checkpoint:
            return self.q_proj(h), self.k_proj(h), self.v_proj(h)
        q_width = self.cfg.num_heads * self.cfg.head_dim
        kv_width = self.cfg.num_kv_heads * self.cfg.head_dim
        qkv = self.qkv_proj(h)
        return (qkv[:, :, :q_width], qkv[:, :, q_width:q_width + kv_width],
                qkv[:, :, q_width + kv_width:])

    def _composed(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attention from matmul and softmax, for what the fused kernel's gradient does not
        take (a window shorter than the sequence, a soft cap): the (s, s) scores are made,
        which is fine at fine-tuning lengths."""
        cfg = self.cfg
        b, hq, s, d = q.shape
        group = hq // cfg.num_kv_heads
        k, v = _repeat_heads(k, group), _repeat_heads(v, group)
        scores = (q @ ops.transpose(k)) * cfg.attn_scale
        if cfg.attn_softcap is not None:
            scores = ops.tanh(scores / cfg.attn_softcap) * cfg.attn_softcap
        probs = ops.softmax(scores + ops.broadcast_to(self._mask(s, scores), scores.shape))
        return (probs if probs.dtype == v.dtype else ops.cast(probs, v.dtype)) @ v

    def _mask(self, s: int, scores: Tensor) -> Tensor:
        """0 where a query sees a key (causal, within the window), -inf elsewhere; made once
        a length (a compiled step then reads the same array at every replay)."""
        key = (s, scores.dtype, scores.device.name)
        if key not in self.masks:
            query, seen = np.arange(s)[:, None], np.arange(s)[None, :]
            visible = seen <= query
            if self.window is not None:
                visible &= seen > query - self.window
            self.masks[key] = Tensor(np.where(visible, 0.0, -np.inf), device=scores.device,
                                     dtype=scores.dtype, requires_grad=False)
        return self.masks[key]


class MLP(Module):
    """The gated MLP: down(act(gate(h)) * up(h)), SwiGLU or Gemma's GeGLU (tanh form)."""

    def __init__(self, cfg: ModelConfig, layer: int, get):
        super().__init__()
        p = f"model.layers.{layer}.mlp."
        self.silu = cfg.arch.activation == "silu"
        self.fused = cfg.arch.fused_checkpoint
        if self.fused:  # Phi-3: one (2 * intermediate, hidden) matrix
            self.gate_up_proj = get.linear(p + "gate_up_proj")
        else:
            self.gate_proj, self.up_proj = get.linear(p + "gate_proj"), get.linear(p + "up_proj")
        self.down_proj = get.linear(p + "down_proj")
        self.intermediate = cfg.intermediate_size

    def forward(self, h: Tensor) -> Tensor:
        if self.fused:
            gate_up = self.gate_up_proj(h)
            gate, up = gate_up[:, :, :self.intermediate], gate_up[:, :, self.intermediate:]
        else:
            gate, up = self.gate_proj(h), self.up_proj(h)
        act = ops.silu_mul(gate, up) if self.silu else gelu_tanh(gate) * up
        return self.down_proj(act)


class DecoderLayer(Module):
    def __init__(self, cfg: ModelConfig, layer: int, get):
        super().__init__()
        p = f"model.layers.{layer}."
        self.input_layernorm = get.norm(p + "input_layernorm.weight")
        self.self_attn = Attention(cfg, layer, get)
        # Llama calls the MLP's input norm post_attention_layernorm; Gemma 2/3 give that name
        # to the attention output's norm and call the MLP's input norm pre_feedforward
        self.post_attention_layernorm = get.norm(p + "post_attention_layernorm.weight")
        self.sandwich = cfg.arch.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = get.norm(p + "pre_feedforward_layernorm.weight")
            self.post_feedforward_layernorm = get.norm(p + "post_feedforward_layernorm.weight")
        self.mlp = MLP(cfg, layer, get)

    def forward(self, x: Tensor) -> Tensor:
        a = self.self_attn(self.input_layernorm(x))
        if not self.sandwich:
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(a)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Decoder(Module):
    """transformers' ``model``: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig, get):
        super().__init__()
        self.embed_tokens = Embedding(get.param("model.embed_tokens.weight"))
        self.layers = [DecoderLayer(cfg, i, get) for i in range(cfg.num_layers)]
        self.norm = get.norm("model.norm.weight")
        # Gemma multiplies embeddings by sqrt(hidden), rounded to the model's dtype
        self.embed_scale = math.sqrt(cfg.hidden_size) if cfg.arch.scale_embeddings else None
        self.gradient_checkpointing = False  # each layer recomputed in the backward pass

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed_tokens(ids)
        if self.embed_scale is not None:
            x = x * float(np.asarray(self.embed_scale, dtypes.to_numpy_dtype(x.dtype)))
        for layer in self.layers:
            x = checkpointing.checkpoint(layer, x) if self.gradient_checkpointing else layer(x)
        return self.norm(x)


class CausalLM(Module):
    """A decoder-only language model that trains: ``model(ids)`` gives logits (batch, seq,
    vocab); ``loss(ids, labels)`` the mean next-token cross-entropy over labelled positions.
    Build one with ``CausalLM.from_pretrained``."""

    def __init__(self, cfg: ModelConfig, get, source: Path | None = None):
        super().__init__()
        self.config, self.source = cfg, source
        self.model = Decoder(cfg, get)
        self.lm_head = None if cfg.tie_word_embeddings else get.linear("lm_head", bias=False)
        self.lora_config = None  # the adapters' LoraConfig, once lora.py attaches some

    @classmethod
    def from_pretrained(cls, path: str | Path, device: Device | str | None = None,
                        dtype: str = "float32") -> CausalLM:
        """The checkpoint in directory ``path`` (safetensors, any family ``load_pretrained``
        reads) as trainable Parameters on ``device`` in ``dtype``. float32 (the default)
        keeps full-precision weights for training; under ``ndl.autocast("bfloat16")`` the
        products still run in bf16. A LoRA fine-tune may keep the frozen weights in bf16."""
        path = Path(path)
        if not path.is_dir():
            raise ArgumentError(f"{path} is not a model directory; pass the folder holding "
                                "config.json and the safetensors weights")
        raw = read_json_object(path, "config.json")
        if QuantConfig.read(raw, str(path / "config.json")) is not None:
            raise ArgumentError(f"{path} is quantized by needle quantize; fine-tune its "
                                "original checkpoint (quantize the result afterwards)")
        cfg = ModelConfig.from_dict(raw, str(path / "config.json"))
        device = resolve_device(device)
        dtype = dtypes.canonical(dtype)
        if dtype not in TRAIN_DTYPES:
            raise ArgumentError(f"a model trains in {', '.join(TRAIN_DTYPES)}, not {dtype}")
        checkpoint = Checkpoint(path)
        shapes = cfg.tensor_shapes()
        for name, shape in shapes.items():  # every header checked before anything is read
            checkpoint.info(name, shape)
        try:
            return cls(cfg, _Getter(cfg, checkpoint, shapes, device, dtype), path)
        finally:
            checkpoint.close()

    def forward(self, ids) -> Tensor:
        ids = self.ids_tensor(ids)
        h = self.model(ids)
        if self.lm_head is None:  # tied: the output head is the embedding
            logits = h @ ops.transpose(self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(h)
        cap = self.config.final_softcap
        return logits if cap is None else ops.tanh(logits / cap) * cap

    def loss(self, ids, labels) -> Tensor:
        """Mean cross-entropy of each labelled next token (transformers' ``labels=``: labels
        (batch, seq) are the ids, IGNORE (-100) where no loss is taken; position t's logits
        predict labels[t + 1])."""
        ids = self.ids_tensor(ids)
        labels = np.asarray(labels.numpy() if isinstance(labels, Tensor) else labels)
        if labels.shape != tuple(ids.shape):
            raise ShapeError(f"labels of shape {labels.shape} do not match ids of shape "
                             f"{tuple(ids.shape)}")
        wrong = labels[(labels != IGNORE) & ((labels < 0) | (labels >= self.config.vocab_size))]
        if wrong.size:
            raise ShapeError(f"label {wrong[0]} is neither a token id in [0, "
                             f"{self.config.vocab_size}) nor IGNORE ({IGNORE})")
        return self.loss_of(ids, *next_token_targets(labels, ids.device))

    def loss_of(self, ids: Tensor, targets: Tensor, weights: Tensor) -> Tensor:
        """``loss`` from device tensors alone (``next_token_targets``' two), with nothing
        read from the host: the form a step compiled by ``ndl.compile`` takes."""
        logits = self(ids)
        b, s, vocab = logits.shape
        losses = CrossEntropyLoss(reduction="none")(ops.reshape(logits, (b * s, vocab)),
                                                    targets)
        if losses.dtype != weights.dtype:
            losses = ops.cast(losses, weights.dtype)
        return ops.summation(losses * weights)

    def gradient_checkpointing_enable(self) -> None:
        """Keep only each decoder layer's input for the backward pass and run the layer
        again there (``ndl.checkpoint``; transformers' method of the same name): the
        activations of one layer at a time instead of every layer's, for about a third
        more compute."""
        self.model.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.model.gradient_checkpointing

    def trainable_parameters(self) -> list[Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def ids_tensor(self, ids) -> Tensor:
        if isinstance(ids, Tensor):
            return ids
        host = np.asarray(ids)
        if host.ndim != 2 or not np.issubdtype(host.dtype, np.integer):
            raise ShapeError(f"token ids must be a (batch, seq) array of integers, got "
                             f"{host.dtype} of shape {host.shape}")
        vocab = self.config.vocab_size
        if host.size and (host.min() < 0 or host.max() >= vocab):
            raise ShapeError(f"token ids must lie in [0, {vocab}), got {host.min()}.."
                             f"{host.max()}")
        return Tensor(host.astype(np.int64), device=self.model.embed_tokens.weight.device,
                      requires_grad=False)


def next_token_targets(labels: np.ndarray, device,
                       count: int | None = None) -> tuple[Tensor, Tensor]:
    """(targets, weights) of ``labels`` (b, s): position t's target is labels[t + 1] (0
    where that is IGNORE or past the end) and its weight 1 / (labelled positions), else 0,
    both flat (b * s,), so that sum(weights * cross-entropy) is the mean over labels.
    ``count``: the labelled positions to divide by instead (those of every batch a step
    accumulates: their losses then add up to the mean over all of them)."""
    b, s = labels.shape
    target = np.full((b, s), IGNORE, np.int64)
    target[:, :-1] = labels[:, 1:]
    keep = target != IGNORE
    count = int(keep.sum()) if count is None else count
    if count == 0:
        raise ArgumentError("no position carries a label: every next token is IGNORE "
                            "(-100), so there is no loss to take")
    targets = Tensor(np.where(keep, target, 0).reshape(-1), device=device, requires_grad=False)
    weights = Tensor(keep.reshape(-1).astype(np.float32) / count, device=device,
                     dtype="float32", requires_grad=False)
    return targets, weights


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU's tanh form (transformers' gelu_pytorch_tanh, Gemma's activation)."""
    inner = (x + x * x * x * 0.044715) * math.sqrt(2 / math.pi)
    return x * (ops.tanh(inner) + 1.0) * 0.5


def _repeat_heads(t: Tensor, group: int) -> Tensor:
    """(b, kv_heads, s, d) -> (b, kv_heads * group, s, d), each head repeated group times."""
    if group == 1:
        return t
    b, h, s, d = t.shape
    wide = ops.broadcast_to(ops.reshape(t, (b, h, 1, s, d)), (b, h, group, s, d))
    return ops.reshape(wide, (b, h * group, s, d))


class _Rotary:
    """One rotary embedding's cos and sin tables (seq, head_dim / 2), made on first use for
    the longest sequence seen and kept per dtype and device."""

    def __init__(self, rope, head_dim: int):
        self.rope, self.head_dim = rope, head_dim
        self.length = 0
        self.host: tuple[np.ndarray, np.ndarray] | None = None
        self.made: dict[tuple, tuple[Tensor, Tensor]] = {}

    def tables(self, length: int, dtype: str, device) -> tuple[Tensor, Tensor]:
        if length > self.length:
            self.length, self.made = max(length, 2 * self.length), {}
            self.host = self.rope.tables(self.head_dim, self.length)
        key = (dtype, device.name, length)
        if key not in self.made:
            self.made[key] = tuple(Tensor(t[:length], device=device, dtype=dtype,
                                          requires_grad=False) for t in self.host)
        return self.made[key]


class _Getter:
    """Checkpoint tensors as Parameters (or Norm / Linear modules around them)."""

    def __init__(self, cfg: ModelConfig, checkpoint: Checkpoint, shapes: dict, device,
                 dtype: str):
        self.cfg, self.checkpoint, self.shapes = cfg, checkpoint, shapes
        self.device, self.dtype = device, dtype

    def param(self, name: str) -> Parameter:
        host = self.checkpoint.read(name, self.shapes[name])
        return Parameter(nd.array(host, dtype=self.dtype, device=self.device))

    def norm(self, name: str) -> Norm:
        return Norm(self.param(name), self.cfg.rms_norm_eps, self.cfg.arch.norm_offset)

    def linear(self, prefix: str, bias: bool | None = None) -> Linear:
        has_bias = f"{prefix}.bias" in self.shapes if bias is None else bias
        return Linear(self.param(f"{prefix}.weight"),
                      self.param(f"{prefix}.bias") if has_bias else None)

