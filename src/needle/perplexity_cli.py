"""``needle perplexity MODEL_DIR TEXT_FILE``: a model's perplexity on a text file (llama.cpp's
``llama-perplexity``, transformers' sliding-window recipe; ``models/perplexity.py``).

How a quantized copy compares with its source: run both on the same held-out text. The
result goes to stdout (``--json`` for a machine's reading); a progress bar to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .errors import ArgumentError
from .generate_cli import add_model_dir


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="needle perplexity",
                                description="Perplexity of a local model on a text file.")
    add_model_dir(p)
    p.add_argument("text", metavar="TEXT_FILE", help="UTF-8 text to score ('-': stdin)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens a window holds (default: the smaller of 2,048 and the "
                        "model's max_position_embeddings)")
    p.add_argument("--stride", type=int, default=None,
                   help="tokens between windows' starts (default: the context, windows end "
                        "to end); shorter gives each scored token more context")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="score only the text's first N tokens")
    p.add_argument("--device", default="auto", help="auto, cpu, cpu_numpy, cuda[:i] or metal")
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="default: the checkpoint's own")
    p.add_argument("--adapter", default=None,
                   help="a LoRA adapter directory (PEFT's format) merged into the weights")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    file = Path(path)
    if not file.is_file():
        raise ArgumentError(f"{path} is not a file; give a UTF-8 text file (or - for stdin)")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ArgumentError(f"{path} is not UTF-8 text ({e})") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .generate_cli import model_config, tokenizer_of
    from .models import load_pretrained
    from .models.perplexity import perplexity

    text = _read(args.text)
    tokenizer = tokenizer_of(args.model_dir)
    ids = tokenizer.encode(text)
    if args.max_tokens is not None:
        if args.max_tokens < 2:
            raise ArgumentError(f"--max-tokens must be >= 2, got {args.max_tokens}")
        ids = ids[:args.max_tokens]
    cfg = model_config(args.model_dir)
    context = args.context or min(2048, cfg.max_position_embeddings)
    if context > cfg.max_position_embeddings:
        raise ArgumentError(f"--context {context} exceeds the model's max_position_embeddings "
                            f"{cfg.max_position_embeddings}")
    model = load_pretrained(args.model_dir, device=args.device, dtype=args.dtype,
                            max_seq_len=context, adapter=args.adapter)
    start = time.perf_counter()
    result = perplexity(model, ids, context, args.stride, progress=not args.quiet)
    seconds = time.perf_counter() - start
    summary = {"perplexity": result.perplexity, "nll_per_token": result.nll_per_token,
               "tokens_scored": result.tokens, "windows": result.windows, "context": context,
               "stride": args.stride or context, "tokens_per_second": result.tokens / seconds,
               "device": model.device.name, "dtype": model.dtype}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"perplexity {result.perplexity:.4f} ({result.tokens} tokens in "
              f"{result.windows} windows of {context}, stride {summary['stride']}; "
              f"{result.nll_per_token:.4f} nats a token; {summary['tokens_per_second']:.0f} "
              f"tokens/s on {model.device.name}, {model.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
