"""``needle serve MODEL_DIR``: an OpenAI-compatible server for a local model.

    needle serve models/Llama-3.2-1B-Instruct --port 8000 --max-seqs 32 --kv-memory 4GiB

Endpoints: /v1/completions, /v1/chat/completions (streaming or not), /v1/models, /health,
/metrics (Prometheus) and a chat page at /. Ctrl-C finishes the running answers, then
exits. ``--tp N`` splits the model over N GPUs (or CPU processes): rank 0 serves, the others
run each step beside it (``serve/tp_engine.py``). See docs/serving.md.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from pathlib import Path

from .errors import NeedleError
from .generate_cli import add_tp_option

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MB', '1e9' or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use e.g. 4GiB, 512MB or a "
                                         "number of bytes")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the KV memory must be positive")
    return int(value)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0..65535)")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="needle serve", description="An OpenAI-compatible server "
                                "for a local language model (docs/serving.md).")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    p.add_argument("--max-seqs", type=_positive, default=32,
                   help="sequences decoded together (default 32)")
    p.add_argument("--kv-memory", type=parse_bytes, default=None,
                   help="bytes of the KV page pool, e.g. 4GiB (default: max-seqs sequences "
                        "of max-seq-len positions); with --tp, each rank's")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 requests")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the directory's name)")
    p.add_argument("--max-queue", type=_positive, default=1024,
                   help="waiting requests beyond which new ones get HTTP 429")
    p.add_argument("--device", default="auto", help="auto, cpu, cpu_numpy, cuda[:i] or metal")
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="default: the checkpoint's own")
    p.add_argument("--max-seq-len", type=_positive, default=None,
                   help="prompt plus answer positions per sequence")
    p.add_argument("--adapter", default=None,
                   help="a LoRA adapter directory (PEFT's format) merged into the weights")
    p.add_argument("--max-batch-tokens", type=_positive, default=None,
                   help="tokens a step: decode tokens plus prompt chunks (default 2048, or "
                        "twice --max-seqs); smaller cuts long prompts into more steps")
    p.add_argument("--tool-call-parser", default="auto",
                   choices=("auto", "hermes", "llama3_json", "mistral", "none"),
                   help="how answers are read for tool calls (default auto: from the chat "
                        "template; none: tools are refused unless tool_choice is none)")
    p.add_argument("--reasoning-parser", default="auto", choices=("auto", "think", "none"),
                   help="how chat answers' thinking (<think>...</think>) is returned as "
                        "reasoning_content apart from the content (default auto: where the "
                        "chat template mentions <think>; none: all of it as content)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="forget a finished request's KV pages at once (default: keep them "
                        "for prompts that begin alike, such as a conversation's next turn, "
                        "until the pages are needed)")
    add_tp_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    if args.adapter is not None and args.tp > 1:
        parser().error("--adapter with --tp: merge the adapter first (needle finetune --merge)")
    if not Path(args.model_dir).exists():  # before the extra's check: fix the path first
        print(f"needle serve: {args.model_dir} does not exist; pass a Hugging Face model "
              "directory or a .gguf file", file=sys.stderr)
        return 1
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print("needle serve: the server needs starlette and uvicorn: "
              "pip install 'needle[serve]'", file=sys.stderr)
        return 2
    from .distributed import tp_generate

    try:
        status = tp_generate.start(args, argv, "serve")
    except NeedleError as e:
        return _failed(e)
    if status is not None:  # the ranks ran (and stopped) in processes of their own
        return status
    if args.tp == 1:
        return _serve(args)
    from . import distributed

    status = _serve(args) if distributed.get_rank() == 0 else _follow(args)
    if status == 0:  # a failed rank leaves at once: the launcher stops the others
        distributed.destroy_process_group()
    return status


def _engine(args):
    """The model and the engine of this process (its share of the model with --tp)."""
    from .serve import Engine

    options = dict(max_seqs=args.max_seqs, kv_memory=args.kv_memory, max_queue=args.max_queue,
                   max_batch_tokens=args.max_batch_tokens, prefix_cache=args.prefix_cache)
    if args.tp == 1:
        from .models import load_pretrained

        model = load_pretrained(args.model_dir, device=args.device, dtype=args.dtype,
                                max_seq_len=args.max_seq_len, adapter=args.adapter)
        return model, Engine(model, **options)
    from . import distributed
    from .serve.tp_engine import TensorParallelEngine

    model = distributed.load_tensor_parallel(args.model_dir, dtype=args.dtype,
                                             max_seq_len=args.max_seq_len)
    lead = distributed.get_rank() == 0
    return model, (TensorParallelEngine if lead else Engine)(model, **options)


def _serve(args) -> int:
    from .serve.server import serve

    try:
        model, engine = _engine(args)
    except NeedleError as e:
        return _failed(e)
    pool = engine.cache.pool
    name = args.model_name or Path(args.model_dir).resolve().name
    where = model.device.name if args.tp == 1 else f"{args.tp} ranks ({model.device.kind})"
    print(f"needle serve: {name} on {where} ({model.dtype}); KV pool "
          f"{pool.num_pages} pages of {pool.page_size} positions, prefix cache "
          f"{'on' if pool.cache_prefixes else 'off'}; up to {args.max_seqs} sequences, "
          f"{engine.scheduler.max_batch_tokens} tokens a step; "
          f"http://{args.host}:{args.port}/", file=sys.stderr)
    # uvicorn drains on SIGINT and SIGTERM alike, then raises the signal again: a SIGTERM
    # (a service manager, or `needle serve --tp`'s launcher) then ends here as Ctrl-C does,
    # instead of killing the process before it lets the other ranks go
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve(engine, name, args.host, args.port, args.api_key,
              tool_call_parser=args.tool_call_parser,
              reasoning_parser=args.reasoning_parser)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        engine.shutdown()  # a no-op after the server's own (with --tp: lets the ranks go)
    print("needle serve: stopped (running answers were finished)", file=sys.stderr)
    return 0


def _failed(e: NeedleError) -> int:
    print(f"needle serve: {type(e).__name__}: {e}", file=sys.stderr)
    return 1


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _follow(args) -> int:
    """A rank other than 0: run the steps rank 0 sends until it stops. Ctrl-C and SIGTERM
    are rank 0's to act on (it finishes the running answers, which needs this rank)."""
    from .serve.tp_engine import follow

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        _, engine = _engine(args)
    except NeedleError as e:
        return _failed(e)
    follow(engine)
    return 0
