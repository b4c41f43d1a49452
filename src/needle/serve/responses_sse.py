"""A streamed Responses API answer (``responses_api.py``) as the API's server-sent events.

One request's engine events become: ``response.created`` and ``response.in_progress``;
a ``reasoning`` item while the model thinks (``output_item.added``,
``reasoning_text.delta``s, ``reasoning_text.done``, ``output_item.done``); a ``message``
item once its text begins (``output_item.added``, ``content_part.added``,
``output_text.delta``s, then the ``done`` events); at the end a ``function_call`` item a
call (its arguments as one delta); then ``response.completed`` (``response.incomplete`` at
``max_output_tokens``) with the whole response. Every event carries its
``sequence_number``. Text that may still turn out to be a call, or the end of the
thinking, is held back as in chat streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from . import responses_api as rapi
from .answer import AnswerReader
from .sse import sse


class ResponseStream:
    def __init__(self, request, rid: str, model: str, body: dict, tokenizer, reasoning,
                 calls):
        self.request, self.rid, self.model, self.body = request, rid, model, body
        self.reader = AnswerReader(request, tokenizer, reasoning, calls)
        self.seq = 0
        self.items: list[dict] = []  # the output items, finished or open
        self.thought_at = self.message_at = None  # their output indices
        self._thought = self._message = ""  # the thinking and the message text so far

    def _event(self, kind: str, **fields) -> str:
        fields.update(type=kind, sequence_number=self.seq)
        self.seq += 1
        return sse(fields)

    def _response(self, status: str | None = None, request=None) -> dict:
        return rapi.response(self.rid, self.model, self.body, self.items, request, status)

    async def events(self, queue: asyncio.Queue, include_usage: bool = False
                     ) -> AsyncIterator[str]:
        """The events of the answer (the final response always carries its usage)."""
        yield self._event("response.created", response=self._response("in_progress"))
        yield self._event("response.in_progress", response=self._response("in_progress"))
        while True:
            _, event = await queue.get()
            if event.finish_reason == "error":
                yield self._event("error", code="server_error", param=None,
                                  message=f"generation failed: {event.error}")
                return
            final = event.finish_reason is not None
            thought, content, calls = self.reader.push(event.text, final)
            for chunk in self._thinking(thought):
                yield chunk
            if content:
                for chunk in self._text(content):
                    yield chunk
            if final:
                break
        for chunk in self._finish(calls.calls if calls is not None else []):
            yield chunk

    def _thinking(self, delta: str):
        """New thinking, in the reasoning item (opened on its first text)."""
        if not delta:
            return
        if self.thought_at is None:
            self.thought_at = len(self.items)
            self.items.append(rapi.reasoning_item(""))
            self.items[-1].update(status="in_progress", content=[])
            yield self._event("response.output_item.added", output_index=self.thought_at,
                              item=self.items[-1])
        item = self.items[self.thought_at]
        yield self._event("response.reasoning_text.delta", item_id=item["id"],
                          output_index=self.thought_at, content_index=0, delta=delta)
        self._thought += delta

    def _close_thinking(self):
        if self.thought_at is None or self.items[self.thought_at]["status"] == "completed":
            return
        done = rapi.reasoning_item(self._thought, self.items[self.thought_at]["id"])
        self.items[self.thought_at] = done
        yield self._event("response.reasoning_text.done", item_id=done["id"],
                          output_index=self.thought_at, content_index=0, text=self._thought)
        yield self._event("response.output_item.done", output_index=self.thought_at, item=done)

    def _text(self, delta: str):
        """New answer text, in the message item (opened on its first text)."""
        yield from self._close_thinking()
        if self.message_at is None:
            self.message_at = len(self.items)
            item = rapi.message_item("", status="in_progress")
            item["content"] = []
            self.items.append(item)
            yield self._event("response.output_item.added", output_index=self.message_at,
                              item=item)
            yield self._event("response.content_part.added", item_id=item["id"],
                              output_index=self.message_at, content_index=0,
                              part={"type": "output_text", "text": "", "annotations": [],
                                    "logprobs": []})
        self._message += delta
        yield self._event("response.output_text.delta",
                          item_id=self.items[self.message_at]["id"],
                          output_index=self.message_at, content_index=0, delta=delta,
                          logprobs=[])

    def _finish(self, calls: list):
        """The open items closed, the calls' items, then the whole response."""
        yield from self._close_thinking()
        if self.message_at is None and not calls:  # no text and no call: an empty message
            yield from self._text("")
        if self.message_at is not None:
            text = self._message
            done = rapi.message_item(text, self.items[self.message_at]["id"])
            self.items[self.message_at] = done
            at, item_id = self.message_at, done["id"]
            yield self._event("response.output_text.done", item_id=item_id, output_index=at,
                              content_index=0, text=text, logprobs=[])
            yield self._event("response.content_part.done", item_id=item_id, output_index=at,
                              content_index=0, part=done["content"][0])
            yield self._event("response.output_item.done", output_index=at, item=done)
        for call in calls:
            at, item = len(self.items), rapi.call_item(call)
            self.items.append(item)
            yield self._event("response.output_item.added", output_index=at,
                              item={**item, "arguments": "", "status": "in_progress"})
            yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=at, delta=item["arguments"])
            yield self._event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=at, arguments=item["arguments"])
            yield self._event("response.output_item.done", output_index=at, item=item)
        whole = self._response(request=self.request)
        kind = "response.incomplete" if whole["status"] == "incomplete" else \
            "response.completed"
        yield self._event(kind, response=whole)
