"""Text <-> token ids through a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library),
with the model's chat template and special tokens from ``tokenizer_config.json`` (or
``chat_template.jinja``, where transformers 5 saves the template).

``tokenizers`` is an optional dependency (``pip install needle[llm]``): a model loads
without it, and only turning text into ids (or back) needs it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ..errors import ModelFormatError
from .chat import ChatTemplate

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")


class Tokenizer:
    """Encode and decode text for one model; render its chat template."""

    def __init__(self, backend, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None):
        self._tok = backend
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self._compiled: dict[str, ChatTemplate] = {}
        self._byte_level: bool | None = None  # a ByteLevel pre-tokenizer or decoder

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

    @classmethod
    def from_directory(cls, directory: str | Path) -> Tokenizer:
        """tokenizer.json plus the chat template and special tokens of a model directory."""
        directory = Path(directory)
        tok = cls.from_file(directory / TOKENIZER_FILE)
        config = _read_config(directory / CONFIG_FILE)
        tok.special_tokens = {name: _token_text(config[name]) for name in SPECIAL_TOKENS
                              if config.get(name) is not None}
        template_file = directory / TEMPLATE_FILE
        if template_file.is_file():
            tok.chat_template = template_file.read_text(encoding="utf-8")
        else:
            tok.chat_template = config.get("chat_template")
        return tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens (a BOS) as the tokenizer's template adds them."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def template_text(self) -> str:
        """The chat template's source ("" without one; named templates' joined), for
        telling what a model's template does."""
        source = self.chat_template
        if isinstance(source, list):  # named templates: {"name": ..., "template": ...}
            source = " ".join(t.get("template", "") for t in source if isinstance(t, dict))
        return source if isinstance(source, str) else ""

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what other libraries load it from)."""
        return self._tok.to_str()

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE piece through its byte alphabet,
        a byte-fallback piece ``<0xHH>`` as its byte, a SentencePiece ``▁`` as a space):
        exact where ``decode([token])`` alone shows part of a character as U+FFFD."""
        piece = self._tok.id_to_token(int(token))
        if piece is None:
            return b""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self._byte_level is None:
            self._byte_level = '"ByteLevel"' in self._tok.to_str()
        if self._byte_level:
            table = _byte_alphabet()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return piece.replace("\u2581", " ").encode()

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    # --- chat ------------------------------------------------------------------------------
    def apply_chat_template(self, conversation, tools=None, documents=None,
                            chat_template: str | None = None,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            return_dict: bool = True, **kwargs):
        """transformers' ``apply_chat_template``: the conversation (a list of messages, or
        a list of such lists) rendered by the model's chat template. ``tokenize=False``
        gives the text; otherwise its ids (encoded without adding special tokens: the
        template writes them), as ``{"input_ids", "attention_mask"}`` when ``return_dict``
        (transformers 5's default) or as a plain list. Extra keyword arguments are template
        variables."""
        template = self._template(chat_template, tools)
        batched = bool(conversation) and isinstance(conversation, (list, tuple)) and \
            isinstance(conversation[0], (list, tuple))
        texts = [template.render(c, add_generation_prompt, continue_final_message, tools,
                                 documents, **kwargs)
                 for c in (conversation if batched else [conversation])]
        if not tokenize:
            return texts if batched else texts[0]
        ids = [self.encode(t, add_special_tokens=False) for t in texts]
        if not return_dict:
            return ids if batched else ids[0]
        masks = [[1] * len(i) for i in ids]
        return {"input_ids": ids if batched else ids[0],
                "attention_mask": masks if batched else masks[0]}

    def _template(self, override: str | None, tools) -> ChatTemplate:
        source = override if override is not None else self.chat_template
        if isinstance(source, list):  # named templates: {"name": ..., "template": ...}
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("tool_use") if tools and "tool_use" in named else \
                named.get("default")
        if not isinstance(source, str) or not source:
            raise ModelFormatError("this tokenizer has no chat template (tokenizer_config.json "
                                   "has no 'chat_template' and there is no chat_template.jinja);"
                                   " pass chat_template=... or use plain prompts")
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = self._compiled[source] = ChatTemplate(source, self.special_tokens)
        return compiled


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte is one printable character, the
    printable Latin-1 bytes themselves, the others shifted past 255 in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


def load_tokenizer(directory: Path) -> Tokenizer | None:
    """The directory's tokenizer, or None when it has no tokenizer.json or ``tokenizers`` is
    not installed (the model still loads and runs on token ids)."""
    if not (Path(directory) / TOKENIZER_FILE).is_file():
        return None
    try:
        return Tokenizer.from_directory(directory)
    except ModelFormatError as e:
        if "needs the 'tokenizers' package" in str(e):
            return None
        raise


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelFormatError(f"{path} must hold a JSON object")
    return config


def _token_text(entry) -> str:
    """A special token as tokenizer_config.json gives it: a string or an AddedToken dict."""
    if isinstance(entry, dict):
        return str(entry.get("content", ""))
    return str(entry)


class StreamDecoder:
    """Turns a stream of token ids into a stream of text pieces.

    A token need not end on a character boundary (byte-level BPE and byte-fallback tokens
    split UTF-8 sequences), and some tokenizers decide a token's leading space from its left
    neighbour. So each new piece is the difference between decoding a short window with and
    without the newest tokens, emitted only once it no longer ends in an incomplete
    character (which decodes as U+FFFD).
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
