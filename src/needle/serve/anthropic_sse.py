"""A streamed Messages API answer (``anthropic_api.py``) as the API's server-sent events:
``message_start``; per content block ``content_block_start``, its deltas
(``thinking_delta``, ``text_delta``, or a tool_use block's ``input_json_delta``, whole)
and ``content_block_stop``; then ``message_delta`` (the stop reason and the output tokens)
and ``message_stop``. Text that may still turn out to be a call, or the end of the
thinking, is held back as in chat streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from . import anthropic_api as aapi
from .answer import AnswerReader
from .api_error import ApiError


class MessageStream:
    def __init__(self, request, mid: str, model: str, tokenizer, reasoning, calls):
        self.request, self.mid, self.model = request, mid, model
        self.reader = AnswerReader(request, tokenizer, reasoning, calls)
        self.blocks = 0  # content blocks started
        self.open: str | None = None  # the kind of the block open now

    @staticmethod
    def _event(kind: str, **fields) -> str:
        data = json.dumps({"type": kind, **fields}, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    async def events(self, queue: asyncio.Queue, include_usage: bool = False
                     ) -> AsyncIterator[str]:
        """The events of the answer (the usage always comes with message_delta)."""
        yield self._event("message_start", message=aapi.message(
            self.mid, self.model, self.request, [], None))
        while True:
            _, event = await queue.get()
            if event.finish_reason == "error":
                e = ApiError(500, f"generation failed: {event.error}", kind="server_error")
                yield self._event("error", error=aapi.error_body(e)["error"])
                return
            final = event.finish_reason is not None
            thought, content, calls = self.reader.push(event.text, final)
            for kind, piece in (("thinking", thought), ("text", content)):
                if piece:
                    for chunk in self._delta(kind, piece):
                        yield chunk
            if final:
                break
        calls = calls.calls if calls is not None else []
        if not calls and self.blocks == 0:  # no text and no call: an empty text block
            for chunk in self._delta("text", ""):
                yield chunk
        for chunk in self._close():
            yield chunk
        for call in calls:
            block = aapi.tool_use_block(call)
            yield self._event("content_block_start", index=self.blocks,
                              content_block={**block, "input": {}})
            yield self._event("content_block_delta", index=self.blocks, delta={
                "type": "input_json_delta", "partial_json": call.arguments})
            yield self._event("content_block_stop", index=self.blocks)
            self.blocks += 1
        yield self._event("message_delta", delta={
            "stop_reason": aapi.stop_reason(self.request, calls),
            "stop_sequence": self.request.stopped_by},
            usage={"output_tokens": len(self.request.output)})
        yield self._event("message_stop")

    def _delta(self, kind: str, piece: str):
        """``piece`` of a thinking or text block, the block started where it is new."""
        if self.open != kind:
            yield from self._close()
            start = aapi.thinking_block("") if kind == "thinking" else aapi.text_block("")
            yield self._event("content_block_start", index=self.blocks, content_block=start)
            self.open = kind
        delta = {"type": "thinking_delta", "thinking": piece} if kind == "thinking" else \
            {"type": "text_delta", "text": piece}
        yield self._event("content_block_delta", index=self.blocks, delta=delta)

    def _close(self):
        if self.open is not None:
            if self.open == "thinking":  # needle's thinking carries no signature
                yield self._event("content_block_delta", index=self.blocks,
                                  delta={"type": "signature_delta", "signature": ""})
            yield self._event("content_block_stop", index=self.blocks)
            self.blocks += 1
            self.open = None
