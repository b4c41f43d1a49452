"""A reasoning model's thinking as ``reasoning_content``: a tiny Llama trained in the test to
think before it calls a tool and before it answers (as Qwen3 does: ``<think>...</think>``
then the answer), served and driven by the official ``openai`` client, whole and streamed;
and the splitting on its own, including thinking the prompt opened (DeepSeek-R1's)."""

from __future__ import annotations

import json

from needle.serve import reasoning

from . import tool_model


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


def test_the_template_decides_and_the_prompt_may_open_it(thinker):
    tok = thinker.tokenizer
    assert isinstance(reasoning.parser_for("auto", tok), reasoning.ThinkParser)
    assert reasoning.parser_for("none", tok) is None
    p = reasoning.ThinkParser()
    assert p.opened_by(tok.encode("<|im_start|>assistant\n<think>\n"), tok)
    assert not p.opened_by(tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n"), tok)


def test_the_openai_client_gets_thinking_apart(thinker):
    import openai

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


def test_the_command_line_options(thinker_dir):
    """``needle serve --reasoning-parser none --tool-call-parser hermes`` as a process: the
    thinking stays in the content (before the call, which is still read); by default it is
    reasoning_content."""
    from .serve_job import NAME, ServeJob

    for options, thinking_apart in ((("--reasoning-parser", "none", "--tool-call-parser",
                                      "hermes"), False), ((), True)):
        job = ServeJob(thinker_dir, *options)
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
