"""Text <-> token ids through a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library).

``tokenizers`` is an optional dependency (``pip install needle[llm]``): a model loads
without it, and only turning text into ids (or back) needs it.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ModelFormatError

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    """Encode and decode text for one model."""

    def __init__(self, backend):
        self._tok = backend

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a ``tokenizer.json``; ModelFormatError when it is missing or malformed."""
        try:
            import tokenizers
        except ImportError:
            raise ModelFormatError("reading tokenizer.json needs the 'tokenizers' package: "
                                   "pip install tokenizers (or needle[llm])") from None
        path = Path(path)
        if not path.is_file():
            raise ModelFormatError(f"{path} does not exist")
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises plain Exceptions for malformed files
            raise ModelFormatError(f"{path} is not a valid tokenizer file: {e}") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens (a BOS) as the tokenizer's template adds them."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns a stream of token ids into a stream of text pieces.

    A token need not end on a character boundary (byte-level BPE splits UTF-8 sequences), and
    some tokenizers decide a token's leading space from its left neighbour. So each new piece
    is the difference between decoding a short window with and without the newest tokens,
    emitted only once it no longer ends in an incomplete character.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens already turned into emitted text

    def push(self, token: int) -> str:
        """The text that ``token`` completes (possibly empty)."""
        self._ids.append(int(token))
        before = self._tok.decode(self._ids[self._prefix:self._read])
        after = self._tok.decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever is left undecoded at the end of the stream."""
        before = self._tok.decode(self._ids[self._prefix:self._read])
        after = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return after[len(before):]
