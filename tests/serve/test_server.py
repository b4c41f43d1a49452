"""``needle serve`` end to end: a real server on 127.0.0.1 (a free port) driven by the
official ``openai`` client, with a tiny random model on the CPU."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

from needle.serve import Engine, RequestParams  # noqa: E402
from needle.serve.server import Server  # noqa: E402

KEY = "test-key"
NAME = "tiny-llama"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A uvicorn server on a thread, stopped (drained) at the end."""

    def __init__(self, model, name=NAME, api_key=KEY, **engine_options):
        self.engine = Engine(model, **engine_options)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(Server(self.engine, name, api_key).app, host="127.0.0.1",
                                port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def running(model):
    server = Running(model, max_seqs=16, max_queue=64)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(running):
    return openai.OpenAI(base_url=running.url + "/v1", api_key=KEY, max_retries=0)


def _expected_completion(model, prompt: str, n: int) -> str:
    ids = model.tokenizer.encode(prompt)
    return model.tokenizer.decode(model.generate(ids, n, temperature=0))


def _greedy_ids(model, messages, n: int) -> list[int]:
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              return_dict=False)
    return model.generate(ids, n, temperature=0, stop=())


def _expected_chat(model, messages, n: int) -> str:
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              return_dict=False)
    return model.tokenizer.decode(model.generate(ids, n, temperature=0))


def test_completion_and_stream_equal_generate(model, client):
    want = _expected_completion(model, "The quick brown", 12)
    r = client.completions.create(model=NAME, prompt="The quick brown", max_tokens=12,
                                  temperature=0)
    assert r.choices[0].text == want
    assert r.usage.prompt_tokens == len(model.tokenizer.encode("The quick brown"))
    assert r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(client.completions.create(model=NAME, prompt="The quick brown",
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] in ("stop", "length") and set(finals[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_and_stream_equal_generate(model, client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tokens, tokens everywhere"}]
    want = _expected_chat(model, messages, 16)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want


def test_a_conversations_next_turn_reports_its_cached_prompt_tokens(model, client):
    """Turn two sends turn one's messages again: their pages, kept after turn one ended,
    are read from the prefix cache; the usage says how many tokens (OpenAI's
    prompt_tokens_details.cached_tokens) and the answer is generate's."""
    messages = [{"role": "system", "content": "You answer in one short sentence. " * 6},
                {"role": "user", "content": "Where do tokens go?"}]
    first = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8,
                                           temperature=0)
    turn_one = len(model.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                       return_dict=False))
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8,
                                            temperature=0)
    assert second.choices[0].message.content == _expected_chat(model, messages, 8)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (turn_one - 1) // 16 * 16 > 0  # at least turn one's full prompt pages
    assert cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_logprobs_through_the_openai_client(model, client):
    """Chat's logprobs (content entries with top_logprobs) and completions' (tokens,
    token_logprobs, top_logprobs, text_offset), whole and streamed; a greedy token is its
    own likeliest alternative."""
    messages = [{"role": "user", "content": "Tokens, tokens everywhere"}]
    options = dict(model=NAME, messages=messages, max_tokens=8, temperature=0,
                   extra_body={"ignore_eos": True}, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**options)
    content = r.choices[0].logprobs.content
    # the tokens' bytes add up to the answer (a token inside a multi-byte character shows as
    # U+FFFD alone: this random-weight model writes any bytes)
    assert len(content) == r.usage.completion_tokens == 8
    answer = b"".join(bytes(c.bytes) for c in content)
    assert answer.decode("utf-8", errors="replace") == r.choices[0].message.content
    assert answer == b"".join(model.tokenizer.token_bytes(t)
                              for t in _greedy_ids(model, messages, 8))
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
        assert bytes(c.bytes).decode("utf-8", errors="replace") == c.token
    streamed = [e for chunk in client.chat.completions.create(**options, stream=True)
                if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None
    c = client.completions.create(model=NAME, prompt="The quick brown", max_tokens=6,
                                  temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model=NAME, messages=messages, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="logprobs must be an integer in"):
        client.completions.create(model=NAME, prompt="x", logprobs=9)


def test_sixteen_concurrent_clients_get_their_greedy_answers(model, client):
    prompts = [f"{w} tokens {i}" for i, w in enumerate(
        ["The", "needle", "Naïve", "Tokens", "byte", "quick", "small", "every"] * 2)]
    lengths = [4 + (i * 5) % 17 for i in range(16)]
    want = [_expected_completion(model, p, n) for p, n in zip(prompts, lengths)]

    def one(i):
        if i % 2:
            stream = client.completions.create(model=NAME, prompt=prompts[i], temperature=0,
                                               max_tokens=lengths[i], stream=True)
            return "".join(c.choices[0].text for c in stream)
        return client.completions.create(model=NAME, prompt=prompts[i], temperature=0,
                                         max_tokens=lengths[i]).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    assert got == want


def _wait_idle(engine, seconds=10.0):
    deadline = time.time() + seconds
    while time.time() < deadline:
        s = engine.cache.pool.stats()
        if s.used == 0 and s.reserved == 0 and not engine.scheduler.running:
            return True
        time.sleep(0.02)
    return False


def test_cancelled_stream_frees_its_pages(running, client):
    stream = client.completions.create(model=NAME, prompt="The quick brown", max_tokens=200,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    assert running.engine.cache.pool.stats().used > 0
    stream.close()  # the client goes away mid-answer
    assert _wait_idle(running.engine)
    assert running.engine.stats()["finished"].get("cancelled", 0) >= 1


def test_models_health_metrics(running, client):
    assert [m.id for m in client.models.list()] == [NAME]
    assert client.models.list().data[0].max_model_len == running.engine.model.max_seq_len
    assert httpx.get(running.url + "/health").json()["status"] == "ok"
    client.completions.create(model=NAME, prompt="x", max_tokens=2)
    text = httpx.get(running.url + "/metrics").text
    for name in ("needle_requests_running", "needle_requests_waiting", "needle_kv_pages_used",
                 "needle_generation_tokens_per_second", "needle_generation_tokens_total",
                 "needle_steps_total", "needle_steps_queued_ahead_total",
                 "needle_kv_pages_cached", "needle_prompt_tokens_cached_total"):
        assert f"# TYPE {name} " in text and f"\n{name} " in text
    value = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
             if line and not line.startswith("#")}
    assert value["needle_steps_total"] >= 1
    # on the CPU no step is captured, so none is queued ahead (tests/serve/test_engine.py
    # checks the devices that capture)
    assert value["needle_steps_queued_ahead_total"] == 0
    assert "<title>needle chat</title>" in httpx.get(running.url + "/").text


def test_bad_requests_get_openai_errors(running, client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="x", temperature=5)
    with pytest.raises(openai.BadRequestError, match="at most 64"):
        client.completions.create(model=NAME, prompt=["x", "y"], n=40)
    chat = [{"role": "user", "content": "x"}]
    # what needle cannot honour is refused, not ignored
    with pytest.raises(openai.BadRequestError, match="no tool-call format"):
        client.chat.completions.create(model=NAME, messages=chat, tool_choice="required",
                                       tools=[{"type": "function",
                                               "function": {"name": "f"}}])
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=NAME, prompt="x", best_of=3)
    with pytest.raises(openai.BadRequestError, match="web search"):
        client.chat.completions.create(model=NAME, messages=chat, web_search_options={})
    with pytest.raises(openai.BadRequestError, match="only text output"):
        client.chat.completions.create(model=NAME, messages=chat, modalities=["audio"],
                                       audio={"voice": "alloy", "format": "wav"})
    ok = client.chat.completions.create(model=NAME, messages=chat, max_tokens=2,
                                        response_format={"type": "text"}, logit_bias={},
                                        modalities=["text"])
    assert ok.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="image_url parts; needle serves text"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=NAME, messages=[])
    with pytest.raises(openai.BadRequestError, match="max_seq_len"):
        client.completions.create(model=NAME, prompt="x", max_tokens=100_000)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x")
    wrong = openai.OpenAI(base_url=running.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        wrong.completions.create(model=NAME, prompt="x")
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(running.url + "/v1/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(running.url + "/v1/completions", headers=auth,
                   content=json.dumps({"prompt": "x" * (5 << 20)}))
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    r = httpx.get(running.url + "/v1/nothing", headers=auth)
    assert r.status_code == 404 and "error" in r.json()
    assert _wait_idle(running.engine)


def test_too_large_for_the_pool_is_413(model):
    page = Engine(model, max_seqs=1).cache.page_bytes(model.config, 16, model.dtype)
    server = Running(model, max_seqs=1, kv_memory=2 * page)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.APIStatusError, match="KV pages") as e:
            client.completions.create(model=NAME, prompt="x", max_tokens=100)
        assert e.value.status_code == 413
    finally:
        server.stop()


def test_over_the_queue_limit_is_429(model):
    server = Running(model, max_seqs=1, max_queue=1)
    try:
        # one long request runs and one waits (submitted straight to the engine, so both are
        # in place before the HTTP request arrives): the next is over the queue limit
        long = RequestParams(max_tokens=250, ignore_eos=True)
        held = [server.engine.submit([3, 4], long)]
        while not server.engine.scheduler.running:  # admitted by the engine's thread
            time.sleep(0.001)
        held.append(server.engine.submit([3, 4], long))
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.RateLimitError, match="retry later"):
            client.completions.create(model=NAME, prompt="x", max_tokens=20)
        for r in held:
            server.engine.cancel(r)
        assert _wait_idle(server.engine)
    finally:
        server.stop()


def test_a_client_that_gives_up_on_a_plain_request_frees_it(model):
    server = Running(model, max_seqs=1, max_queue=16)
    try:
        long = RequestParams(max_tokens=250, ignore_eos=True)
        # the HTTP request waits behind these (seconds of decoding) until it is given up
        blockers = [server.engine.submit([3, 4], long) for _ in range(6)]
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", timeout=0.3,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"prompt": "x", "max_tokens": 20})
        deadline = time.time() + 10
        while server.engine.stats()["finished"].get("cancelled", 0) < 1:
            assert time.time() < deadline, "the abandoned request was not cancelled"
            time.sleep(0.02)
        assert not blockers[-1].finished
        for b in blockers:
            server.engine.cancel(b)
        assert _wait_idle(server.engine)
    finally:
        server.stop()


def test_chat_template_kwargs_reach_the_template(model, client):
    """vLLM's chat_template_kwargs: variables the template reads (Qwen3's enable_thinking
    writes an empty think block when it is false); names the server sets, or a non-object,
    are refused."""
    import copy

    from needle.serve import openai_api
    from tests.models.hf_models import CHATML

    tok = copy.copy(model.tokenizer)
    tok.chat_template = CHATML + ("{% if enable_thinking is defined and enable_thinking is "
                                  "false %}<think>\n\n</think>\n\n{% endif %}")
    body = {"messages": [{"role": "user", "content": "hi"}]}
    plain = openai_api.parse_chat(body, tok, model.generation_config).prompt
    off = openai_api.parse_chat({**body, "chat_template_kwargs": {"enable_thinking": False}},
                                tok, model.generation_config).prompt
    assert off[:len(plain)] == plain
    assert tok.decode(off[len(plain):]) == "<think>\n\n</think>\n\n"
    for bad in ([1], {"add_generation_prompt": False}, {"not a name": 1}):
        with pytest.raises(openai_api.ApiError, match="chat_template_kwargs"):
            openai_api.parse_chat({**body, "chat_template_kwargs": bad}, tok,
                                  model.generation_config)
    chat = [{"role": "user", "content": "x"}]  # through the openai client
    ok = client.chat.completions.create(model=NAME, messages=chat, max_tokens=2,
                                        extra_body={"chat_template_kwargs": {"today": "Monday"}})
    assert ok.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="may not set tools"):
        client.chat.completions.create(model=NAME, messages=chat, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"tools": []}})


def test_n_choices_are_seeded_answers(model, client):
    """n answers a prompt n times: seeded, choice j is the answer of seed + j (choice 0 the
    n = 1 answer), greedy ones are all the greedy answer; chat and completions, a list of
    prompts times n in order; usage counts each prompt once."""
    messages = [{"role": "user", "content": "Tell me a story"}]
    opts = dict(max_tokens=8, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(model=NAME, messages=messages, n=3, **opts)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for j, c in enumerate(r.choices):
        one = client.chat.completions.create(model=NAME, messages=messages,
                                             **{**opts, "seed": 11 + j})
        assert c.message.content == one.choices[0].message.content
    assert len({c.message.content for c in r.choices}) > 1  # different draws
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 24
    greedy = client.completions.create(model=NAME, prompt=["Once", "The cat"], n=2,
                                       max_tokens=5, temperature=0)
    texts = [c.text for c in greedy.choices]
    assert texts[0] == texts[1] == _expected_completion(model, "Once", 5)
    assert texts[2] == texts[3] == _expected_completion(model, "The cat", 5)
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    # streamed: every choice's chunks under its index, each ending once, usage at the end
    chunks = list(client.chat.completions.create(
        model=NAME, messages=messages, n=3, stream=True, logprobs=True,
        stream_options={"include_usage": True}, **opts))
    got = {0: "", 1: "", 2: ""}
    ends, tokens = [], {0: 0, 1: 0, 2: 0}
    for chunk in chunks[:-1]:
        [c] = chunk.choices
        got[c.index] += c.delta.content or ""
        tokens[c.index] += len(c.logprobs.content) if c.logprobs else 0
        if c.finish_reason:
            ends.append(c.index)
    assert [got[j] for j in range(3)] == [c.message.content for c in r.choices]
    assert sorted(ends) == [0, 1, 2] and tokens == {0: 8, 1: 8, 2: 8}
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    streamed = list(client.completions.create(model=NAME, prompt=["Once", "The cat"],
                                              max_tokens=5, temperature=0, stream=True,
                                              echo=True))
    text = {0: "", 1: ""}
    for chunk in streamed:
        text[chunk.choices[0].index] += chunk.choices[0].text
    assert text == {0: "Once" + texts[0], 1: "The cat" + texts[2]}

