"""``needle generate MODEL_DIR --prompt "..."``: stream text from a local model.

Text goes to stdout as it is generated; the speeds (load, time to first token, prefill and
decode tokens per second) and the peak memory go to stderr at the end, so the text can be
piped on its own. ``--chat`` renders the prompt as one user turn through the model's chat
template. The options shared with ``needle chat`` are defined here.
"""

from __future__ import annotations

import argparse
import sys
import time

from .errors import ArgumentError, ModelFormatError


def add_model_dir(p: argparse.ArgumentParser) -> None:
    """The MODEL_DIR argument of every command that loads a model."""
    p.add_argument("model_dir", metavar="MODEL_DIR",
                   help="folder with config.json, tokenizer.json and *.safetensors, or a "
                        ".gguf file")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Options of every command that loads a model and generates (generate, chat)."""
    add_model_dir(p)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens at most per answer (default 128, or what fits)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 decodes greedily (default: the model's generation_config.json)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    p.add_argument("--min-p", type=float, default=None,
                   help="drop tokens below this fraction of the likeliest one's probability")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide the logits of tokens already seen (transformers' rule)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler")
    p.add_argument("--device", default="auto", help="auto, cpu, cpu_numpy, cuda[:i] or metal")
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="default: the checkpoint's own")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="KV cache length (default: what the prompt and answer need)")
    p.add_argument("--adapter", default=None,
                   help="a LoRA adapter directory (PEFT's format) merged into the weights")


def sampling(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed, min_p=args.min_p, repetition_penalty=args.repetition_penalty)


def tokenizer_of(model_dir: str):
    """The model directory's tokenizer (with its chat template); a clear error without one."""
    from pathlib import Path

    from .models.gguf import GGUFFile, is_gguf
    from .models.gguf_tokenizer import gguf_tokenizer
    from .models.tokenizer import TOKENIZER_FILE, Tokenizer

    if is_gguf(model_dir):
        tokenizer = gguf_tokenizer(GGUFFile(model_dir))
        if tokenizer is None:
            raise ModelFormatError(f"{model_dir} has no tokenizer.ggml.tokens (or the "
                                   "'tokenizers' package is missing); needle needs them to turn "
                                   "text into tokens")
        return tokenizer
    if not (Path(model_dir) / TOKENIZER_FILE).is_file():
        raise ModelFormatError(f"{Path(model_dir) / TOKENIZER_FILE} does not exist; needle needs "
                               "the model's tokenizer.json to turn text into tokens")
    return Tokenizer.from_directory(model_dir)


def model_config(model_dir: str):
    """The ModelConfig of a checkpoint directory or a GGUF file, without loading weights."""
    from .models.config import ModelConfig
    from .models.gguf import GGUFFile, is_gguf

    return (GGUFFile(model_dir).config() if is_gguf(model_dir)
            else ModelConfig.from_file(model_dir))


def load(args, needed: int):
    """The model of ``args``; ``needed``: the positions the command needs (a KV cache that
    long, within what the model was trained for, unless --max-seq-len says otherwise)."""
    from .models import load_pretrained

    max_seq_len = args.max_seq_len
    if max_seq_len is None:
        max_seq_len = min(needed, model_config(args.model_dir).max_position_embeddings)
    adapter = getattr(args, "adapter", None)
    if getattr(args, "tp", 1) > 1:  # this rank's share (``needle.distributed``)
        from .distributed import load_tensor_parallel

        if adapter is not None:
            raise ArgumentError("--adapter with --tp: merge the adapter first (needle finetune "
                                "--merge, or load_pretrained(..., adapter=) and save)")

        return load_tensor_parallel(args.model_dir, dtype=args.dtype, max_seq_len=max_seq_len)
    return load_pretrained(args.model_dir, device=args.device, dtype=args.dtype,
                           max_seq_len=max_seq_len, adapter=adapter)


def answer_budget(model, prompt_tokens: int, requested: int | None) -> int:
    """New tokens to ask for: the request (default 128), cut to what the KV cache has left —
    a truncation said on stderr, never silent."""
    room = model.max_seq_len - prompt_tokens
    if room < 1:
        raise ModelFormatError(f"the prompt is {prompt_tokens} tokens, and the model holds "
                               f"{model.max_seq_len} positions: shorten it")
    want = 128 if requested is None else requested
    if want > room:
        print(f"(answer limited to {room} tokens: the model holds {model.max_seq_len} "
              "positions)", file=sys.stderr)
    return min(want, room)


def stream_text(model, ids: list[int], max_tokens: int, options: dict, stats,
                out=None) -> tuple[list[int], float]:
    """Write the answer to ``out`` (stdout) as it is made; (its tokens, seconds to the
    first one)."""
    out = out or sys.stdout
    text = model.tokenizer.stream_decoder()
    start, first, tokens = time.perf_counter(), None, []
    for token in model.stream(ids, max_tokens, stats=stats, **options):
        if first is None:
            first = time.perf_counter() - start
        tokens.append(token)
        out.write(text.push(token))
        out.flush()
    out.write(text.flush())
    out.flush()
    return tokens, first or 0.0


def report(model, stats, first_token_s: float) -> None:
    from .models.memory import peak_bytes

    lines = [f"device {model.device.name}, {model.dtype}"]
    if model.load_stats is not None:
        ls = model.load_stats
        lines.append(f"load:    {ls.bytes_read / 1e9:.2f} GB in {ls.seconds:.2f} s, "
                     f"{ls.gb_per_s:.2f} GB/s")
    lines += [f"first token: {first_token_s * 1000:.0f} ms",
              f"prefill: {stats.prefill_tokens} tokens, {stats.prefill_tokens_per_s:.1f} tokens/s",
              f"decode:  {stats.decode_tokens} tokens, {stats.decode_tokens_per_s:.1f} tokens/s"]
    peak = peak_bytes(model.device)
    if peak is not None:
        lines.append(f"{peak[1]}: {peak[0] / 2**20:.1f} MiB")
    print("\n".join(lines), file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="needle generate",
                                description="Generate text with a local Hugging Face "
                                            "checkpoint (safetensors) of a supported family.")
    add_model_options(p)
    p.add_argument("--prompt", required=True, help="text to continue (or, with --chat, the "
                                                    "user's message)")
    p.add_argument("--chat", action="store_true",
                   help="render the prompt as a user turn with the model's chat template")
    p.add_argument("--system", default=None, help="with --chat: a system message first")
    add_tp_option(p)
    return p


def add_tp_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1,
                   help="split the model over this many tensor-parallel ranks (GPUs, or "
                        "CPU processes with --device cpu); see docs/distributed.md")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    from .distributed import tp_generate
    from .models import GenerationStats

    status = tp_generate.start(args, argv, "generate")
    if status is not None:
        return status

    if args.max_tokens is not None and args.max_tokens < 0:
        raise ModelFormatError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    tokenizer = tokenizer_of(args.model_dir)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": args.prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            return_dict=False)
    else:
        ids = tokenizer.encode(args.prompt)
    if not ids:
        raise ModelFormatError("the prompt encodes to no tokens; give some text")
    model = load(args, needed=len(ids) + (128 if args.max_tokens is None else args.max_tokens))
    model.tokenizer = tokenizer
    max_tokens = answer_budget(model, len(ids), args.max_tokens)
    stats = GenerationStats()
    sys.stdout.write("" if args.chat else args.prompt)
    _, first = stream_text(model, ids, max_tokens, sampling(args), stats)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.tp == 1:
        report(model, stats, first)
    else:
        from . import distributed

        if distributed.get_rank() == 0:
            report(model, stats, first)
        distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
