"""Where a batched serving step's time goes (CUDA; docs/serving.md).

Builds the benchmark's 1.1B-shaped engine, lets N streams (default 64) decode, then prints:
the engine's step time, the captured step replayed alone (the GPU's share), each layer op
captured 20 times in a graph (its cost inside the step), and the projections against cuBLAS
(torch, also in a CUDA graph) and the HBM floor at 3 TB/s.

    python scripts/profile_serving.py [--streams 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.profile_gemv import per_op  # noqa: E402

SHAPES = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (11264, 2048),
          "down": (2048, 5632), "lm_head": (32000, 2048)}


def replay_seconds(replay, synchronize, times: int = 10) -> float:
    """Seconds per call of ``replay`` (a graph's launch), the device drained around them."""
    replay()
    synchronize()
    t = time.perf_counter()
    for _ in range(times):
        replay()
    synchronize()
    return (time.perf_counter() - t) / times


def cublas_us(m: int, n: int, k: int, reps: int = 20) -> float:
    """torch's x @ W.T (cuBLAS) captured ``reps`` times in a CUDA graph, µs per product."""
    import torch

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x @ w.t()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                x @ w.t()
    return replay_seconds(graph.replay, torch.cuda.synchronize) / reps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--streams", type=int, default=64)
    args = p.parse_args()
    from benchmarks.serving import PROMPT, build_model, prompt

    from needle import backend_ndarray as nd
    from needle.serve import Engine, RequestParams
    from needle.serve.pages import PagedKVCache

    dev = nd.cuda()
    model, _ = build_model(dev, False)
    n = args.streams
    page_bytes = PagedKVCache.page_bytes(model.config, 16, model.dtype)
    engine = Engine(model, max_seqs=n, kv_memory=(n * 300 // 16 + 256) * page_bytes)
    rng = np.random.default_rng(0)
    params = RequestParams(max_tokens=200, ignore_eos=True)
    reqs = [engine.submit(prompt(rng, PROMPT, model.config.vocab_size), params)
            for _ in range(n)]
    while min(len(r.output) for r in reqs) < 8:
        engine.step()
    dev.synchronize()
    t = time.perf_counter()
    for _ in range(32):
        engine.step()
    dev.synchronize()
    step = (time.perf_counter() - t) / 32
    bucket = engine.graphs.bucket(n)
    graph = engine.graphs._recorded[bucket][0]
    be = dev.backend
    replay = replay_seconds(graph.replay, be.synchronize, 50)
    print(f"{n} streams: engine.step {step * 1e3:.2f} ms ({n / step:.0f} tok/s); "
          f"the captured step alone {replay * 1e3:.2f} ms")
    cfg, batch = model.config, engine.graphs._inputs[bucket]
    layer = model.transformer.weights.layers[0]

    def rand(*shape):
        return nd.array(rng.standard_normal(shape).astype(np.float32), device=dev) \
            .astype("bfloat16")

    q, x, xm = rand(bucket, cfg.num_heads, cfg.head_dim), rand(1, bucket, 2048), \
        rand(1, bucket, 5632)
    ops = {
        "paged_attention": lambda: nd.paged_attention(q, engine.cache.keys[0],
                                                      engine.cache.values[0], batch.tables,
                                                      batch.seq_of, batch.positions),
        "add_rmsnorm": lambda: nd.add_rmsnorm(x, x, layer.attn_norm, 1e-5),
    }
    for name, op in ops.items():
        print(f"  {name:<16} {per_op(be, op) * 1e6:7.1f} us")
    print(f"  {'projection':<16} {'needle':>7} {'cuBLAS':>7} {'HBM floor':>9}  (us, M={bucket})")
    for name, (rows, k) in SHAPES.items():
        w = rand(rows, k).transpose()
        a = xm if k == 5632 else x
        ours = per_op(be, lambda a=a, w=w: a @ w) * 1e6
        print(f"  {name:<16} {ours:7.1f} {cublas_us(bucket, rows, k):7.1f} "
              f"{rows * k * 2 / 3.0e12 * 1e6:9.1f}")


if __name__ == "__main__":
    main()
