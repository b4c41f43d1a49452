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
    ``use_sliding_window``, layers from ``max_window_layers`` on), "even" (Gemma 2: layers
    0, 2, 4, ...) or "pattern" (Gemma 3: every layer but each ``sliding_window_pattern``-th,
    6 by default).
    ``local_rope``: sliding layers rotate with a base of their own and no scaling
    (Gemma 3's ``rope_local_base_freq``, or ``rope_parameters["sliding_attention"]``).
    ``ties_embeddings``: the output head is the embedding unless config.json says otherwise.
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
    local_rope: bool = False
    ties_embeddings: bool = False


# Hugging Face class name (config.json "architectures") -> its description
ARCHITECTURES = {
    "LlamaForCausalLM": Architecture("llama"),
    "MistralForCausalLM": Architecture("mistral", windows="all"),
    "Qwen2ForCausalLM": Architecture("qwen2", qkv_bias=True, windows="from_max_window_layers"),
    "Qwen3ForCausalLM": Architecture("qwen3", qk_norm=True, windows="from_max_window_layers"),
    "Gemma2ForCausalLM": Architecture("gemma2", activation="gelu_tanh", norm_offset=1.0,
                                      sandwich_norms=True, scale_embeddings=True,
                                      windows="even", softcapping=True,
                                      query_pre_attn_scalar=True, ties_embeddings=True),
    # Gemma 3's text model (gemma-3-1b and 270m; the larger ones ship as a vision-language
    # Gemma3ForConditionalGeneration): Gemma 2's layer with Qwen3's head norms, five sliding
    # layers to one global, two rotary bases; soft-capping only if config.json sets caps
    "Gemma3ForCausalLM": Architecture("gemma3_text", activation="gelu_tanh", norm_offset=1.0,
                                      qk_norm=True, sandwich_norms=True,
                                      scale_embeddings=True, windows="pattern",
                                      softcapping=True, query_pre_attn_scalar=True,
                                      local_rope=True, ties_embeddings=True),
    "Phi3ForCausalLM": Architecture("phi3", fused_checkpoint=True, windows="all"),
}
# Vision-language classes whose language model is a supported decoder: config.json keeps it
# in "text_config" (written as a diff from the text class's defaults, below), and the
# checkpoint names its tensors "language_model.model.*" (checkpoint.py reads them as
# "model.*"); the vision tower is not loaded
TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# config.json "model_type" -> class name, for configs without "architectures"
MODEL_TYPES = {arch.family: name for name, arch in ARCHITECTURES.items()} | {
    "gemma3": "Gemma3ForConditionalGeneration"}
# transformers' defaults for entries a config.json may leave out: Hub configs of
# Gemma3ForConditionalGeneration list only where their text_config departs from these
# (Gemma3TextConfig's defaults, transformers 4.50-5.x)
CONFIG_DEFAULTS = {
    "Gemma3ForCausalLM": {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "bos_token_id": 2,
        "eos_token_id": 1, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6},
}
# values of hidden_act / hidden_activation that each activation accepts
ACTIVATION_NAMES = {"silu": ("silu", "swish"),
                    "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")}
