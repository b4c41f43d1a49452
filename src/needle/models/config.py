"""The architecture of a Llama-family checkpoint, read from its Hugging Face ``config.json``.

One dataclass covers Llama 2/3, Mistral and Qwen2 because they differ only in a few
switches: which projections carry a bias, how RoPE frequencies are scaled, whether the
output head shares the embedding matrix, and an optional sliding attention window. Both the
classic layout (``rope_theta`` and ``rope_scaling`` at top level) and the one written by
transformers >= 5 (``rope_parameters``) are understood.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelFormatError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2"}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding frequencies: a base ``theta`` and an optional scaling rule."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """The head_dim/2 angular frequencies, in float32 exactly as transformers computes them
        (so greedy decoding matches it token for token)."""
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(
            head_dim)
        inv = (np.float32(1.0) / (np.float32(self.theta) ** exponents)).astype(np.float32)
        if self.type == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.type != "llama3":
            return inv
        # Llama 3.1: long wavelengths are slowed by ``factor``, short ones kept, and the band
        # between them interpolated smoothly.
        old_len = self.original_max_position_embeddings
        low_wavelen = old_len / self.low_freq_factor
        high_wavelen = old_len / self.high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / np.float32(self.factor), inv)
        smooth = ((old_len / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor)).astype(np.float32)
        smoothed = (1 - smooth) * scaled / np.float32(self.factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def tables(self, head_dim: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin of position × frequency, each (length, head_dim/2) float32."""
        angles = np.arange(length, dtype=np.float32)[:, None] * self.inv_freq(head_dim)[None, :]
        return np.cos(angles), np.sin(angles)


@dataclass(frozen=True)
class LlamaConfig:
    """What needle needs to build and run one Llama-family decoder."""

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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    @classmethod
    def from_file(cls, path: str | Path) -> LlamaConfig:
        """Read ``config.json`` (or the ``config.json`` inside a model directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ModelFormatError(f"{path} does not exist; a Hugging Face model directory "
                                   "needs a config.json next to its weights") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ModelFormatError(f"{path} could not be read: {e}") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ModelFormatError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ModelFormatError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> LlamaConfig:
        """Build from a parsed config dict; ``source`` names the file in error messages."""
        fields = _Fields(raw, source)
        arch = _architecture(raw, source)
        if fields.get("hidden_act", str, "silu") != "silu":
            raise ModelFormatError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported; "
                                   "Llama-family models use 'silu'")
        hidden = fields.require("hidden_size", int)
        heads = fields.require("num_attention_heads", int)
        kv_heads = fields.get("num_key_value_heads", int, heads)
        head_dim = fields.get("head_dim", int, None) or (hidden // heads if heads else 0)
        for name, value in (("hidden_size", hidden), ("num_attention_heads", heads),
                            ("num_key_value_heads", kv_heads), ("head_dim", head_dim)):
            if value <= 0:
                raise ModelFormatError(f"{source}: {name} must be positive, got {value}")
        if heads % kv_heads:
            raise ModelFormatError(f"{source}: num_attention_heads ({heads}) must be a multiple "
                                   f"of num_key_value_heads ({kv_heads})")
        if head_dim % 2:
            raise ModelFormatError(f"{source}: head_dim {head_dim} must be even for RoPE")
        attention_bias = fields.get("attention_bias", bool, False)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(isinstance(e, int) for e in eos_ids):
            raise ModelFormatError(f"{source}: eos_token_id must be an int or a list of ints, "
                                   f"got {eos!r}")
        return cls(
            architecture=arch,
            vocab_size=fields.require("vocab_size", int),
            hidden_size=hidden,
            intermediate_size=fields.require("intermediate_size", int),
            num_layers=fields.require("num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=fields.get("rms_norm_eps", float, 1e-6),
            rope=_rope(raw, fields, source),
            max_position_embeddings=fields.get("max_position_embeddings", int, 2048),
            tie_word_embeddings=fields.get("tie_word_embeddings", bool, False),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=attention_bias and arch != "Qwen2ForCausalLM",
            mlp_bias=fields.get("mlp_bias", bool, False),
            sliding_window=_sliding_window(raw, fields, arch),
            bos_token_id=fields.get("bos_token_id", int, None),
            eos_token_ids=eos_ids,
            dtype=_dtype(raw),
        )

    @property
    def family(self) -> str:
        """llama, mistral or qwen2."""
        return ARCHITECTURES[self.architecture]

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, by its Hugging Face name, with its shape
        (projections are (out_features, in_features) as PyTorch stores them)."""
        h, d, inter = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            for name, out, inp, bias in (("q_proj", q, h, self.qkv_bias),
                                         ("k_proj", kv, h, self.qkv_bias),
                                         ("v_proj", kv, h, self.qkv_bias),
                                         ("o_proj", h, q, self.o_bias)):
                shapes[f"{p}self_attn.{name}.weight"] = (out, inp)
                if bias:
                    shapes[f"{p}self_attn.{name}.bias"] = (out,)
            for name, out, inp in (("gate_proj", inter, h), ("up_proj", inter, h),
                                   ("down_proj", h, inter)):
                shapes[f"{p}mlp.{name}.weight"] = (out, inp)
                if self.mlp_bias:
                    shapes[f"{p}mlp.{name}.bias"] = (out,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


class _Fields:
    """Typed access to config entries, with errors naming the file and the entry."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def require(self, name: str, kind: type):
        if self.raw.get(name) is None:
            raise ModelFormatError(f"{self.source}: required entry {name!r} is missing")
        return self.get(name, kind, None)

    def get(self, name: str, kind: type, default):
        value = self.raw.get(name)
        if value is None:
            return default
        ok = (isinstance(value, bool) if kind is bool
              else isinstance(value, (int, float)) and not isinstance(value, bool)
              if kind is float else isinstance(value, kind) and not isinstance(value, bool))
        if kind is int and isinstance(value, float) and value.is_integer():
            value, ok = int(value), True
        if not ok:
            raise ModelFormatError(f"{self.source}: {name!r} must be {kind.__name__}, "
                                   f"got {value!r}")
        return kind(value)


def _architecture(raw: dict, source: str) -> str:
    archs = raw.get("architectures")
    if isinstance(archs, list) and archs:
        name = archs[0]
    else:
        by_type = {v: k for k, v in ARCHITECTURES.items()}
        name = by_type.get(raw.get("model_type"), raw.get("model_type"))
    if name not in ARCHITECTURES:
        raise ModelFormatError(f"{source}: architecture {name!r} is not supported; needle "
                               f"runs {', '.join(ARCHITECTURES)}")
    return name


def _rope(raw: dict, fields: _Fields, source: str) -> RopeConfig:
    """From ``rope_parameters`` (transformers >= 5) or ``rope_theta`` and ``rope_scaling``."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelFormatError(f"{source}: rope_scaling must be an object, got {params!r}")
    theta = params.get("rope_theta", fields.get("rope_theta", float, 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ModelFormatError(f"{source}: rope type {kind!r} is not supported; needle "
                               f"implements {', '.join(ROPE_TYPES)}")
    try:
        rope = RopeConfig(
            theta=float(theta), type=kind, factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get(
                "original_max_position_embeddings", raw.get("max_position_embeddings", 8192))))
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{source}: malformed rope parameters {params!r}: {e}") from None
    if rope.theta <= 0 or rope.factor <= 0:
        raise ModelFormatError(f"{source}: rope theta and factor must be positive: {params!r}")
    if kind == "llama3" and rope.high_freq_factor <= rope.low_freq_factor:
        raise ModelFormatError(f"{source}: llama3 rope needs high_freq_factor > low_freq_factor")
    return rope


def _sliding_window(raw: dict, fields: _Fields, arch: str) -> int | None:
    """The attention window, or None when every position sees the whole prefix."""
    if arch == "Qwen2ForCausalLM" and not fields.get("use_sliding_window", bool, False):
        return None
    if arch == "LlamaForCausalLM":
        return None
    return fields.get("sliding_window", int, None)


def _dtype(raw: dict) -> str:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return {"float32": "float32", "float16": "float16",
            "bfloat16": "bfloat16"}.get(str(name).removeprefix("torch."), "float32")
