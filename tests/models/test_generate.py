"""Generation: streaming, callbacks, stop tokens, seeded sampling, and the sampler's
top-k / top-p semantics against Hugging Face's logits warpers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from needle.errors import GenerationError, IndexOutOfRangeError
from needle.models import GenerationStats, Sampler, load_pretrained

PROMPT = [1, 17, 99, 3, 250, 42, 7, 128]


@pytest.fixture(scope="module")
def model(checkpoints):
    directory, _ = checkpoints("llama")
    return load_pretrained(directory, device="cpu_numpy", max_seq_len=64)


def test_stream_callback_and_list_agree(model):
    streamed = list(model.stream(PROMPT, 12, stop=()))
    seen = []
    stats = GenerationStats()
    assert model.generate(PROMPT, 12, stop=(), callback=seen.append, stats=stats) == streamed
    assert seen == streamed and len(streamed) == 12
    assert stats.prefill_tokens == len(PROMPT) and stats.decode_tokens == 11
    assert stats.prefill_tokens_per_s > 0 and stats.decode_tokens_per_s > 0


def test_stop_token_ends_generation(model):
    greedy = model.generate(PROMPT, 12, stop=())
    stop = greedy[4]
    first = greedy.index(stop)
    assert model.generate(PROMPT, 12, stop=[stop]) == greedy[:first + 1]


def test_eos_from_config_is_the_default_stop(model, checkpoints, tmp_path):
    greedy = model.generate(PROMPT, 12, stop=())
    directory, _ = checkpoints("llama")
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["eos_token_id"] = [255, greedy[5]]
    (tmp_path / "config.json").write_text(json.dumps(config))
    eos_model = load_pretrained(tmp_path, device="cpu_numpy", max_seq_len=64)
    assert eos_model.generate(PROMPT, 12) == greedy[:greedy.index(greedy[5]) + 1]


def test_seeded_sampling_is_reproducible(model):
    a = model.generate(PROMPT, 16, temperature=0.8, top_p=0.9, seed=7, stop=())
    b = model.generate(PROMPT, 16, temperature=0.8, top_p=0.9, seed=7, stop=())
    c = model.generate(PROMPT, 16, temperature=0.8, top_p=0.9, seed=8, stop=())
    assert a == b and a != c


def test_top_k_one_is_greedy(model):
    assert (model.generate(PROMPT, 10, temperature=1.5, top_k=1, seed=3, stop=())
            == model.generate(PROMPT, 10, stop=()))


def test_bad_requests(model):
    with pytest.raises(GenerationError, match="max_seq_len 64"):
        model.generate(PROMPT, 60)
    with pytest.raises(GenerationError, match="temperature"):
        model.generate(PROMPT, 3, temperature=-1)
    with pytest.raises(GenerationError, match="top_p"):
        model.generate(PROMPT, 3, temperature=1, top_p=1.5)
    with pytest.raises(IndexOutOfRangeError, match="300"):
        model.generate([1, 300], 3)
    with pytest.raises(IndexOutOfRangeError, match="300"):
        model(np.array([[1, 300]]))
    assert model.generate(PROMPT, 0) == []


def test_sampler_draws_follow_the_distribution():
    """Draws at successive positions (the hash's counter) follow the probabilities; a seed
    and a position always give the same token."""
    logits = np.log(np.array([0.5, 0.3, 0.2, 1e-9]))
    sampler = Sampler(temperature=1.0, seed=0)
    draws = [sampler.sample(logits, position) for position in range(4000)]
    counts = np.bincount(draws, minlength=4) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.2, 0.0], atol=0.03)
    again = Sampler(temperature=1.0, seed=0)
    assert [again.sample(logits, p) for p in range(50)] == draws[:50]
    other = Sampler(temperature=1.0, seed=1)
    assert [other.sample(logits, p) for p in range(50)] != draws[:50]


def test_sampled_tokens_are_the_same_on_every_device(checkpoints, device):
    """cpu_numpy (and CUDA) draw on the device inside the decode loop, the others on the
    host: one seed gives one sequence everywhere."""
    directory, _ = checkpoints("llama")
    reference = load_pretrained(directory, device="cpu_numpy", max_seq_len=64)
    model = load_pretrained(directory, device=device, dtype="float32", max_seq_len=64)
    settings = dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                    seed=11, stop=())
    assert model.generate(PROMPT, 20, **settings) == reference.generate(PROMPT, 20, **settings)


def test_repetition_penalty_without_sampling_is_greedy_on_penalized_logits(model):
    """transformers applies the penalty in greedy decoding too; so does needle."""
    plain = model.generate(PROMPT, 12, stop=())
    penalized = model.generate(PROMPT, 12, stop=(), repetition_penalty=50.0)
    assert penalized != plain
    assert len(set(penalized)) == len(penalized)  # no token twice under so strong a penalty
    assert not set(penalized) & set(PROMPT)
