"""Serving benchmark (issue 14): continuous batching over the paged KV cache.

    python -m benchmarks.serving --device cuda            # TinyLlama-1.1B shapes, bf16
    python -m benchmarks.serving --device cpu --quick     # a tiny model: a smoke test
    python -m benchmarks.serving --device cpu --size 1.1b --streams 1,8 --tokens 8 --no-ttft

The model is TinyLlama-1.1B-shaped (hidden 2048, 22 layers, 32 heads, 4 KV heads, vocab
32000) with random bfloat16 weights made in memory, on a GPU; with ``--quick`` (or on a
CPU) a tiny one of the same family. Greedy decoding (``--temperature T --top-p P``: every
request samples, each with its own seed), end-of-sequence ignored, prompts of 128 random
tokens.

* **decode at N streams** (N = 1, 8, 32, 64): N requests decode together; after each has
  made ``--warmup`` tokens, the next ``--tokens`` steps are timed: aggregate tokens/s, and
  the p50/p99 inter-token latency (time between a stream's consecutive tokens). Beside
  them, ``model.generate`` (one sequence, the captured decode step) in the same run: the
  single-stream rate the 64-stream figure is compared with.
* **TTFT under load**: a 2,000-token prompt arrives while 32 streams decode; its time to
  first token, and the longest gap the 32 streams saw meanwhile (chunked prefill keeps
  them going), against the same prompt alone.
* **a follow-up turn**: a 2,000-token prompt answered with 64 tokens, then that history and
  32 new tokens as the next prompt: the next turn's time to first token with the prefix
  cache (the first turn's pages kept) and without it.

Prints a table; ``--json PATH`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

PROMPT = 128
LONG_PROMPT = 2000
FIRST_ANSWER, FOLLOW_UP = 64, 32  # the follow-up turn case
LAG = 32  # decode steps the first stream may be ahead of the last one (prompts read 512/step)
STREAMS = (1, 8, 32, 64)


def build_model(device, quick: bool, size: str = "auto"):
    """A random-weight Llama: 1.1B-shaped in bf16, or tiny; ``size`` "auto" is 1.1B on a
    GPU and tiny elsewhere (or with ``quick``)."""
    from needle.backends.api import has
    from needle.models import LlamaConfig, LlamaForCausalLM

    from .llm_models import TINY, TINYLLAMA, host_random_weights

    big = size == "1.1b" or (size == "auto" and not quick and device.name.startswith("cuda"))
    shapes, dtype = (TINYLLAMA, "bfloat16") if big else (TINY, "float32")
    if has(device.backend, "precompile"):  # kernels compile while the weights are made
        device.backend.precompile((dtype, "int32", "int64"))
    raw = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, **shapes}
    cfg = LlamaConfig.from_dict(raw, source="benchmark config")
    weights = host_random_weights(cfg, dtype)
    from needle.backend_ndarray import NDArray

    model = LlamaForCausalLM(cfg, lambda name, shape: NDArray(weights[name], device=device,
                                                                dtype=dtype),
                             LONG_PROMPT + 256, device, dtype)
    return model, ("1.1b" if big else "tiny")


class Clock:
    """Each request's token times, taken when the engine hands the token out."""

    def __init__(self):
        self.times: dict[int, list[float]] = {}

    def listener(self, rid: int):
        times = self.times.setdefault(rid, [])
        return lambda event: times.append(time.perf_counter())


def prompt(rng, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


def add_sampling_options(parser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample every request at this temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="with --temperature")


def sampling(args, seed: int):
    """Each request's settings: greedy, or the command's temperature and top-p."""
    from needle.serve import SamplingParams

    if not args.temperature:
        return SamplingParams()
    return SamplingParams(args.temperature, top_p=args.top_p, seed=seed)


def decode_at(engine, streams: int, warmup: int, tokens: int, rng, args) -> dict:
    """Aggregate tokens/s and inter-token latencies of ``streams`` decoding together."""
    from needle.serve import RequestParams

    vocab = engine.model.config.vocab_size
    clock = Clock()
    # The first requests decode while the last ones still read their prompts (up to ~20
    # steps for 64 streams); room for that lag keeps every stream running through the
    # timed steps, so that no stream finishes early and no smaller batch is captured
    # mid-measurement.
    reqs = []
    for i in range(streams):
        params = RequestParams(sampling(args, i), max_tokens=warmup + tokens + LAG,
                               ignore_eos=True)
        reqs.append(engine.submit(prompt(rng, PROMPT, vocab), params,
                                  listener=clock.listener(len(reqs))))
    while min(len(r.output) for r in reqs) < warmup:
        engine.step()
    made, start = engine.metrics.generated, time.perf_counter()
    for _ in range(tokens):
        engine.step()
    seconds = time.perf_counter() - start
    if any(r.finished for r in reqs):
        raise RuntimeError("a stream finished inside the timed steps: raise LAG")
    made = engine.metrics.generated - made
    # gaps between tokens made inside the timed steps (a stream's earlier tokens may fall in
    # steps that also read other streams' prompts)
    end = start + seconds
    gaps = np.concatenate([np.diff([x for x in t if start <= x <= end])
                           for t in clock.times.values()])
    for r in reqs:
        engine.cancel(r)
    engine.run_until_idle()
    return {"streams": streams, "tokens_per_s": made / seconds,
            "itl_p50_ms": float(np.percentile(gaps, 50) * 1e3),
            "itl_p99_ms": float(np.percentile(gaps, 99) * 1e3)}


def single_generate(model, tokens: int, rng, args) -> float:
    """model.generate's decode tokens/s for one sequence (the captured step), sampling as
    the streams do."""
    from needle.models.generate import GenerationStats

    ids = prompt(rng, PROMPT, model.config.vocab_size)
    s = sampling(args, 0)
    options = dict(temperature=s.temperature, top_p=s.top_p, seed=s.seed, stop=())
    model.generate(ids, 8, **options)  # warm-up: compile and capture
    stats = GenerationStats()
    model.generate(ids, tokens, stats=stats, **options)
    return stats.decode_tokens_per_s


def ttft(engine, background: int, warmup: int, rng) -> dict:
    """Time to first token of a LONG_PROMPT prompt, alone or while ``background`` streams
    decode; the longest gap between tokens the background streams saw meanwhile."""
    from needle.serve import RequestParams

    vocab = engine.model.config.vocab_size
    clock = Clock()
    runners = []
    for i in range(background):
        p = RequestParams(max_tokens=200, ignore_eos=True)
        runners.append(engine.submit(prompt(rng, PROMPT, vocab), p,
                                     listener=clock.listener(i)))
    while runners and min(len(r.output) for r in runners) < warmup:
        engine.step()
    arrival = time.perf_counter()
    big = engine.submit(prompt(rng, LONG_PROMPT, vocab), RequestParams(max_tokens=1))
    while not big.finished:
        engine.step()
    first = big.first_token_at - arrival
    gaps = [np.diff([t for t in times if t >= arrival] or [arrival]) for times in
            clock.times.values()]
    longest = max((float(g.max()) for g in gaps if g.size), default=0.0)
    for r in runners:
        engine.cancel(r)
    engine.run_until_idle()
    return {"background_streams": background, "ttft_ms": first * 1e3,
            "longest_background_gap_ms": longest * 1e3}


def follow_up(engine, rng, cache: bool) -> dict:
    """A conversation's next turn: a LONG_PROMPT prompt answered with FIRST_ANSWER tokens,
    then that history and FOLLOW_UP new tokens as the next prompt; the next turn's time to
    first token with the prefix cache on or off (the first turn alone as a reference)."""
    from needle.serve import RequestParams

    vocab = engine.model.config.vocab_size
    pool = engine.cache.pool
    kept, pool.cache_prefixes = pool.cache_prefixes, cache
    try:
        first = engine.submit(prompt(rng, LONG_PROMPT, vocab),
                              RequestParams(max_tokens=FIRST_ANSWER, ignore_eos=True))
        engine.run_until_idle()
        history = first.prompt + first.output + prompt(rng, FOLLOW_UP, vocab)
        nxt = engine.submit(history, RequestParams(max_tokens=1))
        engine.run_until_idle()
    finally:
        pool.cache_prefixes = kept
    return {"cache": cache, "prompt_tokens": len(history), "cached_tokens": nxt.cached_tokens,
            "first_turn_ttft_ms": (first.first_token_at - first.arrived) * 1e3,
            "ttft_ms": (nxt.first_token_at - nxt.arrived) * 1e3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__)
    p.add_argument("--device", default="auto")
    p.add_argument("--quick", action="store_true", help="a tiny model: a smoke test")
    p.add_argument("--size", choices=("auto", "tiny", "1.1b"), default="auto",
                   help="the model: 1.1B shapes (bf16) or tiny; auto: 1.1B on a GPU")
    p.add_argument("--warmup", type=int, default=8, help="tokens before timing")
    p.add_argument("--tokens", type=int, default=64, help="timed steps per case")
    p.add_argument("--streams", default=",".join(map(str, STREAMS)))
    add_sampling_options(p)
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="the engine's tokens a step (prompt chunks are cut to fit; default: "
                        "the engine's)")
    p.add_argument("--no-ttft", action="store_true",
                   help="skip the time-to-first-token cases (long prompts: slow on a CPU)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from needle.backend_ndarray import device_from_name
    from needle.serve import Engine

    device = device_from_name(args.device)
    if not device.enabled():
        print(f"device {device.name} is disabled: {device.reason}", file=sys.stderr)
        return 2
    streams = [int(s) for s in args.streams.split(",")]
    t0 = time.perf_counter()
    model, size = build_model(device, args.quick, args.size)
    print(f"built the {size} model on {device.name} in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    rng = np.random.default_rng(0)
    budget = (max(streams) * (PROMPT + args.warmup + args.tokens + LAG + 16)
              + 2 * (LONG_PROMPT + 64))
    from needle.serve.pages import PagedKVCache

    page_bytes = PagedKVCache.page_bytes(model.config, 16, model.dtype)
    engine = Engine(model, max_seqs=max(streams + [33]),
                    kv_memory=(budget // 16 + 64 * 4) * page_bytes,
                    max_batch_tokens=args.max_batch_tokens)
    decode_at(engine, min(streams), 2, 2, rng, args)  # warm-up: compile the kernels
    results = {"model": size, "device": device.name, "dtype": model.dtype, "decode": [],
               "max_batch_tokens": engine.scheduler.max_batch_tokens,
               "sampling": (f"temperature {args.temperature}, top-p {args.top_p}"
                            if args.temperature else "greedy"),
               "single_generate_tokens_per_s": single_generate(model, args.tokens, rng, args)}
    print(f"  generate: {results['single_generate_tokens_per_s']:.0f} tok/s", file=sys.stderr,
          flush=True)
    for n in streams:
        results["decode"].append(decode_at(engine, n, args.warmup, args.tokens, rng, args))
        print(f"  {results['decode'][-1]}", file=sys.stderr, flush=True)
    if not args.no_ttft:
        results["ttft_alone"] = ttft(engine, 0, args.warmup, rng)
        results["ttft_under_load"] = ttft(engine, 32, args.warmup, rng)
        results["follow_up"] = [follow_up(engine, rng, cache) for cache in (True, False)]
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def report(r: dict) -> None:
    single = r["single_generate_tokens_per_s"]
    print(f"\nserving: {r['model']} {r['dtype']} on {r['device']}, {r['sampling']}, "
          f"{r['max_batch_tokens']} tokens a step; "
          f"model.generate (one sequence, captured step): {single:.0f} tok/s")
    print(f"{'streams':>8} {'tok/s':>10} {'x single':>9} {'ITL p50 ms':>11} {'ITL p99 ms':>11}")
    for d in r["decode"]:
        print(f"{d['streams']:>8} {d['tokens_per_s']:>10.0f} {d['tokens_per_s'] / single:>9.1f}"
              f" {d['itl_p50_ms']:>11.2f} {d['itl_p99_ms']:>11.2f}")
    for key in ("ttft_alone", "ttft_under_load"):
        if key not in r:
            continue
        t = r[key]
        print(f"TTFT of a {LONG_PROMPT}-token prompt with {t['background_streams']} streams "
              f"decoding: {t['ttft_ms']:.1f} ms (longest gap of those streams: "
              f"{t['longest_background_gap_ms']:.1f} ms)")
    for f in r.get("follow_up", ()):
        print(f"TTFT of a follow-up turn ({LONG_PROMPT} + {FIRST_ANSWER} + {FOLLOW_UP} "
              f"tokens), prefix cache {'on' if f['cache'] else 'off'}: {f['ttft_ms']:.1f} ms "
              f"({f['cached_tokens']} of {f['prompt_tokens']} prompt tokens cached; the first "
              f"turn's {f['first_turn_ttft_ms']:.1f} ms)")


if __name__ == "__main__":
    sys.exit(main())
