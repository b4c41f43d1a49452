"""config.json as transformers 4.x and 5.x write it reads to the same model: 5.x writes
``rope_parameters``, ``dtype`` and ``layer_types``; 4.x wrote ``rope_theta`` with
``rope_scaling``, ``torch_dtype``, and no layer types (needle derives them per family)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers

from needle.models import ModelConfig, load_pretrained

from .conftest import VARIANT_NAMES
from .hf_models import TINY, build, reference_logits


def as_transformers_4(raw: dict) -> dict:
    """A transformers-5 config dict in the layout transformers 4 wrote."""
    old = {k: v for k, v in raw.items() if k not in ("layer_types", "rope_parameters", "dtype")}
    rope = dict(raw.get("rope_parameters") or {})
    if "sliding_attention" in rope:  # Gemma 3: rope_local_base_freq for the sliding layers
        old["rope_local_base_freq"] = rope.pop("sliding_attention")["rope_theta"]
        rope = dict(rope.pop("full_attention"))
    old["rope_theta"] = rope.pop("rope_theta", 10000.0)
    if rope.get("rope_type", "default") != "default":
        old["rope_scaling"] = rope
    old["torch_dtype"] = raw.get("dtype", "float32")
    return old


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_both_layouts_give_one_config(checkpoints, variant):
    directory, _ = checkpoints(variant)
    raw = json.loads((directory / "config.json").read_text())
    assert "rope_parameters" in raw  # transformers 5 wrote it
    new = ModelConfig.from_dict(raw)
    old = ModelConfig.from_dict(as_transformers_4(raw))
    assert old == new


@pytest.mark.parametrize("cls,kwargs", [
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                         num_hidden_layers=3)),
    ("Qwen3Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2,
                         num_hidden_layers=3)),
    ("Gemma2Config", dict(sliding_window=8, num_hidden_layers=5)),
    ("MistralConfig", dict(sliding_window=8)),
    ("Phi3Config", dict(sliding_window=8, pad_token_id=0)),
    ("Gemma3TextConfig", dict(sliding_window=8, num_hidden_layers=13, pad_token_id=0)),
    ("Gemma3TextConfig", dict(sliding_window=8, num_hidden_layers=7, pad_token_id=0,
                              sliding_window_pattern=2)),
])
def test_derived_windows_are_transformers_layer_types(cls, kwargs):
    """Without layer_types, each family's rule gives the layers transformers makes sliding."""
    config = getattr(transformers, cls)(**{**TINY, **kwargs})
    raw = config.to_dict()
    raw["architectures"] = [cls.replace("TextConfig", "Config").replace("Config", "ForCausalLM")]
    types = raw.pop("layer_types", None) or ["sliding_attention"] * raw["num_hidden_layers"]
    expected = tuple(8 if t == "sliding_attention" else None for t in types)
    assert ModelConfig.from_dict(raw).layer_windows == expected


def test_phi3_longrope_matches_transformers(tmp_path):
    """Phi-3.5's longrope: per-frequency short factors and a cos/sin scale (sequences
    within original_max_position_embeddings, so transformers uses the short factors too)."""
    rng = np.random.default_rng(0)
    half = TINY["hidden_size"] // TINY["num_attention_heads"] // 2
    scaling = {"rope_type": "longrope", "short_factor": list(1 + rng.random(half)),
               "long_factor": list(2 + rng.random(half)), "original_max_position_embeddings": 64}
    hf = build("phi3", tmp_path, rope_scaling=scaling, original_max_position_embeddings=64)
    assert hf.model.rotary_emb.attention_scaling > 1
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] \
        == "longrope"
    model = load_pretrained(tmp_path, device="cpu_numpy", max_seq_len=64)
    assert model.config.rope.attention_factor > 1  # max 128 over original 64
    ids = rng.integers(0, 256, (1, 40))
    got, want = model(ids).numpy(), reference_logits(hf, ids).numpy()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
