"""OpenAI's logit_bias and presence / frequency penalties: the engine's tokens on every
device against the same rules applied by hand to the model's own step-by-step logits,
and the fields through the server."""

from __future__ import annotations

import numpy as np
import pytest

from needle.models.sampling import SamplingParams
from needle.serve import Engine, RequestParams
from needle.serve.logit_rules import LogitRules

PROMPT = "The quick brown fox"


def test_rules_follow_openais_definitions():
    logits = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    rules = LogitRules(((0, 5.0), (3, -100.0)), presence=0.5, frequency=0.25)
    got = rules.apply(logits, [2, 2, 1])  # token 2 twice, token 1 once
    np.testing.assert_allclose(got, [6.0, 2.0 - 0.75, 3.0 - 1.0, -96.0])
    assert not LogitRules() and LogitRules(presence=0.1)
    np.testing.assert_array_equal(logits, [1.0, 2.0, 3.0, 4.0])  # not changed in place


def _greedy_by_hand(model, ids: list[int], n: int, rules: LogitRules) -> list[int]:
    """Greedy tokens of ``model`` with ``rules`` applied to each step's logits."""
    decoder = model.decoder()
    logits = decoder.prefill(ids)
    out: list[int] = []
    for _ in range(n):
        row = rules.apply(np.asarray(logits.numpy(), np.float32).reshape(-1), out)
        out.append(int(np.argmax(row)))
        logits = decoder.step(out[-1])
    return out


def test_every_device_applies_bias_and_penalties(device, model_dir):
    from needle.models import load_pretrained

    model = load_pretrained(model_dir, device=device, dtype="float32")
    ids = model.tokenizer.encode(PROMPT)
    plain = model.generate(ids, 12, temperature=0, stop=())
    cases = [LogitRules(((plain[0], -100.0),)),  # the first choice banned
             LogitRules(((7, 100.0),)),  # one token forced
             LogitRules(presence=2.0, frequency=2.0),  # no token twice, in practice
             LogitRules(((plain[1], 3.0),), presence=-1.0, frequency=0.5)]
    engine = Engine(model, max_seqs=4)
    requests = [engine.submit(ids, RequestParams(max_tokens=12, ignore_eos=True,
                                                 logit_rules=rules)) for rules in cases]
    engine.run_until_idle()
    for rules, r in zip(cases, requests):
        assert r.output == _greedy_by_hand(model, ids, 12, rules), rules
    assert plain[0] not in requests[0].output
    assert requests[1].output == [7] * 12
    assert len(set(requests[2].output)) == 12 and requests[2].output != plain
    # a sampled request draws from the changed logits with its seed: banned stays banned
    sampled = engine.submit(ids, RequestParams(SamplingParams(temperature=1.0, seed=3),
                                               max_tokens=12, ignore_eos=True,
                                               logit_rules=LogitRules(((7, -100.0),))))
    engine.run_until_idle()
    assert 7 not in sampled.output and len(sampled.output) == 12


def test_bias_outside_the_vocabulary_is_refused(model):
    from needle.errors import GenerationError

    engine = Engine(model, max_seqs=2)
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        engine.submit([1, 2], RequestParams(logit_rules=LogitRules(((10**6, 1.0),))))


def test_the_server_takes_the_fields(model):
    import openai

    from .test_server import KEY, NAME, Running

    server = Running(model, max_seqs=4)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        ids = model.tokenizer.encode(PROMPT)
        want = _greedy_by_hand(model, ids, 8, LogitRules(((7, 100.0),)))
        got = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0,
                                        logit_bias={"7": 100}, extra_body={"ignore_eos": True})
        assert got.choices[0].text == model.tokenizer.decode(want)
        answer = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
            presence_penalty=1.5, frequency_penalty=0.5)
        assert answer.choices[0].message.content is not None
        for extra, message in [({"logit_bias": {"7": 300}}, "logit_bias"),
                               ({"logit_bias": {"x": 1}}, "logit_bias"),
                               ({"frequency_penalty": 3}, "frequency_penalty"),
                               ({"logit_bias": {"99999999": 1}}, "outside the vocabulary")]:
            with pytest.raises(openai.BadRequestError, match=message):
                client.completions.create(model=NAME, prompt="x", max_tokens=2, **extra)
    finally:
        server.stop()
