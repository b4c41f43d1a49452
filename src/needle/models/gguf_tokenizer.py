"""The tokenizer of a GGUF file, from its ``tokenizer.ggml.*`` metadata, as a ``tokenizers``
tokenizer built the way transformers builds it from the same file:

* ``llama`` (SentencePiece BPE): BPE over the file's vocabulary with byte fallback; merges
  from ``tokenizer.ggml.merges``, or recovered from the vocabulary and its scores (each
  token's splits into two vocabulary pieces, best-scored token first); the Metaspace
  pre-tokenizer (a "▁" before the first word); a BOS added unless ``add_bos_token`` is false.
* ``gpt2`` (byte-level BPE): vocabulary and merges as given, the GPT-2 byte-level
  pre-tokenizer (the Llama 3 or Qwen2 split rule where ``tokenizer.ggml.pre`` names it).

Tokens typed CONTROL become special tokens, USER_DEFINED ones added tokens. The chat
template is ``tokenizer.chat_template``.
"""

from __future__ import annotations

from ..errors import ModelFormatError
from .tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2/2.5/3's rule (Qwen2TokenizerFast's): digits one at a time
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split before byte-level BPE (others: GPT-2's)
_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe")}
_SPLITS["qwen2"] = _QWEN2_SPLIT


def _merges_from_scores(tokens: list[str], scores) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by a vocabulary: every split of a token into two
    vocabulary pieces, ordered by the token's score (best first), then by piece lengths."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores):
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found += local
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def gguf_tokenizer(file) -> Tokenizer | None:
    """The file's tokenizer; None when it has no vocabulary (or ``tokenizers`` is missing)."""
    tokens = file.field("tokenizer.ggml.tokens")
    if not tokens:
        return None
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return None
    model = file.field("tokenizer.ggml.model")
    if model == "llama":
        backend = _sentencepiece(file, list(tokens))
    elif model == "gpt2":
        backend = _byte_level(file, list(tokens))
    else:
        raise ModelFormatError(f"{file.path}: tokenizer.ggml.model {model!r} is not read "
                               "(needle reads 'llama' and 'gpt2' tokenizers)")
    _add_special(backend, list(tokens), file.field("tokenizer.ggml.token_type"))
    special = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        i = file.field(f"tokenizer.ggml.{key}")
        if i is not None and 0 <= int(i) < len(tokens):
            special[name] = tokens[int(i)]
    return Tokenizer(backend, file.field("tokenizer.chat_template"), special)


def _sentencepiece(file, tokens):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors

    merges = file.field("tokenizer.ggml.merges")
    merges = ([tuple(m.split(" ", 1)) for m in merges] if merges
              else _merges_from_scores(tokens, file.field("tokenizer.ggml.scores")
                                       or [0.0] * len(tokens)))
    unk = file.field("tokenizer.ggml.unknown_token_id")
    backend = Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=True,
                                 byte_fallback=True,
                                 unk_token=tokens[int(unk)] if unk is not None else "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    bos = file.field("tokenizer.ggml.bos_token_id")
    if bos is not None and file.field("tokenizer.ggml.add_bos_token", True):
        b = tokens[int(bos)]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{b}:0 $A:0", pair=f"{b}:0 $A:0 {b}:1 $B:1", special_tokens=[(b, int(bos))])
    return backend


def _byte_level(file, tokens):
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    merges = [tuple(m.split(" ", 1)) for m in file.field("tokenizer.ggml.merges") or ()]
    backend = Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    split = _SPLITS.get(file.field("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def _add_special(backend, tokens, types) -> None:
    from tokenizers import AddedToken

    if not types:
        return
    control = [AddedToken(t, normalized=False, special=True)
               for t, k in zip(tokens, types) if k == CONTROL]
    user = [AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, types) if k == USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
