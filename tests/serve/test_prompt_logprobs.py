"""Scoring prompts through ``needle serve``: OpenAI's ``echo`` with ``logprobs`` through the
official ``openai`` client, and lm-evaluation-harness's own ``local-completions`` model
computing loglikelihoods and generations against the server. Every log-probability is
checked against transformers' on the same checkpoint (``test_scoring_engine.py``'s)."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import transformers

from .test_scoring_engine import _reference
from .test_server import KEY, NAME, Running


@pytest.fixture(scope="module")
def scoring_server(scored):
    server = Running(scored, max_seqs=8, max_queue=64)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scoring_client(scoring_server):
    return openai.OpenAI(base_url=scoring_server.url + "/v1", api_key=KEY, max_retries=0)


def test_echo_with_logprobs_through_the_openai_client(scored, scored_dir, scoring_client):
    """echo returns the prompt before the answer; with logprobs its tokens are scored (the
    first None, as OpenAI's); max_tokens=0 scores alone; a list of prompts gets a choice
    each; streamed, the echo is the first chunk."""
    reference, tok = scored_dir[1], scored.tokenizer
    text = "the cat sat on the mat"
    ids = tok.encode(text)
    expected = _reference(reference, ids)
    r = scoring_client.completions.create(model=NAME, prompt=text, echo=True, max_tokens=1,
                                          logprobs=1, temperature=0,
                                          extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.text.startswith(text) and len(choice.text) > len(text)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got = np.array(lp.token_logprobs[1:len(ids)])
    want = expected[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(got, want, atol=2e-4)
    assert [max(top.values()) for top in lp.top_logprobs[1:len(ids)]] == \
        pytest.approx(expected[:-1].max(axis=-1), abs=2e-4)
    greedy = int(np.argmax(expected[-1]))  # the answer's token: the prompt's greedy next
    assert lp.token_logprobs[-1] == pytest.approx(expected[-1, greedy], abs=2e-4)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1

    only = scoring_client.completions.create(model=NAME, prompt=[ids, ids[:4]], echo=True,
                                             max_tokens=0, logprobs=0)
    assert [c.index for c in only.choices] == [0, 1]
    assert only.choices[0].logprobs.token_logprobs[0] is None
    np.testing.assert_allclose(only.choices[0].logprobs.token_logprobs[1:], want, atol=2e-4)
    assert len(only.choices[1].logprobs.tokens) == 4
    assert all(c.finish_reason == "length" for c in only.choices)
    assert only.choices[0].text == tok.decode(ids)
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(ids) + 4

    chunks = list(scoring_client.completions.create(model=NAME, prompt=text, echo=True,
                                                    max_tokens=3, logprobs=1, stream=True,
                                                    extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == text
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None
    np.testing.assert_allclose(first.token_logprobs[1:], want, atol=2e-4)
    streamed = [t for c in chunks[1:] if c.choices[0].logprobs
                for t in c.choices[0].logprobs.token_logprobs]
    assert len(streamed) == 3

    plain = scoring_client.completions.create(model=NAME, prompt=text, echo=True, max_tokens=2,
                                              extra_body={"ignore_eos": True})
    assert plain.choices[0].text.startswith(text) and plain.choices[0].logprobs is None


def test_chat_echo_and_oversized_batches_are_refused(scoring_client):
    with pytest.raises(openai.BadRequestError, match="echo is a /v1/completions field"):
        scoring_client.chat.completions.create(model=NAME, extra_body={"echo": True},
                                               messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens must be an integer >= 1"):
        scoring_client.completions.create(model=NAME, prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="at most 64"):
        scoring_client.completions.create(model=NAME, prompt=["a"] * 65)
    with pytest.raises(openai.BadRequestError, match="prompt must be"):
        scoring_client.completions.create(model=NAME, prompt=["a", 3])


def test_lm_evaluation_harness_loglikelihoods(scored, scored_dir, scoring_server, monkeypatch):
    """lm-evaluation-harness's ``local-completions`` model (its own client code, tokenizing
    with transformers) asks needle serve for loglikelihoods and greedy checks, as its
    multiple-choice and perplexity tasks do; the sums equal transformers'."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    directory, reference = scored_dir
    lm = LocalCompletionsAPI(base_url=scoring_server.url + "/v1/completions", model=NAME,
                             tokenizer_backend="huggingface", tokenizer=str(directory),
                             tokenized_requests=True, num_concurrent=2, max_retries=1,
                             batch_size=3)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    pairs = [("the cat sat on", " the mat"), ("a dog ran", " far away"),
             ("the cat", " sat"), ("once upon a time", " there was a cat")]
    pairs.append(_greedy_pair(reference, hf, ["the cat", "a dog", "the mat", "the", "a cat sat"]))
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # what the harness sends as its bearer token
    got = lm.loglikelihood(requests, disable_tqdm=True)
    assert got[-1][1], "the model's own greedy continuation is greedy"
    # left to choose its tokenizer, the harness finds the server's (vLLM's endpoints) and
    # needs no copy of it: the same split, the same sums
    remote = LocalCompletionsAPI(base_url=scoring_server.url + "/v1/completions", model=NAME,
                                 tokenized_requests=True, max_retries=1, batch_size=3,
                                 auth_token=KEY)
    assert type(remote.tokenizer).__name__ == "RemoteTokenizer"
    again = remote.loglikelihood(requests, disable_tqdm=True)
    assert [g for _, g in again] == [g for _, g in got]
    assert [t for t, _ in again] == pytest.approx([t for t, _ in got], abs=1e-4)
    # perplexity tasks (loglikelihood_rolling): a text scored in windows (the harness's own
    # split, from its utils) of at most max_length tokens, the first after its prefix token;
    # the sum of the server's scores is transformers'
    from lm_eval import utils as harness

    text = "once upon a time the cat sat on the mat and the dog ran far away " * 2
    short = LocalCompletionsAPI(base_url=scoring_server.url + "/v1/completions", model=NAME,
                                tokenized_requests=True, max_retries=1, auth_token=KEY,
                                max_length=16)
    [total] = short.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)],
                                          disable_tqdm=True)
    ids = short.tok_encode(text)
    windows = [harness.make_disjoint_window(w) for w in harness.get_rolling_token_windows(
        ids, short.prefix_token_id, short.max_length - 1, 1)]
    assert len(windows) > 2
    want = 0.0
    for context, continuation in windows:
        seq = list(context) + list(continuation)
        scores = _reference(reference, seq)
        want += sum(scores[len(context) - 1 + i, t] for i, t in enumerate(continuation))
    assert total == pytest.approx(want, abs=2e-3)
    for (context, continuation), (total, greedy) in zip(pairs, got):
        # the harness's split: the whole text's tokens, the context's count of them
        ids = hf(context + continuation, add_special_tokens=False)["input_ids"]
        ctx = hf(context, add_special_tokens=False)["input_ids"]
        expected = _reference(reference, ids)
        rows = np.arange(len(ctx) - 1, len(ids) - 1)
        assert total == pytest.approx(expected[rows, ids[len(ctx):]].sum(), abs=1e-3)
        assert greedy == bool((expected[rows].argmax(-1) == ids[len(ctx):]).all())
    # its generation tasks through the same client: greedy answers cut at `until`
    until = ["\n", "Question:", "Answer:", "</s>", "<|endoftext|>", "###"]  # over OpenAI's 4
    asks = [Instance("generate_until", {}, (context, {"until": until, "max_gen_toks": 6}), i)
            for i, (context, _) in enumerate(pairs)]
    answers = lm.generate_until(asks, disable_tqdm=True)
    for (context, _), answer in zip(pairs, answers):
        ids = hf(context, add_special_tokens=False)["input_ids"]  # as the harness sends it
        text = scored.tokenizer.decode(scored.generate(ids, 6, temperature=0))
        cut = min([text.find(u) for u in until if u in text], default=len(text))
        assert answer == text[:cut]


def _greedy_pair(reference, hf, contexts: list[str]) -> tuple[str, str]:
    """A (context, continuation) whose continuation is the reference's greedy next token
    and whose text tokenizes back to the same ids (so the harness's split finds it: a
    random model's favourite is often a byte of a character, which does not)."""
    for context in contexts:
        ctx = hf(context, add_special_tokens=False)["input_ids"]
        ids = [*ctx, int(_reference(reference, ctx)[-1].argmax())]
        continuation = hf.decode(ids[len(ctx):])
        if hf(context + continuation, add_special_tokens=False)["input_ids"] == ids:
            return context, continuation
    raise AssertionError("no context's greedy continuation tokenizes back to itself")


def test_vllm_tokenizer_endpoints(scored, scoring_server):
    """POST /tokenize (a prompt, or a chat's messages), POST /detokenize, GET
    /tokenizer_info, in vLLM's shapes, behind the API key; bad bodies are 400s."""
    import httpx

    auth, url, tok = {"Authorization": f"Bearer {KEY}"}, scoring_server.url, scored.tokenizer
    r = httpx.post(url + "/tokenize", headers=auth, json={"prompt": "the cat sat"}).json()
    assert r["tokens"] == tok.encode("the cat sat") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == scored.max_seq_len
    bare = httpx.post(url + "/tokenize", headers=auth,
                      json={"prompt": "the cat", "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode("the cat", add_special_tokens=False)
    back = httpx.post(url + "/detokenize", headers=auth, json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == tok.decode(r["tokens"], skip_special_tokens=False)
    info = httpx.get(url + "/tokenizer_info", headers=auth).json()
    assert "eos_token" in info and info["model_max_length"] == scored.max_seq_len
    for path, body, what in (("/tokenize", {}, "prompt"),
                             ("/tokenize", {"prompt": "x", "add_special_tokens": 1}, "true"),
                             ("/detokenize", {"tokens": [1, "2"]}, "list of token ids"),
                             ("/detokenize", {"tokens": [10 ** 6]}, "outside the vocabulary"),
                             ("/tokenize", {"messages": [{"role": "user", "content": "x"}]},
                              "chat template")):
        bad = httpx.post(url + path, headers=auth, json=body)
        assert bad.status_code == 400 and what in bad.json()["error"]["message"], (path, body)
    assert httpx.post(url + "/tokenize", json={"prompt": "x"}).status_code == 401

