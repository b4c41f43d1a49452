"""Text markers in a streamed answer (a tool call's opening tag, the end of a model's
thinking): how much of the text so far may be the start of one, and so must wait."""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (0: none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
