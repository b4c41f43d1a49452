"""The LLM benchmark cases (``benchmarks/cases_llm.py`` and its helpers), at tiny sizes.

Speed is never asserted (design §8). These keep the cases honest: they build and agree with
their peers, the bytes a long-context token is rated by are the weights plus the K/V rows it
reads, the device-made 8B-style weights are distinct memory per tensor, and the gpt-fast-style
PyTorch model computes the same logits as needle's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from benchmarks import __main__ as bench_main
from benchmarks.frameworks import frameworks_for
from benchmarks.llm_models import (
    TINY_8B,
    DeviceRandom,
    hf_config,
    kv_bytes_per_position,
    reuse_weights,
    static_llama,
    weight_bytes,
)
from benchmarks.runner import Context

import needle.backend_ndarray as nd
from needle.models import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="module")
def ctx() -> Context:
    frameworks, _ = frameworks_for(nd.cpu())
    return Context(nd.cpu(), frameworks, quick=True)


@pytest.fixture(scope="module")
def model(ctx):
    cfg = LlamaConfig.from_dict(hf_config(TINY_8B, 512), source="test config")
    return LlamaForCausalLM(cfg, DeviceRandom(ctx, "float32"), 96, ctx.device, "float32")


def test_quick_run_of_the_new_cases(tmp_path):
    out = tmp_path / "llm.json"
    rc = bench_main.main(["--device", "cpu", "--quick", "--repeat", "2", "--cases",
                          "llm_decode_tiny_at_200_vs_limit,llm_decode_8b_tiny", "--json", str(out)])
    assert rc == 0
    cases = {c["name"]: c for c in json.loads(out.read_text())["cases"]}
    assert set(cases) == {"llm_decode_tiny_at_200_vs_limit", "llm_decode_8b_tiny"}
    for case in cases.values():
        assert case["skipped"] is None, case
        assert case["check"]["ok"], case
        # the gpt-fast-style model (eager on a CPU) agrees with needle, as transformers does
        peer = case["check"]["peers"]["torch:static"]
        assert peer <= case["check"]["rtol"], case
        assert all(impl["error"] is None for impl in case["impls"].values()), case
    assert cases["llm_decode_tiny_at_200_vs_limit"]["check"]["peer"] == "torch"  # transformers
    assert cases["llm_decode_8b_tiny"]["check"]["peer"] == "torch:static"
    # 16 tokens per call, each reading the weights and the K/V rows of positions 0..p
    cfg = LlamaConfig.from_dict(hf_config(dict(hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, vocab_size=256), 4096))
    rows = 200 + (32 + 1) / 2  # the window 200..231, each token reading p + 1 rows
    per_token = weight_bytes(cfg, "float32") + int(kv_bytes_per_position(cfg, "float32") * rows)
    long = cases["llm_decode_tiny_at_200_vs_limit"]
    assert long["work_per_call"] == 16 * per_token and long["work_unit"] == "B"
    assert any("K and V" in note for note in long["notes"])
    assert kv_bytes_per_position(cfg, "float32") == 2 * 2 * 2 * 16 * 4


def test_device_random_weights_are_distinct_memory_of_the_right_shapes(ctx):
    source = DeviceRandom(ctx, "float32")
    a = source("model.layers.0.self_attn.q_proj.weight", (128, 128))
    b = source("model.layers.1.self_attn.q_proj.weight", (128, 128))
    big = source("model.embed_tokens.weight", (40000, 128))  # more rows than one block
    norm = source("model.layers.0.input_layernorm.weight", (128,))
    assert a.shape == (128, 128) and big.shape == (40000, 128) and norm.shape == (128,)
    ha, hb, hbig = a.numpy(), b.numpy(), big.numpy()
    assert not np.array_equal(ha, hb)  # each tensor starts at its own row of the block
    amplitude = 0.02 * np.sqrt(3)
    for h in (ha, hb, hbig):
        assert np.abs(h).max() <= amplitude and 0.015 < h.std() < 0.025
    assert 1 <= norm.numpy().min() and norm.numpy().max() <= 1.1
    before = ha.copy()
    b[...] = 0  # a write to one tensor leaves the others (and the shared block) alone
    np.testing.assert_array_equal(a.numpy(), before)
    np.testing.assert_array_equal(source("model.layers.1.self_attn.q_proj.weight",
                                         (128, 128)).numpy(), hb)


def test_reused_weights_give_the_same_logits(ctx, model):
    twin = LlamaForCausalLM(model.config, reuse_weights(model), 200, ctx.device, "float32")
    ids = np.arange(1, 9)[None]
    np.testing.assert_array_equal(twin.forward(ids).numpy(), model.forward(ids).numpy())


def test_static_llama_matches_needle(ctx, model):
    """Prefill in chunks, then greedy steps: the torch model's logits are needle's."""
    from benchmarks import torch_llama

    peer = static_llama(ctx, model, 64)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 1024, 40)]
    chunk = torch_llama.PREFILL_CHUNK
    torch_llama.PREFILL_CHUNK = 16  # three chunks, the last one short
    try:
        peer.prefill(prompt[:-1])
    finally:
        torch_llama.PREFILL_CHUNK = chunk
    expected = model.forward(np.array([prompt]))[0].numpy()
    decoder = torch_llama.GreedyDecoder(peer, len(prompt) - 1, prompt[-1], compiled=False)
    first = decoder.run(3)
    np.testing.assert_allclose(first.numpy()[0], expected[-1], rtol=1e-4, atol=1e-5)
    assert decoder.position == len(prompt) + 2
    decoder.restart()
    np.testing.assert_array_equal(decoder.run(1).numpy(), first.numpy())
    with torch.no_grad():  # every position of a forward over the whole prompt
        full = peer(torch.tensor([prompt]), torch.arange(len(prompt)))[0].numpy()
    np.testing.assert_allclose(full, expected, rtol=1e-4, atol=1e-5)
