"""Decode speed of the 1.1B benchmark model under several CUDA tunings, in one process.

Each setting captures its own decode step (a new decoder) and streams greedy tokens at a
short position (after a 128-token prompt) and far into the cache (after the family's long
prompt); tok/s and % of the copy-bandwidth limit (weights + the KV bytes read per token) are
printed per setting, medians of a few rounds, so that A/B choices are compared in one run.

    python scripts/sweep_decode.py [--tokens 128] [--rounds 3] \
        --set default --set splits=64 --set attention=split
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _tuning(setting: str) -> dict:
    """"splits=64:attention=split" -> backend.tuned() keywords."""
    changes = {}
    for part in filter(None, setting.split(":")):
        key, _, value = part.partition("=")
        if key == "splits":
            changes["decode_splits"] = int(value)
        elif key == "attention":
            changes["decode_attention"] = value
        else:
            raise SystemExit(f"unknown setting {key!r} (splits=N or attention=flash|split)")
    return changes


def _rate(model, start: int, tokens: int, rounds: int, vocab: int) -> float:
    """Median seconds per token of greedy_stream from position ``start``."""
    from benchmarks.cases_llm import _prompt

    from needle.models.decoder import Decoder

    decoder = Decoder(model)  # its own capture, made under this setting's tuning
    decoder.prefill([int(t) for t in _prompt(start, vocab)[0]])
    token = decoder.greedy_step(7)  # eager, then captured
    token = decoder.greedy_step(token)
    times = []
    for _ in range(rounds):
        decoder.rewind(start + 2)
        t = time.perf_counter()
        streamed = list(decoder.greedy_stream(token, tokens))
        times.append((time.perf_counter() - t) / tokens)
    assert len(streamed) == tokens
    return statistics.median(times)


def _copy_bandwidth(nd, dev) -> float:
    """Bytes per second a device copy of 1 GiB moves (read + write), best of five."""
    x = nd.empty((2**28,), dtype="float32", device=dev)
    best = float("inf")
    for _ in range(6):
        dev.backend.synchronize()
        t = time.perf_counter()
        x.copy()
        dev.backend.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * 2**30 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], dest="settings")
    ap.add_argument("--no-long", action="store_true", help="only the short position")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="the tiny config (a smoke test)")
    args = ap.parse_args()

    from benchmarks import cases_llm
    from benchmarks.llm_models import kv_bytes_per_position
    from benchmarks.runner import Context

    import needle.backend_ndarray as nd

    dev = nd.device_from_name(args.device)
    be = dev.backend
    ctx = Context(device=dev, frameworks={}, quick=args.small)
    m = cases_llm._Models(ctx)
    bw = _copy_bandwidth(nd, dev)
    weights = m.streamed_bytes()
    kv = kv_bytes_per_position(m.config, m.dtype)
    long_start = m.family.long_prompt
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; weights {weights / 1e9:.3f} GB; "
          f"long position {long_start}")
    rows = []
    for setting in args.settings or ["default"]:
        changes = _tuning("" if setting == "default" else setting)
        with be.tuned(**changes) if changes else contextlib.nullcontext():
            short = _rate(m.model, cases_llm.DECODE_PROMPT, args.tokens, args.rounds,
                          m.config.vocab_size)
            far = None if args.no_long else _rate(m.long_model(), long_start, args.tokens,
                                                  args.rounds, m.config.vocab_size)
        rows.append((setting, short, far))
        print(rows[-1], flush=True)
    print(f"{'setting':<28} {'short tok/s':>11} {'% limit':>7} {'long tok/s':>10} {'% limit':>7}")
    for setting, short, far in rows:
        limit_s = (weights + kv * cases_llm.DECODE_PROMPT) / bw
        line = f"{setting:<28} {1 / short:>11.0f} {100 * limit_s / short:>6.1f}%"
        if far is not None:
            limit_l = (weights + kv * long_start) / bw
            line += f" {1 / far:>10.0f} {100 * limit_l / far:>6.1f}%"
        print(line)


if __name__ == "__main__":
    main()
