"""The ``needle`` command: ``devices``, ``demo``, ``bench``, ``generate``, ``chat``, ``warmup``,
``serve``, ``quantize``, ``finetune``, ``perplexity``, ``run``.

Each subcommand's module is imported only when it runs, so ``needle devices`` works even
where optional dependencies (scikit-learn, tokenizers, a GPU) are missing.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .errors import NeedleError


def _devices(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="needle devices",
                                     description="List needle's devices with status and reason.")
    parser.parse_args(argv)
    from .backend_ndarray import all_devices, default_device

    best = default_device()
    rows = []
    for dev in all_devices():
        status = "enabled" if dev.enabled() else "disabled"
        mark = "*" if dev == best else " "
        rows.append((f"{mark} {dev.name}", status, dev.reason or ""))
    width = max(len(r[0]) for r in rows)
    for name, status, reason in rows:
        print(f"{name:<{width}}  {status:<8}  {reason}".rstrip())
    print("(* default device; set NEEDLE_DEVICE to choose another)")
    return 0


def _bench(argv: list[str]) -> int:
    """Run the benchmark runner in ``benchmarks/`` of a needle checkout."""
    sys.path.insert(0, os.getcwd())
    try:
        runner = importlib.import_module("benchmarks.__main__")
    except ImportError:
        print("needle bench: run it from the root of a needle checkout "
              "(the benchmarks/ folder is not part of the installed package)", file=sys.stderr)
        return 2
    return runner.main(argv) or 0


_COMMANDS = {
    "devices": (_devices, "list devices with status and reason"),
    "demo": ("needle.demo", "train a small CNN on scikit-learn's digits"),
    "bench": (_bench, "time needle against numpy and PyTorch (from a checkout)"),
    "generate": ("needle.generate_cli", "generate text with a local language model"),
    "chat": ("needle.chat_cli", "chat with a local language model (one turn per line)"),
    "warmup": ("needle.warmup_cli", "compile a device's kernels ahead of use"),
    "serve": ("needle.serve_cli", "an OpenAI-compatible server for a local language model"),
    "quantize": ("needle.quantize_cli", "write an int8/int4 quantized copy of a model"),
    "finetune": ("needle.finetune_cli", "fine-tune a model on a data file (full or LoRA)"),
    "perplexity": ("needle.perplexity_cli", "a language model's perplexity on a text file"),
    "run": ("needle.distributed.launcher", "run N ranks of a script (distributed jobs)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-V", "--version"):
        from importlib.metadata import version

        print(f"needle {version('needle')}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        unknown = bool(argv) and argv[0] not in ("-h", "--help")
        out = sys.stderr if unknown else sys.stdout
        if unknown:
            print(f"needle: unknown command {argv[0]!r}", file=out)
        print("usage: needle [--version] {" + ",".join(_COMMANDS) + "} [options]\n", file=out)
        for name, (_, help_) in _COMMANDS.items():
            print(f"  {name:<10} {help_}", file=out)
        return 2 if unknown else 0
    target, _ = _COMMANDS[argv[0]]
    try:
        if isinstance(target, str):
            return importlib.import_module(target).main(argv[1:]) or 0
        return target(argv[1:])
    except NeedleError as e:
        print(f"needle {argv[0]}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
