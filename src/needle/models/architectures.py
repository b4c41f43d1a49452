"""What each supported model family does differently from Llama, as data.

The decoder is the same for every family (``transformer.py``): embed, then per layer a norm,
attention with rotary positions, a residual add, a norm, a gated MLP, a residual add; then a
final norm and the output head. An ``Architecture`` lists only where a family departs from
that, so adding a family is adding an entry here (and a test against transformers), not
copying the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """A model family's departures from Llama.

    ``activation``: the MLP gate's function, "silu" (SwiGLU) or "gelu_tanh" (GeGLU).
    ``norm_offset``: RMSNorm scales by (offset + weight); Gemma stores weight - 1.
    ``qk_norm``: an RMSNorm over each query and key head before RoPE (Qwen3).
    ``sandwich_norms``: attention and MLP outputs are normed before their residual adds, and
    the MLP's input norm has its own name (Gemma 2).
    ``scale_embeddings``: embeddings are multiplied by sqrt(hidden_size), rounded to the
    model's dtype (Gemma).
    ``fused_checkpoint``: the checkpoint stores q/k/v as one ``qkv_proj`` and gate/up as one
    ``gate_up_proj`` (Phi-3).
    ``qkv_bias``: q, k and v projections always carry biases (Qwen2); otherwise the config's
    ``attention_bias`` decides, and then the output projection has one too.
    ``windows``: which layers attend within ``sliding_window`` when config.json has no
    ``layer_types``: "none", "all", "from_max_window_layers" (Qwen: with
    ``use_sliding_window``, layers from ``max_window_layers`` on) or "even" (Gemma 2: layers
    0, 2, 4, ...).
    ``softcapping``: attention scores and final logits pass through cap * tanh(x / cap),
    with the caps from config.json (Gemma 2).
    ``query_pre_attn_scalar``: attention scores are scaled by that config entry ** -0.5
    instead of head_dim ** -0.5 (Gemma 2).
    """

    family: str
    activation: str = "silu"
    norm_offset: float = 0.0
    qk_norm: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    fused_checkpoint: bool = False
    qkv_bias: bool = False
    windows: str = "none"
    softcapping: bool = False
    query_pre_attn_scalar: bool = False


# Hugging Face class name (config.json "architectures") -> its description
ARCHITECTURES = {
    "LlamaForCausalLM": Architecture("llama"),
    "MistralForCausalLM": Architecture("mistral", windows="all"),
    "Qwen2ForCausalLM": Architecture("qwen2", qkv_bias=True, windows="from_max_window_layers"),
    "Qwen3ForCausalLM": Architecture("qwen3", qk_norm=True, windows="from_max_window_layers"),
    "Gemma2ForCausalLM": Architecture("gemma2", activation="gelu_tanh", norm_offset=1.0,
                                      sandwich_norms=True, scale_embeddings=True,
                                      windows="even", softcapping=True,
                                      query_pre_attn_scalar=True),
    "Phi3ForCausalLM": Architecture("phi3", fused_checkpoint=True, windows="all"),
}
# config.json "model_type" -> class name, for configs without "architectures"
MODEL_TYPES = {arch.family: name for name, arch in ARCHITECTURES.items()}
# values of hidden_act / hidden_activation that each activation accepts
ACTIVATION_NAMES = {"silu": ("silu", "swish"),
                    "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")}
