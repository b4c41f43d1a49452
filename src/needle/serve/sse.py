"""A streamed answer as server-sent events: a chunk per piece of text of each choice (its
``index``: n answers of a prompt, or a list of prompts), each choice's finish reason, the
usage if asked, then ``data: [DONE]``.

The engine's events of every choice arrive on one queue as (choice, event); a choice's
logprobs ride with the chunk that carries their tokens' text (text held back at a possible
stop string keeps its logprobs waiting). With ``echo`` a choice's first chunk is its prompt
(and the prompt's logprobs), sent when its first event comes: by then the prompt is read.
A reasoning model's thinking goes out as ``reasoning_content`` deltas (reasoning.py), its
answer as content. A chat answer read for tool calls sends its text as content until a
call may be starting (the parser says how far); at the end its calls go out a delta each,
whole, then the finish reason "tool_calls" (or, where no call parses, the held text as
content).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from . import openai_api as api
from .answer import AnswerReader
from .request import Request, TokenEvent
from .tools import CallsReader


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Choice:
    """One choice's stream: its request, logprobs not yet sent, characters sent so far."""

    def __init__(self, index: int, request: Request, echo, reader: AnswerReader):
        self.index, self.request, self.echo = index, request, echo
        self.pending: list = []
        self.offset = 0
        self.done = False
        self.reader = reader  # its thinking and tool calls, where the answer is read for them


class Stream:
    """The events of ``requests`` (choice i is requests[i]) as SSE text."""

    def __init__(self, requests: list[Request], prompts: list, n: int, rid: str, model: str,
                 chat: bool, tokenizer, echo: bool, calls: CallsReader | None = None,
                 reasoning=None):
        reasoning = reasoning if chat else None  # reasoning.ThinkParser, or None
        self.choices = [_Choice(i, r, prompts[i] if echo else None,
                                AnswerReader(r, tokenizer, reasoning, calls))
                        for i, r in enumerate(requests)]
        self.n, self.rid, self.model, self.chat, self.tokenizer = n, rid, model, chat, tokenizer
        self.read = reasoning is not None or (calls is not None and calls.parser is not None)

    async def events(self, queue: asyncio.Queue, include_usage: bool) -> AsyncIterator[str]:
        if self.chat:
            for c in self.choices:
                yield sse(api.chat_chunk(self.rid, self.model,
                                         {"role": "assistant", "content": ""}, None,
                                         index=c.index))
        left = len(self.choices)
        while left:
            i, event = await queue.get()
            c = self.choices[i]
            if c.done:
                continue
            if c.echo is not None:
                yield self._echo(c)
            if event.finish_reason == "error":  # the whole answer fails
                yield sse(api.ApiError(500, f"generation failed: {event.error}",
                                       kind="server_error").body())
                return
            for chunk in self._chunks(c, event):
                yield chunk
            if event.finish_reason is not None:
                c.done, left = True, left - 1
        if include_usage:
            u = api.choices_usage([c.request for c in self.choices], self.n)
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            yield sse(api.usage_chunk(self.rid, self.model, kind, u))
        yield "data: [DONE]\n\n"

    def _echo(self, c: _Choice) -> str:
        r, lp = c.request, None
        if r.params.logprobs is not None:
            lp = api.completion_logprobs([], self.tokenizer, 0, r.prompt, r.prompt_logprobs)
            c.offset = sum(len(t) for t in lp["tokens"])
        text = api.prompt_text(c.echo, r.prompt, self.tokenizer)
        c.echo = None
        return sse(api.completion_chunk(self.rid, self.model, text, None, lp, c.index))

    def _chunks(self, c: _Choice, event: TokenEvent):
        if event.logprob is not None:
            c.pending.append(event.logprob)
        reason = api.finish_reason(event.finish_reason)
        if self.read:
            yield from self._read_chunks(c, event.text, reason)
            return
        if event.text:
            yield self._chunk(c, event.text, None, self._logprobs(c))
        if reason is not None:
            yield self._chunk(c, "", reason, self._logprobs(c) if c.pending else None)

    def _read_chunks(self, c: _Choice, text: str, reason):
        """A chat answer read for its thinking (``reasoning_content`` deltas, then the
        answer as content) and/or for tool calls (content as far as it surely is content;
        at the end the calls, or the rest as content where none parses)."""
        final = reason is not None
        thought, content, calls = c.reader.push(text, final)
        if thought:
            yield sse(api.chat_chunk(self.rid, self.model, {"reasoning_content": thought},
                                     None, index=c.index))
        if content:
            yield self._chunk(c, content, None, self._logprobs(c))
        if not final:
            return
        if calls is not None:
            for k, call in enumerate(calls.calls):
                yield sse(api.chat_chunk(self.rid, self.model,
                                         {"tool_calls": [call.as_openai(k)]}, None,
                                         index=c.index))
            reason = "tool_calls"
        yield self._chunk(c, "", reason, self._logprobs(c) if c.pending else None)

    def _chunk(self, c: _Choice, text: str, reason, logprobs) -> str:
        if self.chat:
            return sse(api.chat_chunk(self.rid, self.model, {"content": text} if text else {},
                                      reason, logprobs, c.index))
        return sse(api.completion_chunk(self.rid, self.model, text, reason, logprobs, c.index))

    def _logprobs(self, c: _Choice) -> dict | None:
        """The logprobs object of the choice's pending tokens (None unless asked)."""
        items, c.pending = c.pending, []
        if c.request.params.logprobs is None:
            return None
        if self.chat:
            return api.chat_logprobs(items, self.tokenizer)
        out = api.completion_logprobs(items, self.tokenizer, c.offset)
        c.offset += sum(len(api.token_text(self.tokenizer, t.token)) for t in items)
        return out
