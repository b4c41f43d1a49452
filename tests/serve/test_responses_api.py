"""OpenAI's Responses API (``POST /v1/responses``) through the official ``openai`` client:
text answers equal chat's for the same conversation, whole and streamed (the client's own
stream helper rebuilds the response from the events), a reasoning model's thinking and
tool call as items, the tool's result sent back as a function_call_output item, JSON-schema
output (and the client's ``parse`` into a pydantic model), and the refusals."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest

from . import tool_model
from .test_structured_output import SCHEMA, _valid

KEY = "test-key"
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in tool_model.TOOLS]


def _serve(model, name):
    from .test_server import Running

    server = Running(model, name=name, api_key=KEY, max_seqs=4)
    return server, openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def served(model):
    server, client = _serve(model, "tiny")
    yield client
    server.stop()


def test_text_answers_are_chats(served):
    chat = served.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hello there"}],
        max_tokens=8, temperature=0)
    r = served.responses.create(model="tiny", instructions="Be brief.", input="Hello there",
                                max_output_tokens=8, temperature=0, metadata={"k": "v"})
    assert r.output_text == chat.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8 and r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.metadata == {"k": "v"} and r.output[0].type == "message"
    # the client's stream helper; a response cut at max_output_tokens ends, as OpenAI's
    # do, with response.incomplete (whose response the helper fills from the events)
    with served.responses.stream(model="tiny", instructions="Be brief.", input="Hello there",
                                 max_output_tokens=8, temperature=0) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete" and "response.output_text.delta" in kinds
    assert events[-1].response.output_text == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_json_schema_output(served):
    fmt = {"format": {"type": "json_schema", "name": "reply", "schema": SCHEMA}}
    r = served.responses.create(model="tiny", input="Hello there", text=fmt,
                                max_output_tokens=60)
    _valid(r.output_text)
    import pydantic

    class Reply(pydantic.BaseModel):
        answer: Literal["yes", "no"]
        count: int = pydantic.Field(ge=0, le=9)
        name: str = pydantic.Field(max_length=6)

    parsed = served.responses.parse(model="tiny", input="Hi", text_format=Reply,
                                    max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Reply)


def test_refusals(served):
    for extra, message in [({"previous_response_id": "resp_x"}, "does not store"),
                           ({"tools": [{"type": "web_search"}]}, "function tools only"),
                           ({"include": ["reasoning.encrypted_content"]}, "include")]:
        with pytest.raises(openai.BadRequestError, match=message):
            served.responses.create(model="tiny", input="Hi", **extra)


def test_a_thinking_tool_loop(thinker):
    server, client = _serve(thinker, "t")
    try:
        question = [{"role": "user", "content": tool_model.QUESTION[0]["content"]}]
        r = client.responses.create(model="t", input=question, tools=FLAT_TOOLS, temperature=0)
        kinds = [item.type for item in r.output]
        assert kinds == ["reasoning", "function_call"], kinds
        assert r.output[0].content[0].text == "The user wants the weather: I call the tool."
        call = r.output[1]
        assert call.name == "get_weather" and json.loads(call.arguments) == tool_model.ARGUMENTS
        # the call and its result sent back as items (the reasoning item too: it is dropped)
        follow = question + [item.model_dump(exclude_none=True) for item in r.output] + [
            {"type": "function_call_output", "call_id": call.call_id,
             "output": tool_model.RESULT}]
        answer = client.responses.create(model="t", input=follow, tools=FLAT_TOOLS,
                                         temperature=0)
        assert answer.output_text == tool_model.ANSWER
        assert [item.type for item in answer.output] == ["reasoning", "message"]
        with client.responses.stream(model="t", input=question, tools=FLAT_TOOLS,
                                     temperature=0) as stream:
            for _ in stream:
                pass
            final = stream.get_final_response()
        assert [item.type for item in final.output] == ["reasoning", "function_call"]
        assert final.output[1].arguments == call.arguments
    finally:
        server.stop()
