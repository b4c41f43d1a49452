"""Anthropic's Messages API (``POST /v1/messages``) through the official ``anthropic``
client: text answers equal chat's for the same conversation, whole and streamed (the
client's stream helper rebuilds the message), a thinking model's thinking and tool_use
blocks, the tool's result sent back as a tool_result block, the key as x-api-key, and
errors in the API's shape."""

from __future__ import annotations

import json

import anthropic
import pytest

from . import tool_model

KEY = "test-key"
TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
          "input_schema": t["function"]["parameters"]} for t in tool_model.TOOLS]


def _serve(model, name):
    from .test_server import Running

    server = Running(model, name=name, api_key=KEY, max_seqs=4)
    return server, anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def served(model):
    server, client = _serve(model, "tiny")
    yield server, client
    server.stop()


def test_text_answers_are_chats(served):
    import openai

    server, client = served
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY).chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hello there"}],
        max_tokens=8, temperature=0)
    # the client takes no temperature now (Anthropic's models fix it): sent as an extra
    ask = dict(model="tiny", system="Be brief.", max_tokens=8, extra_body={"temperature": 0},
               messages=[{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}])
    m = client.messages.create(**ask)
    assert m.content[0].type == "text" and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 8
    assert m.usage.input_tokens == chat.usage.prompt_tokens
    with client.messages.stream(**ask) as stream:
        text = stream.get_final_text()
        final = stream.get_final_message()
    assert text == m.content[0].text and final.stop_reason == "max_tokens"
    counted = client.messages.count_tokens(model="tiny", system="Be brief.",
                                           messages=ask["messages"])
    assert counted.input_tokens == m.usage.input_tokens
    # a stop sequence: the reason and which one (a piece of the answer's text)
    whole = m.content[0].text
    assert len(whole) >= 6
    stop = whole[3:6]
    cut = client.messages.create(**{**ask, "max_tokens": 16}, stop_sequences=["zzzz", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == whole.split(stop)[0]


def test_errors_in_the_apis_shape(served):
    server, client = served
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}]}])
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model="tiny", max_tokens=4,
                              messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    import httpx  # max_tokens is required (the client itself requires it too)

    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_thinking_tool_loop(thinker):
    server, client = _serve(thinker, "t")
    try:
        ask = dict(model="t", max_tokens=200, extra_body={"temperature": 0}, tools=TOOLS)
        question = [{"role": "user", "content": tool_model.QUESTION[0]["content"]}]
        m = client.messages.create(messages=question, **ask)
        assert [b.type for b in m.content] == ["thinking", "tool_use"]
        assert m.content[0].thinking == "The user wants the weather: I call the tool."
        use = m.content[1]
        assert use.name == "get_weather" and use.input == tool_model.ARGUMENTS
        assert m.stop_reason == "tool_use"
        follow = question + [
            {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": tool_model.RESULT}]}]
        answer = client.messages.create(messages=follow, **ask)
        assert [b.type for b in answer.content] == ["thinking", "text"]
        assert answer.content[1].text == tool_model.ANSWER and answer.stop_reason == "end_turn"
        with client.messages.stream(messages=question, **ask) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "tool_use"]
        assert final.content[1].input == tool_model.ARGUMENTS
        assert json.dumps(final.content[1].input) == json.dumps(use.input)
    finally:
        server.stop()
