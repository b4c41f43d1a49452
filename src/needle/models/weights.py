"""A decoder's weights on the device, in the layout the forward pass reads.

Read from checkpoint tensors by Hugging Face name (``WeightSource``) and rearranged once, at
load time: the query, key and value projections concatenated into one (q + k + v, hidden)
matrix and gate and up into one (2 * intermediate, hidden) matrix, so that a decode step
reads each with one matrix-vector product (Phi-3 checkpoints store them so already); Gemma's
norm weights, stored as (scale - 1), turned into scales. Projections stay (out, in) as
PyTorch stores them; the forward pass multiplies by their transposed views.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import backend_ndarray as nd
from ..backend_ndarray import NDArray, QuantizedMatrix, quant_matmul
from ..backend_ndarray.quant import concatenate_rows
from ..errors import ModelFormatError
from .config import ModelConfig

# (name, shape) -> the checkpoint tensor as an NDArray on the model's device and dtype, or a
# QuantizedMatrix for a Linear weight stored quantized (docs/quantization.md)
WeightSource = Callable[[str, tuple[int, ...]], NDArray | QuantizedMatrix]


@dataclass
class Projection:
    """y = x @ weight.T (+ bias): weight (out, in) as stored (or packed), bias (out,) or None."""

    weight: NDArray | QuantizedMatrix
    bias: NDArray | None = None

    def __call__(self, x: NDArray) -> NDArray:
        y = self.product(x)
        return y if self.bias is None else y + self.bias

    def product(self, x: NDArray) -> NDArray:
        """x @ weight.T alone (packed weights through ``quant_matmul``)."""
        if isinstance(self.weight, QuantizedMatrix):
            return quant_matmul(x, self.weight)
        return x @ self.weight.transpose()

    def add_into(self, h: NDArray, x: NDArray) -> NDArray:
        """x += h @ weight.T in place, one fused operation (``nd.matvec_add``): the decode
        step's output and down projections adding into the residual stream (bias None)."""
        return nd.matvec_add(h, self.weight, x)

    def whole(self, y: NDArray) -> NDArray:
        """The output of a product made elsewhere (a fused norm and product): here whole
        already; a tensor-parallel head that holds a share of the rows gathers the rest."""
        return y


@dataclass
class LayerWeights:
    """One decoder layer. ``post_attn_norm``/``post_mlp_norm`` exist only with sandwich
    norms (Gemma 2), ``q_norm``/``k_norm`` only with per-head q/k norms (Qwen3)."""

    attn_norm: NDArray
    qkv: Projection
    o: Projection
    mlp_norm: NDArray
    gate_up: Projection
    down: Projection
    q_norm: NDArray | None = None
    k_norm: NDArray | None = None
    post_attn_norm: NDArray | None = None
    post_mlp_norm: NDArray | None = None
    # attn_norm and mlp_norm are ones, their scales multiplied into qkv's and gate_up's
    # columns (fold_norm): every pass computes the same, and a backend with
    # folded_norm_matvec runs each norm inside the projection (Transformer)
    norms_folded: bool = False


@dataclass
class ModelWeights:
    embed: NDArray
    layers: list[LayerWeights]
    final_norm: NDArray
    lm_head: Projection
    head_folded: bool = False  # final_norm folded into lm_head (as norms_folded)

    def arrays(self) -> list[NDArray]:
        """Every weight array once (a tied output head is the embedding itself)."""
        found = [self.embed, self.final_norm, *_parts(self.lm_head.weight), self.lm_head.bias]
        for layer in self.layers:
            for value in vars(layer).values():
                if isinstance(value, Projection):
                    found += [*_parts(value.weight), value.bias]
                elif isinstance(value, NDArray):  # a norm (flags such as norms_folded: not)
                    found.append(value)
        unique = {id(a): a for a in found if a is not None}
        return list(unique.values())


def fold_norm(norm: NDArray, projection: Projection) -> NDArray:
    """Multiply the RMSNorm scale ``norm`` (dim,) into the columns of the dense projection
    that reads the norm's output (weight (out, dim) * norm, rounded once to the weight's
    dtype, which replaces it) and return the unit scale that replaces the norm:
    ``rmsnorm(x, ones) @ W'.T`` is then the model's ``rmsnorm(x, norm) @ W.T`` up to where
    the rounding falls, and one-row products can take the norm in the same pass."""
    w = projection.weight
    if not isinstance(w, NDArray) or norm.shape != (w.shape[1],):
        raise ModelFormatError(f"fold_norm needs a dense (out, {norm.shape[0]}) weight, got "
                               f"{type(w).__name__} {getattr(w, 'shape', None)}")
    projection.weight = (w * norm.astype(w.dtype).reshape((1, w.shape[1]))).compact()
    return nd.ones(norm.shape, norm.dtype, norm.device)


def _parts(w: NDArray | QuantizedMatrix) -> list[NDArray]:
    return w.arrays() if isinstance(w, QuantizedMatrix) else [w]


def load_weights(cfg: ModelConfig, source: WeightSource) -> ModelWeights:
    """Every weight of ``cfg``'s model from ``source``, one tensor at a time."""
    shapes = cfg.tensor_shapes()
    get = _Getter(cfg, source, shapes)
    embed = get("model.embed_tokens.weight")
    layers = [_layer(cfg, get, f"model.layers.{i}.") for i in range(cfg.num_layers)]
    head = embed if cfg.tie_word_embeddings else get("lm_head.weight")
    return ModelWeights(embed, layers, get.norm("model.norm.weight"), Projection(head))


class _Getter:
    def __init__(self, cfg: ModelConfig, source: WeightSource, shapes: dict):
        self.cfg, self.source, self.shapes = cfg, source, shapes

    def __call__(self, name: str) -> NDArray:
        return self.source(name, self.shapes[name])

    def has(self, name: str) -> bool:
        return name in self.shapes

    def norm(self, name: str) -> NDArray:
        """A norm's scale: the weight, or (offset + weight) where the family stores it so."""
        w = self(name)
        offset = self.cfg.arch.norm_offset
        if not offset:
            return w
        # (1 + w) in float32, then rounded once to the model's dtype
        return (w.astype("float32") + offset).astype(w.dtype)

    def projection(self, names: list[str]) -> Projection:
        """One projection over the checkpoint matrices ``names`` stacked along their outputs
        (and their biases, when they have them); the parts are freed once stacked."""
        weights = [self(f"{n}.weight") for n in names]
        packed = [isinstance(w, QuantizedMatrix) for w in weights]
        if any(packed) and not all(packed):
            raise ModelFormatError(f"{', '.join(names)} must be all quantized or all not, as "
                                   "they are fused into one projection")
        if all(packed):
            weight = concatenate_rows(weights)
        else:
            weight = weights[0] if len(weights) == 1 else nd.concatenate(weights)
        bias = None
        if self.has(f"{names[0]}.bias"):
            biases = [self(f"{n}.bias") for n in names]
            bias = biases[0] if len(biases) == 1 else nd.concatenate(biases)
        return Projection(weight, bias)


def _layer(cfg: ModelConfig, get: _Getter, p: str) -> LayerWeights:
    arch = cfg.arch
    if arch.fused_checkpoint:
        qkv = get.projection([f"{p}self_attn.qkv_proj"])
        gate_up = get.projection([f"{p}mlp.gate_up_proj"])
    else:
        qkv = get.projection([f"{p}self_attn.{n}_proj" for n in "qkv"])
        gate_up = get.projection([f"{p}mlp.gate_proj", f"{p}mlp.up_proj"])
    layer = LayerWeights(
        attn_norm=get.norm(f"{p}input_layernorm.weight"),
        qkv=qkv, o=get.projection([f"{p}self_attn.o_proj"]),
        # Llama names the MLP's input norm post_attention_layernorm; Gemma 2 gives that
        # name to the norm of the attention output and calls the MLP's pre_feedforward
        mlp_norm=get.norm(f"{p}pre_feedforward_layernorm.weight" if arch.sandwich_norms
                          else f"{p}post_attention_layernorm.weight"),
        gate_up=gate_up, down=get.projection([f"{p}mlp.down_proj"]))
    if arch.qk_norm:
        layer.q_norm = get.norm(f"{p}self_attn.q_norm.weight")
        layer.k_norm = get.norm(f"{p}self_attn.k_norm.weight")
    if arch.sandwich_norms:
        layer.post_attn_norm = get.norm(f"{p}post_attention_layernorm.weight")
        layer.post_mlp_norm = get.norm(f"{p}post_feedforward_layernorm.weight")
    return layer
