"""The captured 1.1B greedy step (bf16, random weights) over a cache of the loader's default
4,096 positions, with the decoder's bands (``Decoder.bands``: on sm_90 a step reading at
most 2,048 positions records the cluster decode kernel) and with one band, alternated in one
process at several positions; medians in ms a token and the change.

    python scripts/probe_decode_bands.py [--positions 300,640,1088,1800,2100,3000]
        [--steps 20] [--rounds 2] [--capacity 4096] [--shapes tinyllama|llama3.2-1b]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# Llama-3.2-1B's shapes (random values; its rope scaling changes no cost): 16 layers of
# 64-wide heads, 8 KV heads, a 128,256-token vocabulary tied to the embedding
LLAMA32_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                  rope_theta=500000.0, tie_word_embeddings=True)


def _step_ms(decoder, start: int, prompt, steps: int, sync) -> float:
    """Median over 7 runs of ``steps`` greedy steps from position ``start``."""
    decoder.prefill(prompt[:start])
    token = 5
    for _ in range(4):  # each band's eager step and capture
        token = decoder.greedy_step(token)
    times = []
    for _ in range(7):
        decoder.rewind(start)
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            token = decoder.greedy_step(token)
        sync()
        times.append((time.perf_counter() - t) / steps * 1e3)
    return statistics.median(times)


def _crossing_ms(decoder, bound: int, prompt, sync) -> list[float]:
    """Each of 12 greedy steps (synchronized one by one) from 6 positions before ``bound``:
    the first two past it are the new band's eager step and its capture."""
    decoder.prefill(prompt[:bound - 6])
    token, times = 5, []
    for _ in range(12):
        sync()
        t = time.perf_counter()
        token = decoder.greedy_step(token)
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def main() -> None:
    import numpy as np
    from benchmarks.llm_models import TINYLLAMA, hf_config, host_random_weights

    import needle.backend_ndarray as nd
    from needle.models import LlamaConfig, LlamaForCausalLM
    from needle.models.decoder import Decoder

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--positions", default="300,640,1088,1800,2100,3000")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--shapes", choices=("tinyllama", "llama3.2-1b"), default="tinyllama")
    args = ap.parse_args()
    positions = [int(p) for p in args.positions.split(",")]
    if max(positions) + 4 + args.steps > args.capacity:
        ap.error(f"positions up to {max(positions)} leave no room for the steps in a cache "
                 f"of {args.capacity}")
    dev = nd.cuda()
    shapes = TINYLLAMA if args.shapes == "tinyllama" else LLAMA32_1B
    cfg = LlamaConfig.from_dict({**hf_config(shapes, args.capacity), **shapes},
                                source="probe config")
    host = host_random_weights(cfg, "bfloat16")
    model = LlamaForCausalLM(
        cfg, lambda name, shape: nd.NDArray(host[name], device=dev, dtype="bfloat16"),
        args.capacity, dev, "bfloat16")
    decoders = {"one band": Decoder(model), "bands": Decoder(model)}
    decoders["one band"].bands = (args.capacity,)
    print(f"{dev.name}, {args.shapes}: bands {decoders['bands'].bands}", flush=True)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, args.capacity)
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for start in positions:
            for name, decoder in decoders.items():
                ms = _step_ms(decoder, start, prompt, args.steps, dev.backend.synchronize)
                times.setdefault((start, name), []).append(ms)
    bound = decoders["bands"].bands[0]
    if bound < args.capacity:  # a fresh decoder: its second band not yet recorded
        steps = _crossing_ms(Decoder(model), bound, prompt, dev.backend.synchronize)
        print(f"steps across {bound} (lengths {bound - 5}..{bound + 6}), ms: "
              + " ".join(f"{t:.2f}" for t in steps))
    for start in positions:
        one, banded = times[(start, "one band")], times[(start, "bands")]
        change = statistics.median(banded) / statistics.median(one) - 1
        print(f"position {start:5d}: one band {' / '.join(f'{t:.4f}' for t in one)} ms, "
              f"bands {' / '.join(f'{t:.4f}' for t in banded)} ms ({change:+.1%})")


if __name__ == "__main__":
    main()
