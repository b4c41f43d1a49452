"""Tool calling (OpenAI's ``tools``): the functions a chat request offers go into the prompt
through the model's chat template, and the answer is read back for calls in the format the
model was trained to write them in.

Three formats, as vLLM names its parsers:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block a call,
  after any text (Qwen 2.5 and 3, Hermes, and most templates that say ``<tool_call>``);
- ``llama3_json``: the whole answer is a JSON object ``{"name": ..., "parameters": {...}}``
  (or several joined by ``;``), as Llama 3.1-3.3's templates ask for custom tools;
- ``mistral``: the ``[TOOL_CALLS]`` control token, then a JSON list of ``{"name",
  "arguments"}`` (v3 tokenizers) or ``name[ARGS]{...}`` per call (v11 and later).

``parser_for`` picks the format from the chat template's text (``needle serve
--tool-call-parser`` overrides it). With ``tool_choice`` "auto" the model is asked, not
forced, and an answer whose calls do not parse as JSON is returned as plain content, as
vLLM does: a call the client cannot execute is not invented. ``tool_choice`` "required" or
a named function forces one call: the answer is constrained (``grammar.py``) to the
format's call of one of the functions (or that one), its arguments to the function's
JSON schema (hermes and Llama 3 JSON; Mistral's is refused).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .api_error import bad
from .grammar import JSON_STYLE, GrammarSpec
from .marks import partial_suffix

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: the function's name, its arguments as JSON text (an
    object, as OpenAI sends them) and the id the tool's answer refers back to."""

    name: str
    arguments: str
    id: str

    def as_openai(self, index: int | None = None) -> dict:
        """OpenAI's ``tool_calls`` entry (with ``index``: a stream's delta)."""
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolAnswer:
    """An answer read for calls: the text before them (None where there is none) and the
    calls."""

    content: str | None
    calls: list[ToolCall]


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asked of tools: the OpenAI tool objects (for the template),
    whether the answer is read for calls (``tool_choice`` "auto", "required" or a named
    function; "none" leaves them out of the prompt), whether more than one call may be
    returned, and the tools one of which the answer must call ("required": all; a named
    function: it; None: the model chooses)."""

    tools: list[dict]
    parse: bool
    parallel: bool
    forced: list[dict] | None = None


# --- the request ------------------------------------------------------------------------------
def tool_request(body: dict, parser: ToolCallParser | None) -> ToolRequest | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked (None:
    no tools). A 400 for what needle cannot do: ``functions`` (OpenAI's older form), a
    ``tool_choice`` naming no offered function, or tools for a model whose template has no
    tool-call format needle reads."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise bad("functions and function_call are OpenAI's deprecated form: send tools "
                  "(and tool_choice) instead", "functions")
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad("tools must be a list of {\"type\": \"function\", \"function\": {...}} "
                  "objects", "tools")
    checked = [tool(t, i) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise bad(f"tools names a function twice: {names}", "tools")
    choice = "auto" if choice is None else choice
    forced = _forced(choice, checked)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if choice != "none" and parser is None:
        raise bad("this model's chat template has no tool-call format needle reads (hermes "
                  "<tool_call>, Llama 3 JSON or Mistral [TOOL_CALLS]); start the server with "
                  "--tool-call-parser to name one, or send tool_choice \"none\"", "tools")
    return ToolRequest(checked, choice != "none", parallel, forced)


def _forced(choice, tools: list[dict]) -> list[dict] | None:
    """The tools ``tool_choice`` makes the answer call one of (None: "auto" or "none")."""
    if choice in ("auto", "none"):
        return None
    if choice == "required":
        return tools
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if name is None:
        raise bad("tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": "
                  "\"function\", \"function\": {\"name\": ...}}", "tool_choice")
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise bad(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return named


def tool(given, i: int) -> dict:
    """One tool object checked (``tools[i]``): a function with a name and (optionally) a
    description and JSON-schema parameters, rebuilt from those fields only."""
    where = f"tools[{i}]"
    if not isinstance(given, dict) or given.get("type") != "function" or \
            not isinstance(given.get("function"), dict):
        raise bad(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                  "\"parameters\": {...}}}}", "tools")
    fn = given["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise bad(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', got "
                  f"{name!r}", "tools")
    out = {"name": name}
    if fn.get("description") is not None:
        if not isinstance(fn["description"], str):
            raise bad(f"{where}.function.description must be a string", "tools")
        out["description"] = fn["description"]
    if fn.get("parameters") is not None:
        if not isinstance(fn["parameters"], dict):
            raise bad(f"{where}.function.parameters must be a JSON schema object", "tools")
        out["parameters"] = fn["parameters"]
    if fn.get("strict") is not None:
        out["strict"] = fn["strict"]
    return {"type": "function", "function": out}


def template_message(message: dict, i: int) -> dict:
    """The tool fields of an OpenAI message as chat templates read them (transformers'
    convention, which vLLM follows): an assistant's ``tool_calls`` with each call's
    ``arguments`` as an object, not JSON text; a tool message's ``tool_call_id`` and
    ``name``."""
    out = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise bad(f"messages[{i}].tool_calls must be a list, on an assistant message",
                      "messages")
        out["tool_calls"] = [_call_for_template(c, i, j) for j, c in enumerate(calls)]
    if message.get("role") == "tool":
        for name in ("tool_call_id", "name"):
            value = message.get(name)
            if value is not None:
                if not isinstance(value, str):
                    raise bad(f"messages[{i}].{name} must be a string", "messages")
                out[name] = value
    return out


def _call_for_template(call, i: int, j: int) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                  "\"arguments\"}}}}", "messages")
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise bad(f"{where}.function.arguments is not valid JSON: {e}", "messages") \
                from None
    if not isinstance(arguments, dict):
        raise bad(f"{where}.function.arguments must be a JSON object", "messages")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


# --- the answer ---------------------------------------------------------------------------------
class ToolCallParser:
    """One model family's way of writing calls. ``read`` takes a finished answer (its text,
    special tokens left out as the client sees it, and its token ids); ``streamable`` says
    how much of an unfinished answer's text is surely content, so a stream sends that and
    holds back what may be the start of a call."""

    name = ""

    def read(self, text: str, tokens: list[int], tokenizer) -> ToolAnswer | None:
        raise NotImplementedError

    def streamable(self, text: str, tokens: list[int], tokenizer) -> int:
        raise NotImplementedError

    def forced_call(self, tools: list[dict], tokenizer) -> GrammarSpec | None:
        """A grammar of one call, in this format, of one of ``tools`` with arguments of its
        schema (None: this format cannot be forced)."""
        return None

    @staticmethod
    def new_id() -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def _calls(self, objects: list, arguments_keys: tuple[str, ...]) -> list[ToolCall] | None:
        """ToolCalls of decoded JSON objects, each a name and an arguments object under one
        of ``arguments_keys``; None if any is not."""
        calls = []
        for obj in objects:
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return None
            args = next((obj[k] for k in arguments_keys if k in obj), {})
            if isinstance(args, str):  # some models write the arguments as JSON text
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False),
                                  self.new_id()))
        return calls or None


class HermesParser(ToolCallParser):
    name = "hermes"

    def read(self, text, tokens, tokenizer):
        at = text.find(HERMES_START)
        if at < 0:
            return None
        objects = []
        for block in text[at:].split(HERMES_START)[1:]:
            body = block.split(HERMES_END, 1)[0].strip()  # the last end tag may be missing
            try:
                objects.append(json.loads(body))
            except json.JSONDecodeError:
                return None
        calls = self._calls(objects, ("arguments", "parameters"))
        if calls is None:
            return None
        return ToolAnswer(text[:at].strip() or None, calls)

    def streamable(self, text, tokens, tokenizer):
        at = text.find(HERMES_START)
        if at >= 0:
            return at
        return len(text) - partial_suffix(text, HERMES_START)

    def forced_call(self, tools, tokenizer):
        call = _call_schema(tools, "arguments")
        open_, close = (_lark_marker(tokenizer, m) for m in (HERMES_START, HERMES_END))
        return GrammarSpec("lark", f'start: {open_} "\\n" call "\\n" {close}\n'
                                   f"call: %json {json.dumps(call)}")


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"

    def read(self, text, tokens, tokenizer):
        rest = text.strip().removeprefix("<|python_tag|>").lstrip()
        if not rest.startswith("{"):
            return None
        decoder, objects = json.JSONDecoder(), []
        while rest:
            try:
                obj, end = decoder.raw_decode(rest)
            except json.JSONDecodeError:
                return None
            objects.append(obj)
            rest = rest[end:].lstrip().removeprefix(";").lstrip()
        calls = self._calls(objects, ("parameters", "arguments"))
        return None if calls is None else ToolAnswer(None, calls)

    def streamable(self, text, tokens, tokenizer):
        start = text.lstrip()
        if not start or start[0] in "{<":  # a call, or its python tag, may be coming
            return 0
        return len(text)

    def forced_call(self, tools, tokenizer):
        call = _call_schema(tools, "parameters")
        return GrammarSpec("lark", f"start: %json {json.dumps(call)}")


class MistralParser(ToolCallParser):
    name = "mistral"

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex[:9]  # Mistral's templates accept 9-character ids only

    def read(self, text, tokens, tokenizer):
        at = _token_at(tokens, tokenizer, MISTRAL_CALLS)
        if at is None:
            return None
        tail = tokenizer.decode(tokens[at:], skip_special_tokens=False)
        for end in (tokenizer.special_tokens or {}).values():
            if isinstance(end, str) and end and end != MISTRAL_CALLS and tail.endswith(end):
                tail = tail[:-len(end)]
        parts = [p.strip() for p in tail.split(MISTRAL_CALLS) if p.strip()]
        objects = []
        for part in parts:
            if MISTRAL_ARGS in part:  # v11: name[ARGS]{...}
                name, args = part.split(MISTRAL_ARGS, 1)
                try:
                    objects.append({"name": name.strip(), "arguments": json.loads(args)})
                except json.JSONDecodeError:
                    return None
                continue
            try:  # v3: a JSON list of calls
                listed = json.loads(part)
            except json.JSONDecodeError:
                return None
            objects.extend(listed if isinstance(listed, list) else [listed])
        calls = self._calls(objects, ("arguments", "parameters"))
        if calls is None:
            return None
        content = tokenizer.decode(tokens[:at]).strip()
        return ToolAnswer(content or None, calls)

    def streamable(self, text, tokens, tokenizer):
        at = _token_at(tokens, tokenizer, MISTRAL_CALLS)
        return len(text) if at is None else min(len(text), len(tokenizer.decode(tokens[:at])))


class CallsReader:
    """One request's answers read for tool calls by ``parser`` (None: not read, every
    answer is content); without ``parallel`` an answer keeps its first call only."""

    def __init__(self, parser: ToolCallParser | None, tokenizer, parallel: bool = True):
        self.parser, self.tokenizer, self.parallel = parser, tokenizer, parallel

    def read(self, text: str, tokens: list[int]) -> ToolAnswer | None:
        if self.parser is None:
            return None
        answer = self.parser.read(text, list(tokens), self.tokenizer)
        if answer is not None and not self.parallel:
            answer = ToolAnswer(answer.content, answer.calls[:1])
        return answer

    def content_and_calls(self, request, text: str | None = None
                          ) -> tuple[str | None, list[ToolCall]]:
        """A finished request's message: its text (or ``text``, its answer past its
        thinking) and no calls, or the text before its calls and the calls."""
        text = request.text if text is None else text
        answer = self.read(text, request.output)
        return (text, []) if answer is None else (answer.content, answer.calls)

    def streamable(self, text: str, tokens: list[int]) -> int:
        """How much of an unfinished answer's text a stream may send as content."""
        if self.parser is None:
            return len(text)
        return self.parser.streamable(text, list(tokens), self.tokenizer)


PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for(name: str, tokenizer) -> ToolCallParser | None:
    """The parser ``name`` names ("auto": the one the tokenizer's chat template implies;
    "none": none), or None where the model has no template that renders tools."""
    if name == "none" or tokenizer is None:
        return None
    if name != "auto":
        return PARSERS[name]()
    source = tokenizer.template_text()
    if "tools" not in source:
        return None
    if HERMES_START in source:
        return HermesParser()
    if MISTRAL_CALLS in source:
        return MistralParser()
    if "<|python_tag|>" in source or ("parameters" in source and "ipython" in source):
        return Llama3JsonParser()
    return None


def _call_schema(tools: list[dict], arguments_key: str) -> dict:
    """The JSON schema of one call of one of ``tools``: its name, and its arguments under
    ``arguments_key`` following the function's parameters (any object where it has none),
    in json.dumps' separators."""
    calls = [{"type": "object", "additionalProperties": False,
              "required": ["name", arguments_key],
              "properties": {"name": {"const": t["function"]["name"]},
                             arguments_key: t["function"].get("parameters")
                             or {"type": "object"}}} for t in tools]
    return {"anyOf": calls, "x-guidance": JSON_STYLE}


def _lark_marker(tokenizer, marker: str) -> str:
    """``marker`` in a Lark grammar: the token itself where the vocabulary has it as one
    (llguidance matches added tokens only as tokens), else its text."""
    if tokenizer is not None and tokenizer.token_id(marker) is not None:
        return marker
    return json.dumps(marker)


def _token_at(tokens: list[int], tokenizer, token: str) -> int | None:
    """Where ``token`` (a control token's text) first occurs in ``tokens``."""
    tid = tokenizer.token_id(token)
    if tid is None:
        return None
    try:
        return list(tokens).index(tid)
    except ValueError:
        return None
