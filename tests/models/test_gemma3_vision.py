"""Gemma 3's larger models ship as Gemma3ForConditionalGeneration, a vision-language
checkpoint: config.json keeps the language model's settings in ``text_config`` (on the Hub
as a diff from Gemma3TextConfig's defaults) and the tensors are named
``language_model.model.*`` beside a vision tower. needle loads the language model, as
transformers runs it on text, and quantizes it alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers

from needle.errors import ModelFormatError
from needle.models import ModelConfig, load_pretrained
from needle.models.checkpoint import Checkpoint
from needle.models.quantized import quantize_checkpoint

from .hf_models import build_gemma3_vision, reference_greedy

PROMPT = [1, 17, 99, 3, 250, 42, 7, 128, 9, 31]


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3-vision")
    return directory, build_gemma3_vision(directory)


def rel_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


def test_the_language_model_matches_transformers(vision_checkpoint, device):
    directory, hf = vision_checkpoint
    raw = json.loads((directory / "config.json").read_text())
    assert raw["architectures"] == ["Gemma3ForConditionalGeneration"] and "text_config" in raw
    assert any(n.startswith("vision_tower.") for n in Checkpoint(directory).tensors)
    model = load_pretrained(directory, device=device, dtype="float32")
    assert model.config.family == "gemma3_text"
    ids = np.array([PROMPT])
    import torch

    with torch.no_grad():
        expected = hf(input_ids=torch.as_tensor(ids)).logits.numpy()
    assert rel_error(model(ids).numpy(), expected) < 1e-4
    assert model.generate(PROMPT, max_new_tokens=12, stop=()) == reference_greedy(hf, PROMPT, 12)


def test_a_hub_style_text_config_reads_as_the_full_one(vision_checkpoint):
    """Hub configs list only where text_config departs from Gemma3TextConfig's defaults, in
    transformers 4's keys (rope_theta, rope_local_base_freq, rope_scaling)."""
    directory, _ = vision_checkpoint
    raw = json.loads((directory / "config.json").read_text())
    full = ModelConfig.from_dict(raw)
    defaults = transformers.Gemma3TextConfig().to_dict()
    text = {k: v for k, v in raw["text_config"].items()
            if k not in ("layer_types", "rope_parameters") and defaults.get(k) != v}
    rope = raw["text_config"]["rope_parameters"]
    text["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    text.update(rope_theta=rope["full_attention"]["rope_theta"],
                rope_scaling={k: v for k, v in rope["full_attention"].items()
                              if k != "rope_theta"})
    assert "hidden_size" in text and "hidden_activation" not in text  # a real diff
    hub = ModelConfig.from_dict({**raw, "text_config": text})
    assert hub == full
    assert full.layer_windows == (6, 6, None) and full.rope_local.theta == 500.0
    assert full.rope.type == "linear" and full.tie_word_embeddings


def test_quantizing_keeps_the_language_model_only(vision_checkpoint, tmp_path):
    directory, hf = vision_checkpoint
    out = quantize_checkpoint(directory, tmp_path / "q8", bits=8, group_size=None,
                              progress=False)
    names = Checkpoint(out).tensors
    assert not any(n.startswith(("vision_tower.", "multi_modal_projector.")) for n in names)
    assert "model.layers.0.self_attn.q_proj.qweight" in names
    model = load_pretrained(out, device="cpu_numpy", dtype="float32")
    ids = np.array([PROMPT])
    import torch

    with torch.no_grad():
        expected = hf(input_ids=torch.as_tensor(ids)).logits.numpy()
    assert rel_error(model(ids).numpy(), expected) < 0.05


def test_a_vision_config_without_text_config_is_refused(tmp_path):
    with pytest.raises(ModelFormatError, match="text_config"):
        ModelConfig.from_dict({"architectures": ["Gemma3ForConditionalGeneration"]})


def test_text_config_defaults_are_transformers(tmp_path):
    """gemma-3-4b-it's text_config as the Hub has it (six entries) reads as transformers
    completes it with Gemma3TextConfig's defaults."""
    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024}
    hub = ModelConfig.from_dict({"architectures": ["Gemma3ForConditionalGeneration"],
                                 "eos_token_id": [1, 106], "torch_dtype": "bfloat16",
                                 "text_config": text})
    full = transformers.Gemma3TextConfig(**text).to_dict()
    reference = ModelConfig.from_dict({**full, "architectures": ["Gemma3ForCausalLM"],
                                       "eos_token_id": [1, 106], "dtype": "bfloat16"})
    assert hub == reference
    assert (hub.num_heads, hub.num_kv_heads, hub.head_dim, hub.vocab_size) == (8, 4, 256, 262208)
    assert hub.layer_windows[:6] == (1024,) * 5 + (None,)
    assert (hub.rope.theta, hub.rope.factor, hub.rope_local.theta) == (1e6, 8.0, 1e4)
    assert hub.attn_scale == 256 ** -0.5 and hub.dtype == "bfloat16"
