"""``needle generate MODEL_DIR --prompt "..."``: stream text from a local Llama-family model.

Text goes to stdout as it is generated; the speeds (prefill and decode tokens per second)
and the peak memory go to stderr at the end, so the text can be piped on its own.
"""

from __future__ import annotations

import argparse
import sys

from .errors import ModelFormatError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="needle generate",
                                description="Generate text with a local Hugging Face Llama, "
                                            "Mistral or Qwen2 checkpoint (safetensors).")
    p.add_argument("model_dir", metavar="MODEL_DIR",
                   help="folder with config.json, tokenizer.json and *.safetensors")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (128)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (the default) decodes greedily")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler")
    p.add_argument("--device", default="auto", help="auto, cpu, cpu_numpy, cuda[:i] or metal")
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="default: the checkpoint's own")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="KV cache length (default: prompt + max tokens)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from pathlib import Path

    from .models import GenerationStats, Tokenizer, load_pretrained
    from .models.memory import peak_bytes
    from .models.tokenizer import TOKENIZER_FILE

    tokenizer_file = Path(args.model_dir) / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise ModelFormatError(f"{tokenizer_file} does not exist; needle generate needs the "
                               "model's tokenizer.json to turn the prompt into tokens")
    tokenizer = Tokenizer.from_file(tokenizer_file)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise ModelFormatError("the prompt encodes to no tokens; give some text")
    max_seq_len = args.max_seq_len or len(ids) + max(args.max_tokens, 0)
    model = load_pretrained(args.model_dir, device=args.device, dtype=args.dtype,
                            max_seq_len=max_seq_len)
    stats = GenerationStats()
    text = tokenizer.stream_decoder()
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    for token in model.stream(ids, args.max_tokens, args.temperature, args.top_k, args.top_p,
                              args.seed, stats=stats):
        out.write(text.push(token))
        out.flush()
    out.write(text.flush() + "\n")
    out.flush()
    peak = peak_bytes(model.device)
    lines = [f"device {model.device.name}, {model.dtype}",
             f"prefill: {stats.prefill_tokens} tokens, {stats.prefill_tokens_per_s:.1f} tokens/s",
             f"decode:  {stats.decode_tokens} tokens, {stats.decode_tokens_per_s:.1f} tokens/s"]
    if peak is not None:
        lines.append(f"{peak[1]}: {peak[0] / 2**20:.1f} MiB")
    print("\n".join(lines), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
