"""GGUF files written in the tests with the ``gguf`` package's writer and quantizer (the
reference implementation llama.cpp publishes), from a transformers model's weights, changed
as llama.cpp's convert_hf_to_gguf.py changes them (Llama's q/k rows interleaved, Gemma's
norms stored as 1 + w)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

NAMES = {"model.embed_tokens.weight": "token_embd.weight",
         "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm"}
# Gemma 3's names (llama.cpp's tensor map for the gemma3 architecture)
GEMMA3 = {**LAYER, "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
# byte tokens, then a few SentencePiece pieces with scores (higher: merged first)
PIECES = ["▁", "▁t", "he", "▁the", "▁a", "in", "▁in", "er", "▁c", "at", "▁cat", "on", "▁on",
          "▁m", "at", "▁mat", "▁s", "it", "s", "▁sits", "▁H", "ello", "▁Hello", "▁w", "or", "ld",
          "▁world", "!", "."]


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in NAMES:
        return NAMES[hf]
    parts = hf.split(".")  # model.layers.{i}.{module...}.weight
    module = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{(GEMMA3 if arch == 'gemma3' else LAYER)[module]}.{parts[-1]}"


def llama_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a small SentencePiece-style vocabulary."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # UNKNOWN, CONTROL, CONTROL, BYTE
    seen = set(tokens)
    for p in PIECES:
        if p not in seen:
            tokens.append(p)
            types.append(1)
            seen.add(p)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return tokens, scores, types


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (the rotary halves
    interleaved)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def random_blocks(kind: T, n: int, k: int, rng) -> np.ndarray:
    """Valid random raw blocks of a K-quant type (gguf's quantizer has none): random bytes
    with small finite fp16 super-block scales."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)

    def half(scale):
        return (rng.random((n, k // block)) * scale).astype(np.float16).view(np.uint8) \
            .reshape(n, k // block, 2)
    if kind == T.Q6_K:
        raw[..., 208:210] = half(2e-3)
    else:
        raw[..., 0:2], raw[..., 2:4] = half(2e-3), half(1e-3)
    return raw.reshape(n, -1)


def write_llama_gguf(model, path: Path, kind: T, rng, tokenizer: str = "llama",
                     chat_template: str | None = None, types: dict | None = None) -> Path:
    """Write a Llama ``model``'s weights (2-d ones as ``kind``, or ``types[hf_name]``) and
    metadata."""
    return write_gguf(model, path, kind, rng, "llama", tokenizer, chat_template, types)


def _rope(cfg, layer_type: str = "full_attention") -> dict:
    """A transformers 5 config's rotary settings (of one layer type where it keys them)."""
    return cfg.rope_parameters.get(layer_type, cfg.rope_parameters)


def write_gguf(model, path: Path, kind: T, rng, arch: str = "llama",
               tokenizer: str = "llama", chat_template: str | None = None,
               types: dict | None = None) -> Path:
    """Write ``model``'s weights and metadata as llama.cpp's converter does for ``arch``
    (llama, qwen2, qwen3 or gemma3)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = _rope(cfg)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type", "default") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if tokenizer == "llama":
        tokens, scores, token_types = llama_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(token_types)
        w.add_unk_token_id(0)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the converter writes no output tensor
        a = p.detach().float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = _permute(a, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = _permute(a, cfg.num_key_value_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            a = a + 1  # Gemma's norm shift
        t = (types or {}).get(name, kind if a.ndim == 2 else T.F32)
        if t == T.F32:
            w.add_tensor(gguf_name(name, arch), a.astype(np.float32))
        elif t in (T.Q4_K, T.Q5_K, T.Q6_K):
            w.add_tensor(gguf_name(name, arch), random_blocks(t, *a.shape, rng), raw_dtype=t)
        else:
            w.add_tensor(gguf_name(name, arch), quants.quantize(a, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
