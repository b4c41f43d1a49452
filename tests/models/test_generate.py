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


@pytest.mark.parametrize("top_k,top_p,min_p,penalty", [
    (None, None, None, None), (5, None, None, None), (None, 0.7, None, None),
    (20, 0.5, None, None), (None, None, 0.1, None), (30, 0.9, 0.05, 1.3),
    (None, None, None, 0.7)])
def test_sampler_matches_transformers_processors(top_k, top_p, min_p, penalty):
    """The repetition penalty, temperature, top-k, top-p and min-p, in transformers' order
    and with its meaning: the same distribution as its logits processors."""
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits = np.random.default_rng(0).standard_normal(100) * 3
    seen = [3, 17, 17, 42, 99]
    temperature = 0.7
    scores = torch.tensor(logits[None], dtype=torch.float64)
    processors = [lp.RepetitionPenaltyLogitsProcessor(penalty)] if penalty else []
    processors += [lp.TemperatureLogitsWarper(temperature)]
    processors += [lp.TopKLogitsWarper(top_k)] if top_k else []
    processors += [lp.TopPLogitsWarper(top_p)] if top_p else []
    processors += [lp.MinPLogitsWarper(min_p)] if min_p else []
    for proc in processors:
        scores = proc(torch.tensor([seen]), scores)
    expected = torch.softmax(scores, -1)[0].numpy()
    sampler = Sampler(temperature, top_k, top_p, min_p=min_p, repetition_penalty=penalty)
    sampler.observe(seen)
    np.testing.assert_allclose(sampler.probabilities(logits), expected, rtol=1e-9, atol=1e-12)


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


def test_uniform_is_a_fixed_function_of_seed_and_position():
    """The draw's counter-based hash: values a device kernel must reproduce bit for bit."""
    from needle.models.sampling import uniform

    assert uniform(0, 0) == uniform(0, 0)
    values = np.array([uniform(7, p) for p in range(20000)])
    assert values.min() >= 0 and values.max() < 1
    assert abs(values.mean() - 0.5) < 0.01 and abs(values.var() - 1 / 12) < 0.003
    assert len({uniform(s, 5) for s in range(1000)}) > 990


def test_repetition_penalty_without_sampling_is_greedy_on_penalized_logits(model):
    """transformers applies the penalty in greedy decoding too; so does needle."""
    plain = model.generate(PROMPT, 12, stop=())
    penalized = model.generate(PROMPT, 12, stop=(), repetition_penalty=50.0)
    assert penalized != plain
    assert len(set(penalized)) == len(penalized)  # no token twice under so strong a penalty
    assert not set(penalized) & set(PROMPT)
