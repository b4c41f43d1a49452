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


def _sentencepiece_with_byte_fallback():
    """A Llama-2-style tokenizer: SentencePiece BPE whose unknown characters become UTF-8
    byte tokens <0xNN> (byte fallback), decoded by Replace, ByteFallback, Fuse and Strip."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for ch in "▁abcdefghijklmnopqrstuvwxyzHTé":
        vocab.setdefault(ch, len(vocab))
    vocab["▁h"] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab, [("▁", "h")], unk_token="<unk>",
                                          byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return Tokenizer(tok)


@pytest.mark.parametrize("text", ["héllo 東京 🙂 ok", "🙂🙂", "the café ✓ 你好"])
def test_stream_decoder_joins_byte_fallback_tokens(text):
    """A character split across byte tokens (東 is <0xE6><0x9D><0xB1>; 🙂 four bytes) comes
    out whole, once its last byte arrives; no piece holds U+FFFD."""
    tok = _sentencepiece_with_byte_fallback()
    ids = tok.encode(text, add_special_tokens=False)
    assert any(3 <= i < 259 for i in ids)  # byte tokens are in play
    assert tok.decode(ids) == text
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # alone, a byte is no character
    decoder = tok.stream_decoder()
    pieces = [decoder.push(t) for t in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert all(p.encode("utf-8").decode("utf-8") == p for p in pieces)


@pytest.mark.parametrize("text", TEXTS[:3])
def test_token_bytes_add_up_to_the_text(tokenizer, text):
    """Byte-level BPE: each token's bytes (``token_bytes``) joined are the text's UTF-8,
    though a token alone may hold part of a character (which ``decode`` shows as U+FFFD)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()
    assert tokenizer.token_bytes(tokenizer.token_id("<s>")) == b"<s>"


@pytest.mark.parametrize("text", ["héllo 東京 🙂 ok", "the café ✓ 你好"])
def test_token_bytes_of_sentencepiece_byte_fallback(text):
    """A Llama-2-style tokenizer: byte tokens <0xNN> are their byte, ▁ a space (the first
    word's space is the one SentencePiece prepends)."""
    tok = _sentencepiece_with_byte_fallback()
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == (" " + text).encode()
    assert tok.token_bytes(3 + 0xE6) == b"\xe6"
