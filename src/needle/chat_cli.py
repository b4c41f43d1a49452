"""``needle chat MODEL_DIR``: a multi-turn conversation with a local model in the terminal.

Each line read from stdin is one user turn (so ``printf 'hi\\nmore\\n' | needle chat M`` plays
two turns); the model's answer streams to stdout, rendered through its chat template with the
whole conversation so far. In a terminal a ``> `` prompt shows (on stderr); an empty line is
skipped, ``/reset`` starts a new conversation, ``/exit`` or end of input quits. The options are
``needle generate``'s; speeds go to stderr after each answer with ``--stats``. With ``--tp N``
the model is split over N ranks (``distributed/tp_generate.py``): rank 0 reads the turns and
writes the answers.
"""

from __future__ import annotations

import argparse
import sys

from .distributed import stdin_relay
from .generate_cli import (
    add_model_options,
    add_tp_option,
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
    add_tp_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    from . import distributed
    from .distributed import tp_generate

    status = tp_generate.start(args, argv, "chat")
    if status is not None:
        return status
    if args.tp == 1:
        return _chat(args, lead=True)
    status = _chat(args, lead=distributed.get_rank() == 0, share=tp_generate.shared_line)
    distributed.destroy_process_group()  # on failure the launcher stops the other ranks
    return status


def _read_turn(source, interactive: bool) -> str | None:
    """The next line of input without its newline, or None at its end or at /exit."""
    if interactive:
        print("> ", end="", file=sys.stderr, flush=True)
    line = source.readline()
    if not line or line.strip() == "/exit":
        return None
    return line.rstrip("\n")


def _chat(args, lead: bool, share=None) -> int:
    """The conversation. ``lead``: this process reads the turns and writes the answers
    (every process of a one-process chat; rank 0 of a tensor-parallel one, whose ``share``
    hands each turn to every rank)."""
    from .models import GenerationStats

    tokenizer = tokenizer_of(args.model_dir)
    system = [{"role": "system", "content": args.system}] if args.system else []
    # render once now: a model without a chat template fails before it is loaded
    tokenizer.apply_chat_template(system + [{"role": "user", "content": "hi"}],
                                  add_generation_prompt=True, tokenize=False)
    model = load(args, needed=4096)
    model.tokenizer = tokenizer
    source, interactive = stdin_relay.input_stream() if lead else (None, False)
    messages = list(system)
    while True:
        line = _read_turn(source, interactive) if lead else None
        if share is not None:
            line = share(line)
        if line is None:
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": line})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            return_dict=False)
        while len(ids) >= model.max_seq_len and len(messages) > len(system) + 1:
            if lead:
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
        if args.stats and lead:
            report(model, stats, first)


if __name__ == "__main__":
    sys.exit(main())
