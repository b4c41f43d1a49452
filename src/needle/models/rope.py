"""Rotary position embeddings: the frequencies of a checkpoint's ``rope_*`` settings.

Both layouts transformers writes are read: ``rope_theta`` and ``rope_scaling`` at top level
(transformers 4) and ``rope_parameters`` (transformers 5). Frequencies are computed in
float32 exactly as transformers computes them, so that greedy decoding matches it token for
token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import ModelFormatError

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    """A base ``theta`` and an optional scaling rule.

    ``longrope`` (Phi-3/3.5 long-context models) scales each frequency by ``short_factor``
    or, for sequences longer than ``original_max_position_embeddings``, ``long_factor``, and
    multiplies cos and sin by ``attention_factor``. transformers switches between the two
    factor sets as a sequence grows; needle picks one per loaded model, by its KV cache
    length (``tables(..., length)``), so a model loaded for long sequences uses the long
    factors from its first token.
    """

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def inv_freq(self, head_dim: int, length: int = 0) -> np.ndarray:
        """The head_dim/2 angular frequencies for sequences of up to ``length`` positions."""
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(
            head_dim)
        powers = (np.float32(self.theta) ** exponents).astype(np.float32)
        if self.type == "longrope":
            long = length > self.original_max_position_embeddings
            ext = np.asarray(self.long_factor if long else self.short_factor, np.float32)
            return (np.float32(1.0) / (ext * powers)).astype(np.float32)
        inv = (np.float32(1.0) / powers).astype(np.float32)
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
        angles = np.arange(length, dtype=np.float32)[:, None] * \
            self.inv_freq(head_dim, length)[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
        if self.attention_factor != 1.0:
            scale = np.float32(self.attention_factor)
            cos, sin = cos * scale, sin * scale
        return cos.astype(np.float32), sin.astype(np.float32)


def read_rope(raw: dict, theta_default: float, head_dim: int, source: str) -> RopeConfig:
    """From ``rope_parameters`` (transformers >= 5) or ``rope_theta`` and ``rope_scaling``."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelFormatError(f"{source}: rope_scaling must be an object, got {params!r}")
    theta = params.get("rope_theta", raw.get("rope_theta", theta_default))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (
            math.isfinite(theta) and theta > 0):
        raise ModelFormatError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    kind = "longrope" if kind == "su" else kind  # Phi-3's first name for it
    if kind not in ROPE_TYPES:
        raise ModelFormatError(f"{source}: rope type {kind!r} is not supported; needle "
                               f"implements {', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelFormatError(f"{source}: partial_rotary_factor "
                               f"{raw.get('partial_rotary_factor')} (RoPE on part of each "
                               "head) is not supported; needle rotates whole heads")
    original = params.get("original_max_position_embeddings",
                          raw.get("original_max_position_embeddings",
                                  raw.get("max_position_embeddings", 8192)))
    try:
        rope = RopeConfig(
            theta=float(theta), type=kind, factor=float(params.get("factor") or 1.0),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original),
            short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
            long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
            attention_factor=_attention_factor(raw, params, kind, int(original)))
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{source}: malformed rope parameters {params!r}: {e}") from None
    _check(rope, head_dim, source, params)
    return rope


def _attention_factor(raw: dict, params: dict, kind: str, original: int) -> float:
    """longrope's cos/sin scale: given, or sqrt(1 + ln(factor) / ln(original length)) with
    factor = max_position_embeddings / original (as transformers derives it)."""
    if kind != "longrope":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params.get("factor") or raw.get("max_position_embeddings", original) / original
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def _check(rope: RopeConfig, head_dim: int, source: str, params: dict) -> None:
    if rope.theta <= 0 or rope.factor <= 0:
        raise ModelFormatError(f"{source}: rope theta and factor must be positive: {params!r}")
    if rope.type == "llama3" and rope.high_freq_factor <= rope.low_freq_factor:
        raise ModelFormatError(f"{source}: llama3 rope needs high_freq_factor > low_freq_factor")
    if rope.type == "longrope" and not (len(rope.short_factor) == len(rope.long_factor)
                                        == head_dim // 2):
        raise ModelFormatError(f"{source}: longrope needs short_factor and long_factor of "
                               f"head_dim / 2 = {head_dim // 2} entries each")
