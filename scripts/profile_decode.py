"""Where does one decode step of the 1.1B benchmark model spend its time?

Prints the device time per kernel of eager decode steps (``backend.profile()``), the eager
wall time per step, and the time per step of the captured graph's replay: the difference
between the sum of kernel times and the replay time is launch gaps inside the graph.

    python scripts/profile_decode.py [--steps 20] [--small]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="the tiny config (a smoke test)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    from benchmarks import cases_llm
    from benchmarks.runner import Context

    import needle.backend_ndarray as nd
    from needle.models import Sampler

    dev = getattr(nd, args.device)()
    be = dev.backend
    ctx = Context(device=dev, frameworks={}, quick=args.small)
    m = cases_llm._Models(ctx)
    decoder = m.model.decoder()
    greedy = Sampler()
    token = greedy(decoder.prefill(cases_llm._prompt(128, m.config.vocab_size)[0]))
    n = args.steps

    prompt = cases_llm._prompt(m.prefill_len, m.config.vocab_size)[0]
    for _ in range(2):  # a bucket's first prefill runs eagerly, its second is captured
        decoder.prefill(prompt)
    be.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        decoder.prefill(prompt)
    be.synchronize()
    wall = (time.perf_counter() - t) / 3
    print(f"prefill {m.prefill_len}: wall {wall * 1e3:.2f} ms"
          f"{' (a captured graph replayed)' if decoder.prefills.captured else ''}")
    if hasattr(be, "profile"):
        # a replayed graph shows the profiler no kernels: profile an eager prefill
        limit, decoder.prefills.limit = decoder.prefills.limit, 0
        try:
            with be.profile() as prof:
                decoder.prefill(prompt)
        finally:
            decoder.prefills.limit = limit
        print("  eager prefill, profiled:")
        print(f"  device (sum of kernel times) {prof.total_ms:.2f} ms, "
              f"{sum(k.calls for k in prof.totals.values())} kernels")
        print(prof.table(14))
    token = greedy(decoder.prefill(cases_llm._prompt(128, m.config.vocab_size)[0]))

    decoder._capture = None  # eager first
    for _ in range(3):
        token = greedy(decoder.step(token))
    be.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        token = greedy(decoder.step(token))
    be.synchronize()
    eager = (time.perf_counter() - t) / n
    print(f"eager step: wall {eager * 1e3:.3f} ms")
    if not hasattr(be, "profile"):
        return
    with be.profile() as prof:
        for _ in range(n):
            decoder.step(token)
    kernels = sum(k.calls for k in prof.totals.values()) / n
    print(f"kernels {kernels:.0f} per step, device (sum of kernel times) "
          f"{prof.total_ms / n:.3f} ms")
    print(prof.table(40))

    decoder._capture = be.capture
    decoder.rewind(129)
    for _ in range(3):
        token = greedy(decoder.step(token))
    print("captured:", decoder.captured)
    be.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        decoder.step(token)
    be.synchronize()
    replay = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n):
        token = greedy(decoder.step(token))
    be.synchronize()
    sampled = (time.perf_counter() - t) / n
    for _ in range(3):
        token = decoder.greedy_step(token)
    be.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        token = decoder.greedy_step(token)
    on_device = (time.perf_counter() - t) / n
    print(f"greedy_step (argmax in the graph): {on_device * 1e3:.3f} ms/step = "
          f"{1 / on_device:.0f} tok/s")
    decoder.rewind(129)
    t = time.perf_counter()
    tokens = list(decoder.greedy_stream(token, n))
    streamed = (time.perf_counter() - t) / n
    print(f"greedy_stream (one step queued ahead): {streamed * 1e3:.3f} ms/step = "
          f"{1 / streamed:.0f} tok/s ({len(tokens)} tokens)")
    limit = m.streamed_bytes() / 1e9
    print(f"graph replay: {replay * 1e3:.3f} ms/step; with greedy sampling {sampled * 1e3:.3f} "
          f"ms/step = {1 / sampled:.0f} tok/s; weights {limit:.3f} GB "
          f"-> {limit / sampled:.0f} GB/s")


if __name__ == "__main__":
    main()
