"""Structured output (OpenAI's ``response_format``): answers constrained to a JSON schema by
llguidance, on every device's engine and through the official ``openai`` client, including
its ``parse`` helper, which turns a pydantic model into the schema and the answer back into
the model. A tiny random model left to itself writes no JSON; constrained, every answer
is valid JSON of the schema."""

from __future__ import annotations

import json
from typing import Literal

import pytest

from needle.models.sampling import SamplingParams
from needle.serve import Engine, RequestParams
from needle.serve.grammar import GrammarError, GrammarSpec

KEY, NAME = "test-key", "tiny-llama"  # test_server's (which needs the openai client)

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["answer", "count", "name"],
          "properties": {"answer": {"enum": ["yes", "no"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 9},
                         "name": {"type": "string", "maxLength": 6}}}
PROMPTS = ["Hello there", "The quick brown fox", "Tokens, tokens everywhere"]


def _valid(text: str) -> dict:
    """The answer as an object of SCHEMA, or an AssertionError saying why not."""
    value = json.loads(text)
    assert set(value) == {"answer", "count", "name"}, value
    assert value["answer"] in ("yes", "no") and value["count"] in range(10)
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert text == json.dumps(value, ensure_ascii=False)  # json.dumps' separators only
    return value


GRAMMAR = GrammarSpec.json_schema(SCHEMA)


def _params(temperature: float, seed: int, grammar=GRAMMAR):
    return RequestParams(SamplingParams(temperature=temperature, seed=seed), max_tokens=60,
                         grammar=grammar)


def test_every_device_answers_in_the_schema(device, model_dir):
    """Greedy and seeded sampled answers in one batch (CUDA draws the sampled rows on the
    device; a constrained row is chosen again on the host), each valid, each the answer the
    same request gets alone; unconstrained, the model writes no JSON at all."""
    from needle.models import load_pretrained

    model = load_pretrained(model_dir, device=device, dtype="float32")
    ids = [model.tokenizer.encode(p) for p in PROMPTS]
    settings = [_params(0.0, 1), _params(1.0, 2), _params(0.7, 3)]
    engine = Engine(model, max_seqs=4)
    together = [engine.submit(p, s) for p, s in zip(ids, settings)]
    engine.run_until_idle()
    for r in together:
        assert r.finish_reason == "stop", r.text
        _valid(r.text)
    for p, s, r in zip(ids, settings, together):
        alone = engine.submit(p, s)
        engine.run_until_idle()
        assert alone.output == r.output
    free = engine.submit(ids[0], _params(0.0, 1, grammar=None))
    engine.run_until_idle()
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.text)


def test_a_tokenizer_larger_than_the_models_vocabulary(model):
    """A tokenizer with ids past the model's logits rows (or a model padded past the
    tokenizer): the mask covers the model's rows and the grammar still applies."""
    from needle.serve.grammar import Grammars

    tok = model.tokenizer
    eos = model.generation_config.eos_token_ids
    for vocab in (tok.vocab_size - 20, tok.vocab_size + 50):
        constraint = Grammars(tok, vocab, eos).constraint(GRAMMAR)
        allowed = constraint.allowed()
        assert allowed.shape == (vocab,) and allowed[tok.token_id("{")] and allowed.sum() == 1


def test_properties_come_in_the_schemas_order(model):
    """As OpenAI writes them: an object's keys in the order its schema lists them."""
    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "alpha"],
              "properties": {"zeta": {"enum": ["a"]}, "alpha": {"enum": ["b"]}}}
    engine = Engine(model, max_seqs=2)
    r = engine.submit([1, 2, 3], _params(0.0, 1, GrammarSpec.json_schema(schema)))
    engine.run_until_idle()
    assert r.text == '{"zeta": "a", "alpha": "b"}'


def test_schemas_llguidance_refuses_are_clear_errors(model):
    engine = Engine(model, max_seqs=2)
    with pytest.raises(GrammarError, match="JSON schema cannot be used"):
        engine.submit([1, 2, 3], _params(0.0, 1, GrammarSpec.json_schema({"type": "nope"})))


@pytest.fixture(scope="module")
def client(model):
    """A server driven by the openai client (the dev extra; the engine's tests above run
    without it, as on the GPU machine)."""
    import openai

    from .test_server import Running

    server = Running(model, max_seqs=8)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    server.stop()


def test_the_openai_client_gets_json_of_its_schema(client):
    import pydantic

    class Reply(pydantic.BaseModel):
        answer: Literal["yes", "no"]
        count: int = pydantic.Field(ge=0, le=9)
        name: str = pydantic.Field(max_length=6)

    messages = [{"role": "user", "content": "Hello there"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA,
                                                  "strict": True}}
    answer = client.chat.completions.create(model=NAME, messages=messages,
                                            response_format=fmt, max_tokens=60)
    assert answer.choices[0].finish_reason == "stop"
    value = _valid(answer.choices[0].message.content)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=NAME, messages=messages, response_format=fmt, max_tokens=60, stream=True)
        if c.choices)
    assert json.loads(streamed) == value
    # the client's parse helper: a pydantic model in, an instance of it out
    parsed = client.chat.completions.parse(model=NAME, messages=messages, response_format=Reply,
                                           max_tokens=60, temperature=0.8, seed=5)
    reply = parsed.choices[0].message.parsed
    assert isinstance(reply, Reply) and reply.answer in ("yes", "no")
    # completions take it too (as vLLM's do), and json_object asks for any object
    text = client.completions.create(model=NAME, prompt="Hi", max_tokens=60,
                                     extra_body={"response_format": fmt}).choices[0].text
    _valid(text)
    obj = client.chat.completions.create(model=NAME, messages=messages, max_tokens=40,
                                         response_format={"type": "json_object"})
    content = obj.choices[0].message.content
    assert content.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_bad_response_formats_are_400s(client):
    import openai

    messages = [{"role": "user", "content": "Hi"}]
    for fmt, message in [({"type": "xml"}, "response_format must be"),
                         ({"type": "json_schema"}, "needs"),
                         ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
                             "type": "nope"}}}, "JSON schema cannot be used")]:
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(model=NAME, messages=messages, response_format=fmt)


def test_vllms_structured_outputs(client):
    """vLLM's extensions, as its clients send them in extra_body: ``structured_outputs``
    with a choice, a regular expression or a schema, and the older ``guided_*`` names;
    one kind at a time."""
    import openai

    ask = dict(model=NAME, messages=[{"role": "user", "content": "Hello there"}],
               max_tokens=40, temperature=1.0, seed=7)
    for extra in ({"structured_outputs": {"choice": ["red pill", "blue pill"]}},
                  {"guided_choice": ["red pill", "blue pill"]}):
        choice = client.chat.completions.create(**ask, extra_body=extra).choices[0]
        assert choice.message.content in ("red pill", "blue pill")
        assert choice.finish_reason == "stop"
    for extra in ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
                  {"guided_regex": "[0-9]{3}-[a-z]{2}"}):
        text = client.completions.create(model=NAME, prompt="Tokens", max_tokens=20,
                                         extra_body=extra).choices[0].text
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()
    for extra in ({"structured_outputs": {"json": SCHEMA}}, {"guided_json": json.dumps(SCHEMA)}):
        ask["max_tokens"] = 60
        _valid(client.chat.completions.create(**ask, extra_body=extra).choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="one kind of structured output"):
        client.chat.completions.create(**ask, response_format={"type": "json_object"},
                                       extra_body={"guided_choice": ["a"]})
    with pytest.raises(openai.BadRequestError, match="list of strings"):
        client.chat.completions.create(**ask, extra_body={"guided_choice": []})
