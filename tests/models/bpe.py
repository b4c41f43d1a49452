"""A byte-level BPE tokenizer trained in the test itself (no downloads)."""

from __future__ import annotations

import tokenizers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "needle is a small deep-learning framework; it runs on CPUs and GPUs.",
    "Naïve café owners in 東京 serve crème brûlée 🙂 every morning.",
    "Tokens, tokens everywhere: byte pair encoding merges frequent pairs.",
] * 20


def train(vocab_size: int = 300) -> tokenizers.Tokenizer:
    """A byte-level BPE over ``CORPUS`` with <s> (id 0) prepended as BOS and </s> (id 1)."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", 0)])
    return tok
