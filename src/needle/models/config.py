"""A checkpoint's architecture, read from its Hugging Face ``config.json``.

One dataclass serves every family in ``architectures.py``: the sizes, the rotary
embedding, which projections carry biases, which layers attend within a sliding window, and
the family's departures (``arch``). Configs as transformers 4.x and 5.x write them are both
understood (``rope_scaling`` vs ``rope_parameters``, ``torch_dtype`` vs ``dtype``,
``layer_types`` present or derived).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFormatError
from .architectures import (
    ACTIVATION_NAMES,
    ARCHITECTURES,
    CONFIG_DEFAULTS,
    MODEL_TYPES,
    TEXT_MODELS,
    Architecture,
)
from .rope import RopeConfig, read_rope

__all__ = ["ModelConfig", "LlamaConfig", "RopeConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """What needle needs to build and run one decoder of a supported family.

    ``layer_windows``: per layer, the sliding attention window (a position sees itself and
    the window - 1 before it) or None for full causal attention.
    ``rope_local``: the rotary embedding of sliding layers where it differs (Gemma 3), else
    None; ``layer_rope(i)`` gives layer i's.
    ``attn_scale``: the factor of query·key scores. ``attn_softcap``/``final_softcap``:
    cap * tanh(x / cap) on attention scores / output logits, or None.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_windows: tuple[int | None, ...] = ()
    attn_scale: float = 0.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    rope_local: RopeConfig | None = None

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rotary embedding layer ``layer`` uses."""
        if self.rope_local is not None and self.layer_windows[layer] is not None:
            return self.rope_local
        return self.rope

    @property
    def arch(self) -> Architecture:
        return ARCHITECTURES[self.architecture]

    @property
    def family(self) -> str:
        """llama, mistral, qwen2, qwen3, gemma2, gemma3_text or phi3."""
        return self.arch.family

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (or the ``config.json`` inside a model directory)."""
        return cls.from_dict(read_json_object(path, "config.json"), source=str(
            Path(path) / "config.json" if Path(path).is_dir() else path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        """Build from a parsed config dict; ``source`` names the file in error messages."""
        name = _architecture(raw, source)
        if name in TEXT_MODELS:
            raw, name = _text_config(raw, name, source), TEXT_MODELS[name]
        raw = {**CONFIG_DEFAULTS.get(name, {}), **raw}
        f = _Fields(raw, source)
        arch = ARCHITECTURES[name]
        _check_activation(raw, arch, source)
        hidden = f.positive("hidden_size")
        heads = f.positive("num_attention_heads")
        kv_heads = f.positive("num_key_value_heads", heads)
        head_dim = f.get("head_dim", int, None) or hidden // heads
        if head_dim <= 0 or head_dim % 2:
            raise ModelFormatError(f"{source}: head_dim {head_dim} must be positive and even "
                                   "for RoPE")
        if heads % kv_heads:
            raise ModelFormatError(f"{source}: num_attention_heads ({heads}) must be a multiple "
                                   f"of num_key_value_heads ({kv_heads})")
        layers = f.positive("num_hidden_layers")
        attention_bias = f.get("attention_bias", bool, False)
        window = f.get("sliding_window", int, None)
        if window is not None and window <= 0:
            raise ModelFormatError(f"{source}: sliding_window must be positive, got {window}")
        if f.get("use_bidirectional_attention", bool, False):
            raise ModelFormatError(f"{source}: use_bidirectional_attention (an embedding model "
                                   "such as EmbeddingGemma) is not a causal language model; "
                                   "needle runs decoders that generate text")
        rope, rope_local = _ropes(raw, arch, head_dim, source)
        return cls(
            architecture=name, vocab_size=f.positive("vocab_size"), hidden_size=hidden,
            intermediate_size=f.positive("intermediate_size"), num_layers=layers,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=_positive_float(f.get("rms_norm_eps", float, 1e-6), "rms_norm_eps",
                                         source),
            rope=rope, rope_local=rope_local,
            max_position_embeddings=f.positive("max_position_embeddings", 2048),
            tie_word_embeddings=f.get("tie_word_embeddings", bool, arch.ties_embeddings),
            qkv_bias=arch.qkv_bias or attention_bias,
            o_bias=attention_bias and not arch.qkv_bias,
            mlp_bias=f.get("mlp_bias", bool, False),
            sliding_window=window,
            layer_windows=_layer_windows(raw, f, arch, layers, window, source),
            attn_scale=_attn_scale(f, arch, head_dim),
            attn_softcap=f.get("attn_logit_softcapping", float, None) if arch.softcapping
            else None,
            final_softcap=f.get("final_logit_softcapping", float, None) if arch.softcapping
            else None,
            bos_token_id=f.get("bos_token_id", int, None),
            eos_token_ids=token_ids(raw.get("eos_token_id"), source, "eos_token_id"),
            dtype=_dtype(raw),
        )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, by its Hugging Face name, with its shape
        (projections are (out_features, in_features) as PyTorch stores them)."""
        h, d, inter = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        arch = self.arch
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            norms = ["input_layernorm", "post_attention_layernorm"]
            if arch.sandwich_norms:
                norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
            shapes.update({f"{p}{n}.weight": (h,) for n in norms})
            if arch.qk_norm:
                shapes[f"{p}self_attn.q_norm.weight"] = (d,)
                shapes[f"{p}self_attn.k_norm.weight"] = (d,)
            projections = [("self_attn.o_proj", h, q, self.o_bias),
                           ("mlp.down_proj", h, inter, self.mlp_bias)]
            if arch.fused_checkpoint:
                projections += [("self_attn.qkv_proj", q + 2 * kv, h, self.qkv_bias),
                                ("mlp.gate_up_proj", 2 * inter, h, self.mlp_bias)]
            else:
                projections += [(f"self_attn.{n}_proj", out, h, self.qkv_bias)
                                for n, out in (("q", q), ("k", kv), ("v", kv))]
                projections += [(f"mlp.{n}_proj", inter, h, self.mlp_bias)
                                for n in ("gate", "up")]
            for name, out, inp, bias in projections:
                shapes[f"{p}{name}.weight"] = (out, inp)
                if bias:
                    shapes[f"{p}{name}.bias"] = (out,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


LlamaConfig = ModelConfig  # the name of earlier releases, when it described Llama alone


def read_json_object(path: str | Path, default_name: str) -> dict:
    """A JSON object from ``path`` (or ``path/default_name``), with clear errors."""
    path = Path(path)
    if path.is_dir():
        path = path / default_name
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelFormatError(f"{path} does not exist; a Hugging Face model directory needs "
                               f"a {default_name} next to its weights") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{path} could not be read: {e}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:
        raise ModelFormatError(f"{path} is nested too deeply to be a config file") from None
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def token_ids(value, source: str, name: str) -> tuple[int, ...]:
    """An int or a list of ints (eos_token_id) as a tuple; () for None."""
    ids = tuple(value) if isinstance(value, list) else (() if value is None else (value,))
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
        raise ModelFormatError(f"{source}: {name} must be a token id or a list of them, got "
                               f"{value!r}")
    return ids


class _Fields:
    """Typed access to config entries, with errors naming the file and the entry."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def positive(self, name: str, default: int | None = None) -> int:
        value = self.get(name, int, default)
        if value is None:
            raise ModelFormatError(f"{self.source}: required entry {name!r} is missing")
        if value <= 0:
            raise ModelFormatError(f"{self.source}: {name} must be positive, got {value}")
        return value

    def get(self, name: str, kind: type, default):
        value = self.raw.get(name)
        if value is None:
            return default
        ok = (isinstance(value, bool) if kind is bool
              else isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) if kind is float
              else isinstance(value, kind) and not isinstance(value, bool))
        if kind is int and isinstance(value, float) and value.is_integer():
            value, ok = int(value), True
        if not ok:
            raise ModelFormatError(f"{self.source}: {name!r} must be {kind.__name__}, "
                                   f"got {value!r}")
        return kind(value)


def text_model_config(raw: dict, source: str = "config.json") -> dict:
    """The config.json of the text model ``raw`` describes: ``raw`` itself, or a
    vision-language model's language model as its own text-model config (what a checkpoint
    of the language model alone carries)."""
    name = _architecture(raw, source)
    return _text_config(raw, name, source) if name in TEXT_MODELS else dict(raw)


def _architecture(raw: dict, source: str) -> str:
    archs = raw.get("architectures")
    if isinstance(archs, list) and archs:
        name = archs[0]
    else:
        name = MODEL_TYPES.get(raw.get("model_type"), raw.get("model_type"))
    if name not in ARCHITECTURES and name not in TEXT_MODELS:
        raise ModelFormatError(f"{source}: architecture {name!r} is not supported; needle "
                               f"runs {', '.join([*ARCHITECTURES, *TEXT_MODELS])}")
    return name


def _text_config(raw: dict, name: str, source: str) -> dict:
    """The language model's entries of a vision-language config: its ``text_config``, with
    the token ids, dtype and tying of the outer config where the inner one has none."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelFormatError(f"{source}: a {name} config needs a text_config object (the "
                               "language model's settings)")
    outer = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "dtype", "torch_dtype",
                                 "tie_word_embeddings") if raw.get(k) is not None}
    return {**outer, **{k: v for k, v in text.items() if v is not None or k not in outer},
            "architectures": [TEXT_MODELS[name]]}


def _check_activation(raw: dict, arch: Architecture, source: str) -> None:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or arch.activation
    if act != arch.activation and act not in ACTIVATION_NAMES[arch.activation]:
        raise ModelFormatError(f"{source}: activation {act!r} is not supported for "
                               f"{arch.family}; needle implements "
                               f"{', '.join(ACTIVATION_NAMES[arch.activation])}")


def _layer_windows(raw: dict, f: _Fields, arch: Architecture, layers: int,
                   window: int | None, source: str) -> tuple[int | None, ...]:
    """Per layer, its sliding window or None: config.json's ``layer_types`` when present
    (transformers 5 writes it), else the family's rule (architectures.py)."""
    types = raw.get("layer_types")
    if types is not None:
        if (not isinstance(types, list) or len(types) != layers
                or not set(types) <= {"full_attention", "sliding_attention"}):
            raise ModelFormatError(f"{source}: layer_types must list 'full_attention' or "
                                   f"'sliding_attention' for each of the {layers} layers")
        if "sliding_attention" in types and window is None:
            raise ModelFormatError(f"{source}: layer_types has sliding layers but no "
                                   "sliding_window")
        return tuple(window if t == "sliding_attention" else None for t in types)
    if window is None or arch.windows == "none":
        return (None,) * layers
    if arch.windows == "all":
        return (window,) * layers
    if arch.windows == "even":
        return tuple(window if i % 2 == 0 else None for i in range(layers))
    if arch.windows == "pattern":
        every = f.positive("sliding_window_pattern", 6)
        return tuple(window if (i + 1) % every else None for i in range(layers))
    if not f.get("use_sliding_window", bool, False):
        return (None,) * layers
    first = f.get("max_window_layers", int, layers)
    return tuple(window if i >= first else None for i in range(layers))


def _ropes(raw: dict, arch: Architecture, head_dim: int,
           source: str) -> tuple[RopeConfig, RopeConfig | None]:
    """The rotary embedding of full-attention layers, and with ``arch.local_rope`` the one of
    sliding layers. transformers 5 writes Gemma 3's as ``rope_parameters`` keyed by layer
    type; transformers 4 wrote ``rope_theta`` (global, 1e6 by default), ``rope_scaling``
    (global only) and ``rope_local_base_freq`` (10,000 by default)."""
    if not arch.local_rope:
        return read_rope(raw, 10000.0, head_dim, source), None
    # the settings besides the rotary ones, so that one table's entries never leak into the
    # other's (a top-level rope_theta is the global layers')
    plain = {k: v for k, v in raw.items()
             if k not in ("rope_scaling", "rope_parameters", "rope_theta", "rope_local_base_freq")}
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params
                                     or "sliding_attention" in params):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        return (read_rope({**plain, "rope_parameters": full}, 1e6, head_dim, source),
                read_rope({**plain, "rope_parameters": local}, 10000.0, head_dim, source))
    local_theta = raw.get("rope_local_base_freq", 10000.0)
    return (read_rope(raw, 1e6, head_dim, source),
            read_rope({**plain, "rope_theta": local_theta}, 10000.0, head_dim, source))


def _attn_scale(f: _Fields, arch: Architecture, head_dim: int) -> float:
    if arch.query_pre_attn_scalar:
        return f.get("query_pre_attn_scalar", float, float(head_dim)) ** -0.5
    return head_dim ** -0.5


def _positive_float(value: float, name: str, source: str) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ModelFormatError(f"{source}: {name} must be a positive number, got {value}")
    return value


# the compute dtype a config names; float64 checkpoints run in float32, "auto" means the
# weights' dtype (float32 until the weights say otherwise)
_CONFIG_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                  "float64": "float32", "auto": "float32"}


def _dtype(raw: dict) -> str:
    key = "dtype" if raw.get("dtype") else "torch_dtype"
    name = str(raw.get(key) or "float32").removeprefix("torch.")
    if name not in _CONFIG_DTYPES:
        raise ModelFormatError(f"config.json: {key} {name!r} is not a dtype needle runs in; "
                               f"use one of {', '.join(_CONFIG_DTYPES)}")
    return _CONFIG_DTYPES[name]
