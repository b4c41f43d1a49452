"""Memory estimates against the real models."""

from __future__ import annotations

import math

import pytest

from needle.models import load_pretrained, memory

PROMPT = [1, 17, 99, 3]


@pytest.mark.parametrize("name", ["llama", "llama3_rope_tied", "qwen2"])
def test_parameter_count_matches_transformers(checkpoints, name):
    directory, hf = checkpoints(name)
    model = load_pretrained(directory, device="cpu_numpy")
    assert memory.parameter_count(model.config) == hf.num_parameters()
    weights = {id(a.handle): a.handle.size * a.itemsize  # whole buffers: a tied head shares
               for a in model.weights.arrays()}  # the embedding's
    assert sum(weights.values()) == memory.estimate(model.config, "float32", 8).weights


def test_kv_cache_bytes_match_the_allocated_cache(checkpoints):
    directory, _ = checkpoints("qwen2")
    model = load_pretrained(directory, device="cpu_numpy", dtype="bfloat16", max_seq_len=48)
    model.generate(PROMPT, 2)
    expected = memory.kv_cache_bytes(model.config, 48, dtype="bfloat16")
    assert model.decoder().cache.nbytes == expected
    cfg = model.config
    assert expected == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 48 * 2


def test_estimate_of_a_7b_model():
    """Llama 2 7B: 6.74e9 weights, a 4096-token bfloat16 KV cache of 2 GiB."""
    from needle.models import LlamaConfig

    cfg = LlamaConfig.from_dict(dict(
        architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, vocab_size=32000))
    est = memory.estimate(cfg, "bfloat16", 4096)
    assert math.isclose(memory.parameter_count(cfg), 6_738_415_616)
    assert est.kv_cache == 2 * 2**30
    assert est.total > est.weights + est.kv_cache


def test_available_and_peak_on_the_host():
    from needle import cpu_numpy

    assert memory.available_bytes(cpu_numpy()) > 0
    peak = memory.peak_bytes(cpu_numpy())
    assert peak is not None and peak[0] > 0
