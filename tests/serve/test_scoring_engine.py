"""Scoring prompts in the engine: ``RequestParams.prompt_logprobs`` on every device, each
log-probability checked against transformers' on the same checkpoint (a tiny Llama written
by ``save_pretrained`` with a tokenizer trained here). The server's side (``echo``, the
``openai`` client, lm-evaluation-harness) is ``test_prompt_logprobs.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from needle.errors import GenerationError
from needle.serve import Engine, RequestParams


def _reference(reference, ids: list[int]) -> np.ndarray:
    """transformers' float64 log-softmax at every position of ``ids`` (len(ids), vocab)."""
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def _check_scores(items, ids, expected, top):
    """items[i] scores ids[i] under positions < i, as ``expected`` (the reference's rows)."""
    assert len(items) == len(ids) and items[0] is None
    for i in range(1, len(ids)):
        t = items[i]
        assert t.token == ids[i]
        assert t.logprob == pytest.approx(expected[i - 1, ids[i]], abs=2e-4)
        assert len(t.top) == top
        if top:
            best = np.argsort(-expected[i - 1], kind="stable")[:top]
            assert [lp for _, lp in t.top] == pytest.approx(expected[i - 1, best], abs=2e-4)
            assert [lp for _, lp in t.top] == sorted((lp for _, lp in t.top), reverse=True)
            for token, lp in t.top:  # ties aside, the same tokens
                assert lp == pytest.approx(expected[i - 1, token], abs=2e-4)


def test_engine_scores_prompts_across_chunks_and_cached_prefixes(device, scored_dir):
    """On every device: prompts longer than a step's token budget are scored chunk by
    chunk, a prompt whose pages another request has cached is still read (and scored)
    whole, and max_tokens=0 scores without generating."""
    from needle.models import load_pretrained

    directory, reference = scored_dir
    scored = load_pretrained(directory, device=device, dtype="float32")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, scored.config.vocab_size, n).tolist() for n in (70, 23, 5)]
    engine = Engine(scored, max_seqs=4, max_batch_tokens=32)
    plain = engine.submit(prompts[0], RequestParams(max_tokens=2, ignore_eos=True))
    engine.run_until_idle()  # its pages now cached under their prefix
    asked = [engine.submit(p, RequestParams(max_tokens=m, prompt_logprobs=k, ignore_eos=True))
             for p, m, k in zip(prompts, (0, 3, 1), (2, 0, 1))]
    engine.run_until_idle()
    assert plain.prompt_logprobs == [] and plain.finish_reason == "length"
    for r, p, k in zip(asked, prompts, (2, 0, 1)):
        assert r.cached_tokens == 0 and r.error is None
        _check_scores(r.prompt_logprobs, p, _reference(reference, p), k)
    assert asked[0].output == [] and asked[0].finish_reason == "length"
    assert len(asked[1].output) == 3
    assert engine.stats()["running"] == 0 and engine.cache.pool.stats().used == 0


def test_prompt_logprobs_settings_are_checked(scored):
    with pytest.raises(GenerationError, match="prompt_logprobs must be an int"):
        RequestParams(prompt_logprobs=21)
    with pytest.raises(GenerationError, match="0 only with prompt_logprobs"):
        RequestParams(max_tokens=0)
    engine = Engine(scored, max_seqs=2)
    full = list(range(scored.max_seq_len))  # no room for a token, room to be scored
    with pytest.raises(GenerationError, match="leaves no room"):
        engine.submit(full, RequestParams(max_tokens=1))
    r = engine.submit(full, RequestParams(max_tokens=0, prompt_logprobs=0))
    engine.run_until_idle()
    assert len(r.prompt_logprobs) == len(full) and r.finish_reason == "length"
