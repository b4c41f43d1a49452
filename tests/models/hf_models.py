"""Tiny random Hugging Face checkpoints, built in code and saved as safetensors.

Each builder returns the transformers model (the reference) after saving it to a
directory; nothing is downloaded. Weights use a larger initialisation than transformers'
default so that logits are well separated and greedy decoding is decided by the model, not
by rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
            initializer_range=0.2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)

# name -> (config class, model class, extra config entries); conftest.VARIANT_NAMES lists them
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_rope_tied": ("LlamaConfig", "LlamaForCausalLM", {
        "tie_word_embeddings": True, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"rope_theta": 1e6}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 1}),
    # windows shorter than the test sequences, so that they bind
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24, "rope_theta": 1e6}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 6,
        "attn_logit_softcapping": 5.0, "final_logit_softcapping": 4.0, "pad_token_id": 0}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "sliding_window": 7}),
    # 3 layers, the last global (pattern 3); two rotary bases, the global one scaled
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 6, "pad_token_id": 0,
        "num_hidden_layers": 3, "sliding_window_pattern": 3,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0,
                                               "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": 500.0}}}),
}


def build(variant: str, directory: Path, seed: int = 0, dtype: str = "float32",
          max_shard_size: str | None = None, **overrides):
    """Create the transformers model ``variant``, save it with ``save_pretrained`` in ``dtype``
    (as Hub checkpoints are written: bf16, fp16 or fp32; sharded when ``max_shard_size`` is
    given), and return the reference: the saved weights in float32, so that a comparison in
    float32 sees exactly the numbers in the file."""
    config_cls, model_cls, extra = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # norms start at 1 in transformers; random ones test more
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(torch.rand_like(p) + 0.5 if name.endswith("norm.weight")
                        else torch.randn_like(p) * 0.1)
    if dtype == "float32":
        model.save_pretrained(directory, safe_serialization=True,
                              **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        return model
    model.to(getattr(torch, dtype)).save_pretrained(
        directory, safe_serialization=True,
        **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    # read back as a user would: float32 from the file (buffers such as RoPE's inverse
    # frequencies are recomputed in float32, not rounded through the file's dtype)
    reference = getattr(transformers, model_cls).from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager")
    return reference.eval()


def reference_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens by re-running the full sequence each step (no generate() defaults)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def build_with_tokenizer(directory: Path, chat: bool = False, **overrides):
    """A tiny Llama (``build``) with a BPE tokenizer trained here; with ``chat``, a ChatML
    template in tokenizer_config.json and <|im_end|> as the eos token."""
    import json

    from .bpe import train

    tok = train(300)
    if not chat:
        tok.save(str(directory / "tokenizer.json"))
        return build("llama", directory, vocab_size=300, **overrides)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(directory / "tokenizer.json"))
    model = build("llama", directory, vocab_size=302, eos_token_id=tok.token_to_id("<|im_end|>"),
                  **overrides)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
         "chat_template": CHATML}))
    return model


def build_gemma3_vision(directory: Path, dtype: str = "bfloat16", seed: int = 0):
    """A tiny Gemma3ForConditionalGeneration (Gemma 3 4B-27B's class: a SigLIP vision tower
    beside the language model), saved by ``save_pretrained`` in ``dtype``; returns the
    reference read back from the file in float32. Its config.json keeps the language model
    in ``text_config``, and its tensors are named ``language_model.model.*``."""
    text = transformers.Gemma3TextConfig(**{**TINY, **VARIANTS["gemma3"][2]})
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(),
                                       vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                       image_token_index=255, boi_token_index=253,
                                       eoi_token_index=254)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # as build(): larger weights and random norms
        for name, p in model.named_parameters():
            if "language_model" in name:
                p.copy_(torch.rand_like(p) + 0.5 if name.endswith("norm.weight")
                        else torch.randn_like(p) * 0.2)
    model.to(getattr(torch, dtype)).save_pretrained(directory, safe_serialization=True)
    reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager")
    return reference.eval()
