"""``needle chat MODEL_DIR``: a multi-turn conversation with a local model in the terminal.

Each line read from stdin is one user turn (so ``printf 'hi\\nmore\\n' | needle chat M`` plays
two turns); the model's answer streams to stdout, rendered through its chat template with the
whole conversation so far. In a terminal a ``> `` prompt shows (on stderr); an empty line is
skipped, ``/reset`` starts a new conversation, ``/exit`` or end of input quits. The options are
``needle generate``'s; speeds go to stderr after each answer with ``--stats``.
"""

from __future__ import annotations

import argparse
import sys

from .generate_cli import (
    add_model_options,
    answer_budget,
    load,
    report,
    sampling,
    stream_text,
    tokenizer_of,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="needle chat",
                                description="Chat with a local model (one user turn per line "
                                            "of input).")
    add_model_options(p)
    p.add_argument("--system", default=None, help="a system message that starts the chat")
    p.add_argument("--stats", action="store_true", help="print speeds after each answer")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .models import GenerationStats

    tokenizer = tokenizer_of(args.model_dir)
    system = [{"role": "system", "content": args.system}] if args.system else []
    # render once now: a model without a chat template fails before it is loaded
    tokenizer.apply_chat_template(system + [{"role": "user", "content": "hi"}],
                                  add_generation_prompt=True, tokenize=False)
    model = load(args, needed=4096)
    model.tokenizer = tokenizer
    interactive = sys.stdin.isatty()
    messages = list(system)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": line})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            return_dict=False)
        while len(ids) >= model.max_seq_len and len(messages) > len(system) + 1:
            print(f"(the conversation outgrew the model's {model.max_seq_len} positions: "
                  "its oldest exchange is forgotten)", file=sys.stderr)
            messages = system + messages[len(system) + 2:]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                return_dict=False)
        stats = GenerationStats()
        tokens, first = stream_text(model, ids, answer_budget(model, len(ids),
                                                              args.max_tokens),
                                    sampling(args), stats)
        sys.stdout.write("\n")
        sys.stdout.flush()
        stop = set(model.generation_config.eos_token_ids)
        reply = tokenizer.decode([t for t in tokens if t not in stop])
        messages.append({"role": "assistant", "content": reply})
        if args.stats:
            report(model, stats, first)


if __name__ == "__main__":
    sys.exit(main())
