"""Reasoning models' thinking, apart from their answer: a chat answer's ``<think>...</think>``
part is returned as ``reasoning_content`` beside ``content`` (vLLM's field, which clients
such as Open WebUI show folded), so the answer a program reads is the answer alone.

Two ways the thinking begins, both handled: the model writes ``<think>`` itself (Qwen3),
or the chat template opens it in the prompt and the answer starts inside it, with only the
``</think>`` to close it (DeepSeek-R1's distilled models). An answer with neither tag is
content alone; one cut off while thinking (max_tokens) is reasoning alone. A stream sends
the thinking as ``reasoning_content`` deltas, holding back what may be the start of the
closing tag, then the rest as content. ``needle serve --reasoning-parser`` turns it on or
off; by default it is on where the chat template mentions ``<think>``.
"""

from __future__ import annotations

from .marks import partial_suffix

START, END = "<think>", "</think>"


class ThinkParser:
    """The ``<think>`` format (vLLM's ``qwen3`` and ``deepseek_r1`` parsers in one)."""

    name = "think"

    @staticmethod
    def opened_by(prompt: list[int], tokenizer) -> bool:
        """Whether the prompt ends inside the thinking (the template opened it)."""
        tail = tokenizer.decode(prompt[-8:], skip_special_tokens=False)
        return tail.rstrip().endswith(START)

    def split(self, text: str, opened: bool = False, final: bool = True) -> tuple[str, str]:
        """(reasoning, content) of an answer ``text`` (``opened``: its prompt opened the
        thinking); while not ``final``, an end that may be the start of the closing tag
        is held back."""
        body = text.lstrip()
        if body.startswith(START):
            body = body[len(START):]
        elif opened:
            body = text
        elif not final and START.startswith(body):  # the opening tag may be coming
            return "", ""
        else:
            return "", text
        at = body.find(END)
        if at < 0:  # still thinking (or cut off while thinking); a stream holds back the
            # newlines that may end the thinking, as the whole answer strips them
            held = body if final else body[:len(body) - partial_suffix(body, END)].rstrip("\n")
            return held.lstrip("\n"), ""
        return body[:at].strip("\n"), body[at + len(END):].lstrip("\n")


PARSERS = {"think": ThinkParser}


def parser_for(name: str, tokenizer) -> ThinkParser | None:
    """The parser ``name`` names ("auto": ``think`` where the chat template mentions
    ``<think>``; "none": none)."""
    if name == "none" or tokenizer is None:
        return None
    if name != "auto":
        return PARSERS[name]()
    return ThinkParser() if START in tokenizer.template_text() else None
