"""A reasoning model's thinking as ``reasoning_content``: a tiny Llama trained in the test to
think before it calls a tool and before it answers (as Qwen3 does: ``<think>...</think>``
then the answer), served and driven by the official ``openai`` client, whole and streamed;
and the splitting on its own, including thinking the prompt opened (DeepSeek-R1's)."""

from __future__ import annotations

import json

import pytest

from needle.serve import reasoning

from . import tool_model

THINK_CALL = "<think>\nThe user wants the weather: I call the tool.\n</think>\n\n"
THINK_ANSWER = "<think>\nThe tool says sunny.\n</think>\n\n"
# the tool model's template with Qwen3's switch: enable_thinking false closes an empty
# thinking in the prompt
TEMPLATE = tool_model.TEMPLATE.replace(
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}\n<think>\n\n</think>\n"
    "{% endif %}\n{% endif %}")


def test_the_split_of_each_form():
    p = reasoning.ThinkParser()
    assert p.split("<think>\nhmm\n</think>\n\nHi") == ("hmm", "Hi")
    assert p.split("hmm\n</think>\n\nHi", opened=True) == ("hmm", "Hi")  # the prompt opened it
    assert p.split("Hi") == ("", "Hi")  # no thinking
    assert p.split("<think>\ncut off") == ("cut off", "")  # max_tokens while thinking
    # streaming: nothing that may become a tag is sent as the wrong kind
    assert p.split("<thi", final=False) == ("", "")
    assert p.split("<think>\nhmm </th", final=False) == ("hmm ", "")
    assert p.split("<think>\nhmm\n", final=False) == ("hmm", "")  # the newline may end it
    assert p.split("Hello <", final=False) == ("", "Hello <")  # content: no tag can follow


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    from needle.models import load_pretrained

    directory = tmp_path_factory.mktemp("thinker")
    tool_model.build(directory, template=TEMPLATE,
                     answers=(THINK_CALL + tool_model.CALL, THINK_ANSWER + tool_model.ANSWER))
    return load_pretrained(directory, device="cpu", dtype="float32")


def test_the_template_decides_and_the_prompt_may_open_it(thinker):
    tok = thinker.tokenizer
    assert isinstance(reasoning.parser_for("auto", tok), reasoning.ThinkParser)
    assert reasoning.parser_for("none", tok) is None
    p = reasoning.ThinkParser()
    assert p.opened_by(tok.encode("<|im_start|>assistant\n<think>\n"), tok)
    assert not p.opened_by(tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n"), tok)


def test_the_openai_client_gets_thinking_apart(thinker):
    openai = pytest.importorskip("openai", reason="the openai client is in the dev extra")
    from .test_server import Running

    server = Running(thinker, name="thinker", max_seqs=4)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="test-key", max_retries=0)
        ask = dict(model="thinker", tools=tool_model.TOOLS, temperature=0)
        first = client.chat.completions.create(messages=tool_model.QUESTION, **ask).choices[0]
        assert first.message.model_extra["reasoning_content"] == \
            "The user wants the weather: I call the tool."
        assert first.finish_reason == "tool_calls" and first.message.content is None
        assert json.loads(first.message.tool_calls[0].function.arguments) == \
            tool_model.ARGUMENTS
        after = tool_model.conversation_after_call(first.message.tool_calls[0].id)
        second = client.chat.completions.create(messages=after, **ask).choices[0]
        assert second.message.model_extra["reasoning_content"] == "The tool says sunny."
        assert second.message.content == tool_model.ANSWER
        thought, content = "", ""
        for chunk in client.chat.completions.create(messages=after, stream=True, **ask):
            for c in chunk.choices:
                thought += (c.delta.model_extra or {}).get("reasoning_content") or ""
                content += c.delta.content or ""
        assert (thought, content) == ("The tool says sunny.", tool_model.ANSWER)
    finally:
        server.stop()


def test_the_command_line_options(tmp_path):
    """``needle serve --reasoning-parser none --tool-call-parser hermes`` as a process: the
    thinking stays in the content (before the call, which is still read); by default it is
    reasoning_content."""
    pytest.importorskip("openai", reason="the openai client is in the dev extra")
    from .serve_job import NAME, ServeJob

    tool_model.build(tmp_path, template=TEMPLATE,
                     answers=(THINK_CALL + tool_model.CALL, THINK_ANSWER + tool_model.ANSWER))
    for options, thinking_apart in ((("--reasoning-parser", "none", "--tool-call-parser",
                                      "hermes"), False), ((), True)):
        job = ServeJob(tmp_path, *options)
        try:
            message = job.client.chat.completions.create(
                model=NAME, messages=tool_model.QUESTION, tools=tool_model.TOOLS,
                temperature=0).choices[0].message
        finally:
            assert job.stop()[0] == 0
        assert message.tool_calls[0].function.name == "get_weather"
        thought = (message.model_extra or {}).get("reasoning_content")
        if thinking_apart:
            assert thought and message.content is None
        else:
            assert thought is None and message.content.startswith("<think>")
