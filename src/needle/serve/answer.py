"""A chat answer read for its parts: a reasoning model's thinking apart from its content
(``reasoning.py``) and, where tools were offered, its tool calls (``tools.py``). Every API
that writes chat answers (chat completions, the Responses API, Anthropic's Messages API)
reads them here, whole or as they stream in; only how each writes the parts differs."""

from __future__ import annotations

from .tools import CallsReader, ToolAnswer


class AnswerReader:
    """One answer as it streams in: ``push`` each piece of its text; it says what of the
    thinking and of the content is new and sure (text that may still become a closing tag
    or a call is held back) and, with the last piece, the calls."""

    def __init__(self, request, tokenizer, reasoning, calls: CallsReader | None):
        self.request, self.tokenizer, self.reasoning = request, tokenizer, reasoning
        self.calls = calls if calls is not None and calls.parser is not None else None
        self.text, self.sent, self.sent_thought = "", 0, 0
        self.opened: bool | None = None  # whether the prompt opened the thinking

    def push(self, piece: str, final: bool) -> tuple[str, str, ToolAnswer | None]:
        """(new thinking, new content, the calls: with the last piece, where they parse)."""
        self.text += piece
        thought, answer = "", self.text
        if self.reasoning is not None:
            if self.opened is None:
                self.opened = self.reasoning.opened_by(self.request.prompt, self.tokenizer)
            thought, answer = self.reasoning.split(self.text, self.opened, final)
        new_thought = thought[self.sent_thought:]
        self.sent_thought = max(self.sent_thought, len(thought))
        tokens = self.request.output
        calls = self.calls.read(answer, tokens) if final and self.calls is not None else None
        upto = len(answer) if self.calls is None or (final and calls is None) else \
            self.calls.streamable(answer, tokens)
        new_content = answer[self.sent:upto]
        self.sent = max(self.sent, upto)
        return new_thought, new_content, calls


def whole(request, tokenizer, reasoning, calls: CallsReader):
    """A finished answer's (thinking or None where not read for it, content or None, tool
    calls)."""
    thought, text = None, request.text
    if reasoning is not None:
        thought, text = reasoning.split(request.text,
                                        reasoning.opened_by(request.prompt, tokenizer))
    content, found = calls.content_and_calls(request, text)
    return thought, content, found
