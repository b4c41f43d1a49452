"""OpenAI's Responses API (``POST /v1/responses``, what ``client.responses.create`` sends):
a request is read as the chat request it amounts to, and the chat answer is written back
as a response's output items.

``input`` (a string, or items: messages of any role with text parts, ``function_call``
items the model made earlier and ``function_call_output`` items with their results),
``instructions`` (a system message first), function ``tools`` (flat, as this API has them)
and ``tool_choice``, ``text.format`` (json_object / json_schema: structured output),
``max_output_tokens``, ``temperature``, ``top_p``, ``parallel_tool_calls``,
``reasoning.effort`` and ``metadata`` map onto chat's fields, so templates, tool calls,
reasoning, grammars and sampling are chat's. needle keeps no responses:
``previous_response_id`` is refused (send the conversation in ``input``), and so are tools
other than functions, ``include`` and image inputs. The output is a ``reasoning`` item
where the model thought, a ``message`` item with the text, and a ``function_call`` item a
call; a response cut at ``max_output_tokens`` is ``incomplete``. Streamed, the events are the API's:
``response.created``, ``response.in_progress``, each item's ``output_item.added``, its text
or arguments as deltas and its ``done`` events, then ``response.completed`` (or
``response.incomplete``) with the whole response, every event numbered.
"""

from __future__ import annotations

import json
import time
import uuid

from .api_error import bad

# fields of the request that the response repeats
_ECHOED = ("instructions", "max_output_tokens", "temperature", "top_p", "metadata")


def chat_body(body: dict) -> dict:
    """The chat completions body a Responses request amounts to (400 for what needle does
    not do)."""
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        raise bad("needle does not store responses: send the whole conversation in input "
                  "(previous_response_id and conversation are not supported)",
                  "previous_response_id")
    if body.get("include"):
        raise bad("include is not supported", "include")
    if body.get("truncation") not in (None, "disabled"):
        raise bad("truncation must be \"disabled\" (a prompt too long is an error)",
                  "truncation")
    chat = {"messages": _messages(body)}
    if body.get("tools"):
        chat["tools"] = [_tool(t, i) for i, t in enumerate(_list(body, "tools"))]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) \
        else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    elif fmt is not None:
        chat["response_format"] = fmt
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"),
                         ("stream", "stream")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    return chat


def _list(body: dict, name: str) -> list:
    value = body.get(name)
    if not isinstance(value, list):
        raise bad(f"{name} must be a list", name)
    return value


def _messages(body: dict) -> list[dict]:
    """``instructions`` and ``input`` as chat messages: function calls the model made
    become an assistant message's tool_calls, their outputs tool messages."""
    out = []
    if body.get("instructions"):
        if not isinstance(body["instructions"], str):
            raise bad("instructions must be a string", "instructions")
        out.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("input must be a non-empty string or a list of items", "input")
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and "role" in item:
            out.append({"role": item["role"], "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":  # earlier thinking: chat templates drop it too
            continue
        else:
            raise bad(f"input[{i}] is a {kind!r} item; needle reads messages, function_call "
                      "and function_call_output items", "input")
    return out


def _text(content, i: int):
    """A message's content as chat takes it: a string, or text parts (input_text and
    output_text are both text)."""
    if isinstance(content, str) or content is None:
        return content
    if isinstance(content, list):
        return [{"type": "text", "text": p.get("text")}
                if isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                else p for p in content]
    raise bad(f"input[{i}].content must be a string or a list of parts", "input")


def _tool(tool, i: int) -> dict:
    """A Responses function tool (flat) as a chat tool."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise bad(f"tools[{i}] is a {kind!r} tool; needle runs function tools only", "tools")
    return {"type": "function", "function": {k: tool[k] for k in (
        "name", "description", "parameters", "strict") if tool.get(k) is not None}}


# --- the response -------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def call_item(call, item_id: str | None = None) -> dict:
    """A tools.ToolCall as a function_call item."""
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": "completed"}


def output_items(thought: str | None, content: str | None, calls) -> list[dict]:
    """A finished answer's items: its thinking, its text (unless it is calls alone), its
    calls."""
    items = [reasoning_item(thought)] if thought else []
    if content or not calls:
        items.append(message_item(content or ""))
    return items + [call_item(c) for c in calls]


def response(rid: str, model: str, body: dict, output: list[dict], request,
             status: str | None = None) -> dict:
    """The response object (``request``: the engine's Request, for usage and how it
    ended; None while in progress)."""
    out = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
           "status": status or _status(request), "error": None, "incomplete_details": None,
           "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
           "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
           "text": body.get("text") or {"format": {"type": "text"}}, "usage": None}
    out.update({k: body.get(k) for k in _ECHOED})
    out["metadata"] = body.get("metadata") or {}
    if request is not None:
        if out["status"] == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        prompt, made = len(request.prompt), len(request.output)
        out["usage"] = {"input_tokens": prompt,
                        "input_tokens_details": {"cached_tokens": request.cached_tokens},
                        "output_tokens": made, "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": prompt + made}
    return out


def _status(request) -> str:
    return "incomplete" if request.finish_reason == "length" else "completed"
