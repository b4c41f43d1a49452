"""Tool calling through ``needle serve``: the official ``openai`` client offers a function,
gets the model's call back (whole and streamed), runs it and sends the result, and gets the
model's answer; the prompts are the ids transformers renders for the same conversation.
The formats' readers (hermes, Llama 3 JSON, Mistral) are also checked on their own."""

from __future__ import annotations

import json

import pytest
import tokenizers

from needle.serve import openai_api, tools

from . import tool_model

KEY = "test-key"


@pytest.fixture(scope="module")
def tool_client(tool_llm):
    """The model served, driven by the openai client (the dev extra; the other tests here
    run without it)."""
    import openai

    from .test_server import Running

    server = Running(tool_llm, name="tools", api_key=KEY, max_seqs=4)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    server.stop()


def test_prompts_with_tools_are_rendered_as_transformers_renders_them(tool_dir, tool_llm):
    reference = tool_model.reference_tokenizer(tool_dir)
    for messages in (tool_model.QUESTION, tool_model.conversation_after_call("call_7")):
        body = {"messages": messages, "tools": tool_model.TOOLS}
        ours = openai_api.parse_chat(body, tool_llm.tokenizer, tool_llm.generation_config,
                                     tools.HermesParser()).prompt
        assert ours == tool_model.transformers_prompt(reference, messages)
    # vLLM's /tokenize renders the tools too: the ids chat would prompt with
    from needle.serve import tokenize_api

    counted = tokenize_api.tokenize({"messages": tool_model.QUESTION, "tools": tool_model.TOOLS},
                                    tool_llm.tokenizer, 1024)
    assert counted["tokens"] == tool_model.transformers_prompt(reference, tool_model.QUESTION)
    # tool_choice "none": the tools stay out of the prompt and the answer is not read
    none = openai_api.parse_chat({"messages": tool_model.QUESTION, "tools": tool_model.TOOLS,
                                  "tool_choice": "none"}, tool_llm.tokenizer,
                                 tool_llm.generation_config, tools.HermesParser())
    assert none.tools is None
    assert none.prompt == reference.apply_chat_template(
        tool_model.QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_the_openai_client_runs_a_tool_loop(tool_client):
    answer = tool_client.chat.completions.create(
        model="tools", messages=tool_model.QUESTION, tools=tool_model.TOOLS, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == tool_model.ARGUMENTS
    assert call.id.startswith("call_")
    # the client runs the tool and sends back the call and its result
    messages = tool_model.QUESTION + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": tool_model.RESULT}]
    final = tool_client.chat.completions.create(
        model="tools", messages=messages, tools=tool_model.TOOLS, temperature=0)
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == tool_model.ANSWER
    assert final.choices[0].message.tool_calls is None


def test_a_streamed_tool_call_arrives_whole(tool_client):
    stream = tool_client.chat.completions.create(
        model="tools", messages=tool_model.QUESTION, tools=tool_model.TOOLS, temperature=0,
        stream=True, stream_options={"include_usage": True})
    content, calls, reasons, usage = "", {}, [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            content += c.delta.content or ""
            for call in c.delta.tool_calls or ():
                got = calls.setdefault(call.index, {"id": call.id, "name": "", "args": ""})
                got["name"] += call.function.name or ""
                got["args"] += call.function.arguments or ""
            if c.finish_reason is not None:
                reasons.append(c.finish_reason)
    assert content == "" and reasons == ["tool_calls"]
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["args"]) == tool_model.ARGUMENTS
    assert usage.completion_tokens > 10
    # the streamed answer of the second turn is the plain text
    text = "".join(c.choices[0].delta.content or "" for c in tool_client.chat.completions.create(
        model="tools", messages=tool_model.conversation_after_call(calls[0]["id"]),
        tools=tool_model.TOOLS, temperature=0, stream=True) if c.choices)
    assert text == tool_model.ANSWER


def test_tool_requests_needle_cannot_honour_are_refused(tool_client, tool_llm):
    import openai

    ask = dict(model="tools", messages=tool_model.QUESTION)
    cases = [({"tools": tool_model.TOOLS, "tool_choice": "always"}, "tool_choice must be"),
             ({"tools": tool_model.TOOLS, "tool_choice": {
                 "type": "function", "function": {"name": "get_time"}}}, "not among the tools"),
             ({"tools": tool_model.TOOLS, "tool_choice": "required",
               "response_format": {"type": "json_object"}}, "cannot be combined"),
             ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
              "letters, digits"),
             ({"tools": tool_model.TOOLS * 2}, "twice"),
             ({"tool_choice": "auto"}, "tool_choice needs tools"),
             ({"functions": [{"name": "f"}]}, "deprecated")]
    for extra, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            tool_client.chat.completions.create(**ask, **extra)
    bad_call = tool_model.QUESTION + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(openai.BadRequestError, match="not valid JSON"):
        tool_client.chat.completions.create(model="tools", messages=bad_call)
    # a model whose template has no tool-call format: tools refused, tool_choice none fine
    plain = tools.parser_for("auto", _chatml_only(tool_llm.tokenizer))
    assert plain is None
    with pytest.raises(openai_api.ApiError, match="no tool-call format"):
        openai_api.parse_chat({"messages": tool_model.QUESTION, "tools": tool_model.TOOLS},
                              tool_llm.tokenizer, tool_llm.generation_config, plain)


def _chatml_only(tokenizer):
    import copy

    other = copy.copy(tokenizer)
    other.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    return other


TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 5}},
    "required": ["zone"], "additionalProperties": False}}}


def test_a_forced_tool_choice_gets_one_call(tool_client):
    """tool_choice "required" or a named function on a question the model never saw: the
    answer is constrained to one hermes call of one of the tools (or the named one), its
    arguments of the function's schema; whole and streamed."""
    ask = dict(model="tools", messages=[{"role": "user", "content": "Tokens everywhere?"}],
               tools=tool_model.TOOLS + [TIME], temperature=0, max_tokens=100)
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}},
                           {"get_time"})):
        answer = tool_client.chat.completions.create(**ask, tool_choice=choice).choices[0]
        assert answer.finish_reason == "tool_calls", answer.message.content
        (call,) = answer.message.tool_calls
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_time":
            assert set(arguments) == {"zone"} and len(arguments["zone"]) <= 5
        else:
            assert isinstance(arguments["city"], str)
        streamed = [c.choices[0] for c in tool_client.chat.completions.create(
            **ask, tool_choice=choice, stream=True) if c.choices]
        deltas = [d for c in streamed for d in c.delta.tool_calls or ()]
        assert [d.function.name for d in deltas] == [call.function.name]
        assert json.loads(deltas[0].function.arguments) == arguments
        assert streamed[-1].finish_reason == "tool_calls"


def test_forced_call_grammars_of_each_format():
    """The hermes and Llama 3 JSON grammars of a forced call compile with llguidance and
    accept a call of a named tool (arguments of its schema) but not another tool's or a
    plain answer; Mistral's format cannot be forced."""
    import llguidance

    words = tokenizers.Tokenizer(tokenizers.models.BPE())
    words.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    words.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    words.train_from_iterator(["get_time zone UTC"], trainer)
    words.add_special_tokens(["</s>"])
    llt = llguidance.LLTokenizer(words.to_str(), eos_token=[words.token_to_id("</s>")])

    def accepts(spec, text: str) -> bool:
        m = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_lark(spec.source))
        ids = words.encode(text, add_special_tokens=False).ids
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    hermes = tools.HermesParser().forced_call([TIME], None)  # no <tool_call> token: text
    assert accepts(hermes, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
                           '\n</tool_call>')
    assert not accepts(hermes, '<tool_call>\n{"name": "get_weather", "arguments": '
                               '{"city": "x"}}\n</tool_call>')
    assert not accepts(hermes, "UTC")
    llama = tools.Llama3JsonParser().forced_call([TIME], None)
    assert accepts(llama, '{"name": "get_time", "parameters": {"zone": "UTC"}}')
    assert not accepts(llama, '{"name": "get_time", "parameters": {"zone": "too long"}}')
    assert tools.MistralParser().forced_call([TIME], _mistral_tokenizer()[0]) is None


# --- the formats' readers ---------------------------------------------------------------------
def _calls(answer):
    return [(c.name, json.loads(c.arguments)) for c in answer.calls]


def test_hermes_reader():
    p = tools.HermesParser()
    text = ('Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}')  # no end tag at EOS
    answer = p.read(text, [], None)
    assert answer.content == "Let me look."
    assert _calls(answer) == [("a", {"x": 1}), ("b", {"y": [2]})]
    assert p.read("no calls here", [], None) is None
    assert p.read('<tool_call>{"name": "a", "arguments": {', [], None) is None  # cut off
    assert p.read('<tool_call>{"arguments": {}}</tool_call>', [], None) is None  # no name
    # a stream holds back what may be the start of the tag, and everything from it on
    assert p.streamable("Hello <tool_", [], None) == len("Hello ")
    assert p.streamable("Hello <b>", [], None) == len("Hello <b>")
    assert p.streamable("Hi <tool_call>{", [], None) == len("Hi ")
    reader = tools.CallsReader(p, None, parallel=False)
    assert len(reader.read(text, []).calls) == 1


def test_llama3_json_reader():
    p = tools.Llama3JsonParser()
    answer = p.read(' {"name": "a", "parameters": {"x": "1"}}; {"name": "b", "parameters": '
                    '{}}', [], None)
    assert answer.content is None and _calls(answer) == [("a", {"x": "1"}), ("b", {})]
    assert _calls(p.read('<|python_tag|>{"name": "a", "arguments": {}}', [], None)) == [
        ("a", {})]
    assert p.read('{"answer": 42}', [], None) is None  # JSON, but not a call
    assert p.read("The answer is {x}.", [], None) is None
    assert p.streamable("  {", [], None) == 0
    assert p.streamable("Sure", [], None) == 4


def _mistral_tokenizer():
    """A word-level tokenizer with Mistral's control tokens (special, so decoding for the
    client drops them, as it does for a real Mistral tokenizer)."""
    from needle.models.tokenizer import Tokenizer

    words = ["Checking", "now", "get_weather", '{"city":', '"Paris"}', '[{"name":',
             '"get_weather",', '"arguments":', "}]"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="Checking"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(["</s>", "[TOOL_CALLS]", "[ARGS]"])
    out = Tokenizer(tok, special_tokens={"eos_token": "</s>"})
    return out, lambda text: tok.encode(text, add_special_tokens=False).ids


def test_mistral_reader():
    tok, encode = _mistral_tokenizer()
    p = tools.MistralParser()
    v3 = encode('Checking now [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
                '"Paris"} }] </s>')
    answer = p.read(tok.decode(v3), v3, tok)
    assert answer.content == "Checking now"
    assert _calls(answer) == [("get_weather", {"city": "Paris"})]
    assert len(answer.calls[0].id) == 9  # Mistral's templates check for 9 characters
    v11 = encode('[TOOL_CALLS] get_weather [ARGS] {"city": "Paris"} </s>')
    assert _calls(p.read(tok.decode(v11), v11, tok)) == [("get_weather", {"city": "Paris"})]
    plain = encode("Checking now")
    assert p.read(tok.decode(plain), plain, tok) is None
    assert p.streamable(tok.decode(v3), v3, tok) == len("Checking now")
