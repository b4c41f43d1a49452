"""A fine-tuning data file as token ids and loss labels, the way TRL's ``SFTTrainer`` reads it.

The file is JSON Lines (one object a line, blank lines skipped) or a JSON list of objects;
each record has one of TRL's three forms:

- ``{"text": ...}``: language modelling. ``encode(text)`` (with the tokenizer's special
  tokens, e.g. a BOS) plus the eos token; every token is learned.
- ``{"prompt": ..., "completion": ...}``: ``encode(prompt)`` + ``encode(completion)`` without
  special tokens + eos; only the completion and the eos are learned.
- ``{"messages": [{"role", "content"}, ...], "tools": [...]?}``: a conversation rendered by the
  model's chat template; only the assistant turns are learned, each with its end-of-turn
  token, so that the model learns to stop.

The label rule: ``labels[i] == ids[i]`` where the model must learn to predict ``ids[i]``, else
``IGNORE``; labels are not shifted (the model shifts them, as transformers' ``labels=``). The
eos appended to text and completions is the tokenizer's ``eos_token`` (tokenizer_config.json),
else the caller's ``eos_id``, as TRL appends ``tokenizer.eos_token``; it is not appended twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ArgumentError, DataFormatError, ModelFormatError

IGNORE = -100  # label of a position that carries no loss (PyTorch/transformers convention)
FORMS = ('{"text": str}, {"prompt": str, "completion": str} or '
         '{"messages": [{"role": str, "content": str}, ...]}')


@dataclass(frozen=True)
class Example:
    """One training sequence: token ids and, position by position, the id to learn or
    IGNORE (same length, unshifted)."""

    ids: list[int]
    labels: list[int]


def read_examples(path: str | Path, tokenizer, max_len: int, *, truncate: bool = True,
                  eos_id: int | None = None) -> list[Example]:
    """The records of ``path`` (JSONL or a JSON list) as Examples, in file order.

    ``tokenizer`` is a ``needle.models.tokenizer.Tokenizer``. ``eos_id`` is the end token to
    append to text and completions when the tokenizer names no ``eos_token`` (the trainer
    passes the model config's); with neither, nothing is appended. Sequences longer than
    ``max_len`` are cut to it (``truncate``) or refused; an example left with no learned
    token carries no loss and is dropped. DataFormatError names the file and line (or list
    index) of a bad record."""
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len <= 0:
        raise ArgumentError(f"max_len must be a positive int, got {max_len!r}")
    eos = _eos(tokenizer, eos_id)
    examples = []
    records = _records(Path(path))
    for where, record in records:
        ids, labels = _tokenize(where, record, tokenizer, eos)
        if len(ids) > max_len:
            if not truncate:
                raise DataFormatError(f"{where}: {len(ids)} tokens, more than max_len={max_len};"
                                      " shorten the record, raise max_len or allow truncation")
            ids, labels = ids[:max_len], labels[:max_len]
        if any(label != IGNORE for label in labels):
            examples.append(Example(ids, labels))
    if not examples:
        raise DataFormatError(f"no record of {path} has a token to learn within max_len="
                              f"{max_len} (all {len(records)} were dropped: their prompts fill "
                              "max_len, or their completions are empty); raise max_len")
    return examples


def batches(examples: list[Example], batch_size: int, *, pad_id: int, shuffle: bool,
            seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, labels) int64 arrays of shape (b, s), s the longest example of the batch, padded
    on the right (ids with ``pad_id``, labels with IGNORE, so padding is never learned); the
    last batch may be smaller. ``shuffle`` orders the examples by a permutation drawn from
    ``np.random.default_rng(seed)``: the same seed gives the same batches."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
            or batch_size <= 0:
        raise ArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
    order = np.random.default_rng(seed).permutation(len(examples)) if shuffle \
        else np.arange(len(examples))
    for start in range(0, len(examples), batch_size):
        chosen = [examples[i] for i in order[start:start + batch_size]]
        s = max(len(e.ids) for e in chosen)
        ids = np.full((len(chosen), s), pad_id, np.int64)
        labels = np.full((len(chosen), s), IGNORE, np.int64)
        for row, e in enumerate(chosen):
            ids[row, :len(e.ids)] = e.ids
            labels[row, :len(e.labels)] = e.labels
        yield ids, labels


def _eos(tokenizer, eos_id: int | None) -> int | None:
    token = (getattr(tokenizer, "special_tokens", None) or {}).get("eos_token")
    found = tokenizer.token_id(token) if token else None
    return found if found is not None else eos_id


def _records(path: Path) -> list[tuple[str, object]]:
    """(where, record) pairs: ``where`` is "file, line n" (JSONL) or "file, list index i".
    JSON or JSONL is told by the first character, not the suffix, since many ``.json``
    datasets are JSON Lines."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataFormatError(f"data file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataFormatError(f"cannot read data file {path}: {e}") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataFormatError(f"{path}: not valid JSON: {e}") from None
        records = [(f"{path}, list index {i}", item) for i, item in enumerate(items)]
    else:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append((f"{path}, line {n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{path}, line {n}: not valid JSON ({e.msg} at column "
                                      f"{e.colno}); expected one JSON object a line") from None
    if not records:
        raise DataFormatError(f"{path} holds no records; expected JSON Lines or a JSON list "
                              f"of objects, each {FORMS}")
    return records


def _tokenize(where: str, record, tokenizer, eos: int | None) -> tuple[list[int], list[int]]:
    if not isinstance(record, dict):
        raise DataFormatError(f"{where}: a record must be a JSON object, got "
                              f"{type(record).__name__}; expected {FORMS}")
    if "messages" in record:
        return _conversation(where, record, tokenizer, eos)
    if "prompt" in record or "completion" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise DataFormatError(f"{where}: 'prompt' and 'completion' must both be strings, "
                                  f"got {_kind(prompt)} and {_kind(completion)}")
        head = tokenizer.encode(prompt, add_special_tokens=True)
        tail = _with_eos(tokenizer.encode(completion, add_special_tokens=False), eos)
        return head + tail, [IGNORE] * len(head) + tail
    if "text" in record:
        if not isinstance(record["text"], str):
            raise DataFormatError(f"{where}: 'text' must be a string, got "
                                  f"{_kind(record['text'])}")
        ids = _with_eos(tokenizer.encode(record["text"], add_special_tokens=True), eos)
        return ids, list(ids)
    raise DataFormatError(f"{where}: a record with keys {sorted(record)} has no known form; "
                          f"expected {FORMS}")


def _with_eos(ids: list[int], eos: int | None) -> list[int]:
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _conversation(where: str, record: dict, tokenizer, eos: int | None
                  ) -> tuple[list[int], list[int]]:
    """The rendered conversation, each assistant turn learned. A turn's tokens are those
    that rendering ``messages[:i + 1]`` adds to ``messages[:i]`` with the generation prompt:
    the template itself says where the reply starts, with no role markers to guess. Tokens
    after the turn's last eos (ChatML's newline after <|im_end|>) are formatting the model
    never generates, so are not learned, as in templates' ``{% generation %}`` blocks. An
    assistant message that opens a conversation is learned from the start (an empty
    conversation cannot be rendered)."""
    messages, tools = record["messages"], record.get("tools")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and (isinstance(m.get("content"), str)
                 or (m.get("content") is None and m.get("tool_calls"))) for m in messages):
        raise DataFormatError(f"{where}: 'messages' must be a non-empty list of objects with "
                              "string 'role' and 'content'")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise DataFormatError(f"{where}: 'tools' must be a list of objects (JSON schemas)")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise DataFormatError(f"{where}: the conversation has no assistant message, so "
                              "nothing to learn; add one or use the text form")
    if not getattr(tokenizer, "chat_template", None):
        raise DataFormatError(f"{where}: a 'messages' record needs the model's chat template, "
                              "and this tokenizer has none; use the text or prompt/completion "
                              "form")

    def render(conversation, prompt: bool = False) -> list[int]:
        try:
            return list(tokenizer.apply_chat_template(
                conversation, tools=tools, add_generation_prompt=prompt, tokenize=True,
                return_dict=False))
        except ModelFormatError as e:
            raise DataFormatError(f"{where}: {e}") from None

    ids = render(messages)
    labels = [IGNORE] * len(ids)
    for i in turns:
        before = render(messages[:i], prompt=True) if i else []
        upto = render(messages[:i + 1])
        if upto[:len(before)] != before or ids[:len(upto)] != upto:
            raise DataFormatError(
                f"{where}: the chat template does not render conversations incrementally "
                f"(the tokens up to assistant message {i} are not a prefix of the whole "
                "conversation's), so the assistant's tokens cannot be told apart; write the "
                "records in the prompt/completion form instead")
        end = len(upto)
        if eos in upto[len(before):]:
            end = len(upto) - upto[::-1].index(eos)
        labels[len(before):end] = ids[len(before):end]
    return ids, labels


def _kind(value) -> str:
    return "missing" if value is None else type(value).__name__
