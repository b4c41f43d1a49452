"""Tokenizer round trips and streaming detokenization on a BPE trained here."""

from __future__ import annotations

import pytest

from needle.errors import ModelFormatError
from needle.models import Tokenizer

from .bpe import train

TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Naïve café owners in 東京 serve crème brûlée 🙂 every morning.",
         "  leading spaces, unseen wordz: qzxj ✓", ""]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train().save(str(path))
    return Tokenizer.from_file(path)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.token_id("<s>")
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]


def test_merges_were_learned(tokenizer):
    text = TEXTS[0]
    assert len(tokenizer.encode(text, add_special_tokens=False)) < 0.8 * len(text.encode())


@pytest.mark.parametrize("text", TEXTS[:3])
def test_stream_decoder_pieces_add_up(tokenizer, text):
    """Streaming one token at a time yields the full text, never a broken character."""
    decoder = tokenizer.stream_decoder()
    pieces = [decoder.push(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_bad_tokenizer_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    with pytest.raises(ModelFormatError, match="not a valid tokenizer file"):
        Tokenizer.from_file(path)
    with pytest.raises(ModelFormatError, match="does not exist"):
        Tokenizer.from_file(tmp_path / "missing.json")
