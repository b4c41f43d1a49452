"""Tensor-parallel serving throughput (``needle serve --tp N``'s engine) on a model of
Llama-3-8B's shapes (constant weights made on the device, as distributed_tp_decode.py):

    needle run -n 1 --backend nccl benchmarks/distributed_tp_serve.py    # one GPU
    needle run -n 2 --backend nccl benchmarks/distributed_tp_serve.py    # TP=2
    needle run -n 2 --backend mpi benchmarks/distributed_tp_serve.py --shapes tiny --dtype float32

Rank 0 runs the engine (``TensorParallelEngine``: each step sent to the other ranks, which
run it beside it) and prints, for N streams decoding together (greedy, or sampling with
``--temperature T --top-p P``; 128-token prompts),
the aggregate tokens/s and the p50 / p99 time between a stream's tokens, measured as
``benchmarks/serving.py`` measures one GPU.
"""

from __future__ import annotations

import argparse

import numpy as np

from distributed_tp_decode import SHAPES, build
from needle import distributed as dist
from needle.serve import Engine
from needle.serve.tp_engine import TensorParallelEngine, follow
from serving import LAG, PROMPT, add_sampling_options, decode_at


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="llama3-8b", choices=SHAPES)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", default="1,8,32,64")
    p.add_argument("--warmup", type=int, default=8, help="tokens before timing")
    p.add_argument("--tokens", type=int, default=64, help="timed steps per case")
    add_sampling_options(p)
    args = p.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    g = dist.init_process_group()
    model = build(args.shapes, args.dtype, PROMPT + args.warmup + args.tokens + LAG + 16, g)
    options = dict(max_seqs=max(streams), max_batch_tokens=max(512, 2 * max(streams)))
    if g.rank != 0:
        follow(Engine(model, **options))
        dist.destroy_process_group()
        return
    engine = (TensorParallelEngine if g.world_size > 1 else Engine)(model, **options)
    rng = np.random.default_rng(0)
    decode_at(engine, min(streams), args.warmup, 8, rng, args)  # compile and capture
    rows = [decode_at(engine, n, args.warmup, args.tokens, rng, args) for n in streams]
    engine.shutdown()
    how = f"temperature {args.temperature}, top-p {args.top_p}" if args.temperature \
        else "greedy"
    print(f"TP={g.world_size} serving {args.shapes} {args.dtype} on {g.device.name} "
          f"({g.backend.name}), {how}")
    for r in rows:
        print(f"TP={g.world_size} streams {r['streams']:3d}: {r['tokens_per_s']:9.1f} tok/s, "
              f"inter-token p50 {r['itl_p50_ms']:.2f} ms, p99 {r['itl_p99_ms']:.2f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
