"""Anthropic's Messages API (``POST /v1/messages``, what the ``anthropic`` client and the
tools built on it send): a request is read as the chat request it amounts to, and the chat
answer is written back as a message's content blocks.

``system`` (a string or text blocks), ``messages`` (text blocks; an assistant's
``tool_use`` blocks become its tool calls, a user's ``tool_result`` blocks tool messages;
``thinking`` blocks are dropped, as chat templates drop earlier thinking), ``tools``
(``input_schema`` is the function's parameters), ``tool_choice`` (auto, any, tool, none),
``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` and ``thinking``
(disabled: Qwen3's ``enable_thinking: false``) map onto chat's fields. The answer is a
``thinking`` block where the model thought, a ``text`` block and a ``tool_use`` block a
call; ``stop_reason`` is ``end_turn``, ``max_tokens``, ``stop_sequence`` (with the
``stop_sequence`` that ended it) or ``tool_use``. ``POST /v1/messages/count_tokens`` gives
the prompt's ``input_tokens``. Errors have the
API's shape (``{"type": "error", "error": {"type", "message"}}``); the key may come as
``x-api-key``. Images and documents are refused.
"""

from __future__ import annotations

import json
import uuid

from .api_error import ApiError, bad

# Anthropic's error types by HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error"}


def error_body(e: ApiError) -> dict:
    return {"type": "error",
            "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def chat_body(body: dict, counting: bool = False) -> dict:
    """The chat completions body a Messages request amounts to (400 for what needle does
    not do); ``counting``: a count_tokens request, which has no max_tokens."""
    if counting:
        body = {**body, "max_tokens": 1}
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise bad("max_tokens is required: the most tokens to generate", "max_tokens")
    messages = _system(body.get("system"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list", "messages")
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"messages[{i}] needs a role of user or assistant", "messages")
        messages += _message(m, i)
    chat = {"messages": messages, "max_tokens": body["max_tokens"]}
    if body.get("tools"):
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
        if isinstance(body["tool_choice"], dict) and \
                body["tool_choice"].get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        chat["reasoning_effort"] = "none"
    for ours, theirs in (("stop_sequences", "stop"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("top_k", "top_k"), ("stream", "stream")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    return chat


def _system(system) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, list):
        system = "".join(_text_of(b, "system") for b in system)
    if not isinstance(system, str):
        raise bad("system must be a string or a list of text blocks", "system")
    return [{"role": "system", "content": system}]


def _text_of(block, where: str) -> str:
    if isinstance(block, dict) and block.get("type") == "text" and \
            isinstance(block.get("text"), str):
        return block["text"]
    kind = block.get("type") if isinstance(block, dict) else type(block).__name__
    raise bad(f"{where} holds a {kind!r} block; needle reads text (images and documents "
              "are not supported)", "messages")


def _message(m: dict, i: int) -> list[dict]:
    """One Messages message as chat messages: tool results first (one tool message each),
    then the text, with an assistant's tool_use blocks as its tool calls."""
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise bad(f"messages[{i}].content must be a string or a list of blocks", "messages")
    out, text, calls = [], [], []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            result = block.get("content")
            if isinstance(result, list):
                result = "".join(_text_of(b, f"messages[{i}]") for b in result)
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                        "content": result if isinstance(result, str) else json.dumps(result)})
        elif kind == "tool_use" and m["role"] == "assistant":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            text.append(_text_of(block, f"messages[{i}]"))
    if text or calls:
        message = {"role": m["role"], "content": "".join(text) or None}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _tool(tool, i: int) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or \
            tool.get("type") not in (None, "custom"):
        raise bad(f"tools[{i}] must be a custom tool {{\"name\", \"description\", "
                  "\"input_schema\"}: needle runs no server tools", "tools")
    function = {"name": tool["name"], "parameters": tool.get("input_schema")
                or {"type": "object"}}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice):
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    raise bad("tool_choice must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}",
              "tool_choice")


# --- the message --------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def thinking_block(text: str) -> dict:
    # needle's thinking is plain text: no signature to verify, an empty one
    return {"type": "thinking", "thinking": text, "signature": ""}


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def tool_use_block(call) -> dict:
    """A tools.ToolCall as a tool_use block."""
    return {"type": "tool_use", "id": call.id, "name": call.name,
            "input": json.loads(call.arguments)}


def content_blocks(thought: str | None, content: str | None, calls) -> list[dict]:
    blocks = [thinking_block(thought)] if thought else []
    if content or not calls:
        blocks.append(text_block(content or ""))
    return blocks + [tool_use_block(c) for c in calls]


def stop_reason(request, calls) -> str:
    if calls:
        return "tool_use"
    if request.stopped_by is not None:
        return "stop_sequence"
    return "max_tokens" if request.finish_reason == "length" else "end_turn"


def usage(request, output: bool = True) -> dict:
    return {"input_tokens": len(request.prompt), "cache_read_input_tokens":
            request.cached_tokens, "output_tokens": len(request.output) if output else 0}


def message(mid: str, model: str, request, blocks: list[dict], reason: str | None) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": reason,
            "stop_sequence": request.stopped_by if reason is not None else None,
            "usage": usage(request, reason is not None)}
