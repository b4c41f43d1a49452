"""What choosing tokens on the host costs a serving step: ``logit_bias`` and JSON-schema
answers (``response_format``) against the device's own choice.

    python -m benchmarks.host_choice --device cuda        # TinyLlama-1.1B shapes, bf16
    python -m benchmarks.host_choice --device cpu --quick  # a tiny model: a smoke test

The model is ``benchmarks.serving``'s (random weights made in memory). At 1, 8 and 32
streams, each request greedy, 64 tokens after a 200-token prompt (a warm-up round first):
the engine's milliseconds a step when the device chooses (argmax, the next step queued
ahead), when every row carries a logit bias (the logits read back and the token chosen on
the host, no step queued ahead), and when every row follows a JSON schema (an array of
integers) through llguidance, whose tokenizer is a byte-level BPE trained here on a few
sentences (the model has none), spread over the model's vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

STREAMS = (1, 8, 32)
PROMPT, TOKENS = 200, 64


def _tokenizer(model):
    """A byte-level BPE (the tests' trainer) with an end-of-text token, given to ``model``."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from needle.models.tokenizer import Tokenizer

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["[1, 22, 333]", "[4444, 55555]", "numbers in a list"] * 20,
                            trainer)
    model.tokenizer = Tokenizer(tok)
    model.generation_config = dataclasses.replace(model.generation_config,
                                                  eos_token_ids=(tok.token_to_id("</s>"),))


def _rate(model, streams: int, params, rng) -> tuple[float, int]:
    """(ms a step, steps) of ``streams`` requests of ``params`` decoding together."""
    from needle.serve import Engine, RequestParams

    vocab = min(model.config.vocab_size, 32000)
    prompts = [rng.integers(3, vocab, PROMPT).tolist() for _ in range(streams)]
    engine = Engine(model, max_seqs=streams)
    for p in prompts:  # warm: prompts read, steps captured
        engine.submit(p, RequestParams(max_tokens=4, ignore_eos=True))
    engine.run_until_idle()
    requests = [engine.submit(p, params) for p in prompts]
    start = time.perf_counter()
    engine.run_until_idle()
    steps = max(len(r.output) for r in requests)
    return (time.perf_counter() - start) / steps * 1e3, steps


def main(argv: list[str] | None = None) -> None:
    from needle import backend_ndarray as nd
    from needle.serve import RequestParams
    from needle.serve.grammar import GrammarSpec
    from needle.serve.logit_rules import LogitRules

    from .serving import build_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="needle device (default: the best)")
    parser.add_argument("--quick", action="store_true", help="a tiny model (CPU smoke test)")
    args = parser.parse_args(argv)
    device = nd.device_from_name(args.device) if args.device else nd.default_device()
    model, size = build_model(device, args.quick)
    _tokenizer(model)
    rng = np.random.default_rng(0)
    cases = {"device choice": RequestParams(max_tokens=TOKENS, ignore_eos=True),
             "logit_bias": RequestParams(max_tokens=TOKENS, ignore_eos=True,
                                         logit_rules=LogitRules(((5, -100.0),))),
             "JSON schema": RequestParams(max_tokens=TOKENS, ignore_eos=True,
                                          grammar=GrammarSpec.json_schema(
                                              {"type": "array", "items": {"type": "integer"}}))}
    print(f"\n{size} model on {device.name}: ms a step (steps timed)")
    print(f"{'streams':>8}" + "".join(f"{name:>18}" for name in cases))
    for streams in STREAMS:
        cells = [_rate(model, streams, params, rng) for params in cases.values()]
        print(f"{streams:8d}" + "".join(f"{ms:12.2f} ({n:3d})" for ms, n in cells))


if __name__ == "__main__":
    main()
