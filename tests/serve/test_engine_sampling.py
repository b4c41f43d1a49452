"""Sampled requests in the serving engine: each logits row chooses its token with
``nd.sample`` and its request's settings, seed and position (on the device where it can
sample, inside the recorded step), so every seeded request gets the tokens
``model.generate`` gives it alone, whatever it shares a step with; and a captured sampled
step's successor is queued on the device as a greedy one's is."""

from __future__ import annotations

import numpy as np
import pytest

from needle.backends.api import has
from needle.errors import GenerationError
from needle.models.sampling import Sampler
from needle.serve import Engine, RequestParams, SamplingParams
from needle.serve.choice import choose_on_host, sampling_rows

from .test_engine import end_as_one_at_a_time

# every filter, a penalty with and without temperature, and plain greedy: one batch
SETTINGS = [
    dict(temperature=0.9, top_p=0.9, seed=7),
    dict(temperature=1.0, top_k=20, seed=8),
    dict(temperature=0.7, min_p=0.1, seed=9),
    dict(temperature=0.8, repetition_penalty=1.3, seed=10),
    dict(temperature=0.0, repetition_penalty=1.2),
    dict(temperature=0.0),
]
OFF = dict(top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, seed=None)


def _settings(kw: dict) -> dict:
    return {**OFF, **kw}  # every setting explicit: generate would fill gaps from the model's


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, size=int(rng.integers(2, 30))).tolist() for _ in range(n)]


def test_host_choice_is_each_rows_sampler():
    """choose_on_host over a batch of rows gives what each request's Sampler gives alone
    (the penalty reading each row's own seen tokens)."""
    rng = np.random.default_rng(0)
    vocab = 300
    logits = (3 * rng.standard_normal((len(SETTINGS), vocab))).astype(np.float32)
    samplers = []
    for i, kw in enumerate(SETTINGS):
        s = Sampler(**{k: v for k, v in _settings(kw).items()})
        s.observe(rng.integers(0, vocab, 20 + i))
        samplers.append(s)
    positions = [5, 17, 40, 41, 3, 9]
    rows = sampling_rows(samplers, positions, vocab)
    assert rows.seen is not None and rows.seen.shape == (len(SETTINGS), vocab)
    got = choose_on_host(logits, rows)
    assert got.tolist() == [s.sample(logits[i], p)
                            for i, (s, p) in enumerate(zip(samplers, positions))]
    plain = sampling_rows(samplers[:3], positions[:3], vocab)
    assert plain.seen is None  # no penalty: no mask to build or send


def test_every_device_samples_each_request_as_generate_does(device, model_dir):
    from needle.models import load_pretrained

    m = load_pretrained(model_dir, device=device, dtype="float32", max_seq_len=64)
    prompts = _prompts(len(SETTINGS), seed=21)
    single = [m.generate(p, 10, stop=(), **_settings(kw)) for p, kw in zip(prompts, SETTINGS)]
    engine = Engine(m, max_seqs=len(SETTINGS), page_size=8)
    reqs = [engine.submit(p, RequestParams(SamplingParams(**_settings(kw)), 10,
                                           ignore_eos=True, logprobs=2 if i in (0, 5) else None))
            for i, (p, kw) in enumerate(zip(prompts, SETTINGS))]
    engine.run_until_idle()
    assert [r.output for r in reqs] == single
    assert single[0] != single[5]  # the draws did draw
    for r in reqs[0], reqs[5]:  # a sampled and a greedy request's logprobs, on the device too
        assert [t.token for t in r.logprobs] == r.output
        assert all(len(t.top) == 2 and t.logprob <= t.top[0][1] for t in r.logprobs)
    assert reqs[5].logprobs[0].top[0][0] == reqs[5].output[0]
    if engine.graphs.enabled and has(device.backend, "sampling"):
        assert (8, True) in engine.graphs._recorded  # the bucket's sampled step, captured


@pytest.mark.parametrize("ahead", [True, False])
def test_sampled_steps_queued_ahead_end_as_one_at_a_time(device, model_dir, ahead):
    """Where decode steps are captured and the device samples (cuda), a sampled step's
    successor is queued fed by its draws on the device, before they are read. A sequence
    that ends meanwhile (a stop token, max_tokens, a cancel) has that successor's token
    dropped: every answer is one-sequence generate's, cut where it should be."""
    from needle.models import load_pretrained

    m = load_pretrained(model_dir, device=device, dtype="float32", max_seq_len=64)
    prompts = _prompts(4, seed=31)
    kws = [_settings(dict(temperature=0.9, top_p=0.95, seed=40 + i)) for i in range(4)]
    single = [m.generate(p, 12, stop=(), **kw) for p, kw in zip(prompts, kws)]
    engine = Engine(m, max_seqs=4, page_size=8)
    engine._queue_ahead = ahead
    end_as_one_at_a_time(engine, prompts, single, lambda i: SamplingParams(**kws[i]))
    if ahead and engine.graphs.enabled and has(device.backend, "sampling"):
        assert engine.metrics.queued_ahead > 5
    else:
        assert engine.metrics.queued_ahead == 0


def test_a_penalty_keeps_its_steps_one_at_a_time(device, model_dir):
    """A repetition penalty reads the tokens its sequence holds, which the host updates as
    it reads them: such a step is not fed on the device, and its answer is generate's."""
    from needle.models import load_pretrained

    m = load_pretrained(model_dir, device=device, dtype="float32", max_seq_len=64)
    kw = _settings(dict(temperature=0.8, repetition_penalty=1.5, seed=3))
    prompt = _prompts(1, seed=41)[0]
    engine = Engine(m, max_seqs=2, page_size=8)
    req = engine.submit(prompt, RequestParams(SamplingParams(**kw), 12, ignore_eos=True))
    engine.run_until_idle()
    assert req.output == m.generate(prompt, 12, stop=(), **kw)
    assert engine.metrics.queued_ahead == 0


def test_logprobs_are_the_models_log_softmax(model):
    """A request asking for logprobs gets, for each token, its log-probability under the
    model's logits and the likeliest alternatives; its tokens are those of a request that
    did not ask, and one that did not ask gets none."""
    from needle.serve import RequestParams as Params

    prompt = [4, 5, 6, 7, 8]
    engine = Engine(model, max_seqs=3)
    # another sequence first in the step: the scored one's row is not row 0
    engine.submit([9, 10, 11], Params(max_tokens=6, ignore_eos=True))
    scored = engine.submit(prompt, Params(max_tokens=6, ignore_eos=True, logprobs=3))
    plain = engine.submit(prompt, Params(max_tokens=6, ignore_eos=True))
    engine.run_until_idle()
    assert scored.output == plain.output and plain.logprobs == []
    assert [t.token for t in scored.logprobs] == scored.output
    z = model.decoder().prefill(prompt).numpy().reshape(-1).astype(np.float64)
    reference = z - z.max() - np.log(np.exp(z - z.max()).sum())
    first = scored.logprobs[0]
    assert abs(first.logprob - reference[first.token]) < 1e-4
    assert [t for t, _ in first.top] == np.argsort(-reference, kind="stable")[:3].tolist()
    for t in scored.logprobs:  # greedy: the chosen token is the likeliest
        assert len(t.top) == 3 and t.top[0] == (t.token, t.logprob)
        assert all(a[1] >= b[1] for a, b in zip(t.top, t.top[1:])) and t.logprob <= 0
    with pytest.raises(GenerationError, match="logprobs must be an int in"):
        Params(logprobs=21)
