"""Tensor-parallel decode speed on a model of Llama-3-8B's shapes (weights made on the
device, not read: the speed of a decode step does not depend on their values):

    needle run -n 1 --backend nccl benchmarks/distributed_tp_decode.py    # one GPU
    needle run -n 2 --backend nccl benchmarks/distributed_tp_decode.py    # TP=2
    needle run -n 2 --backend mpi benchmarks/distributed_tp_decode.py --shapes tiny --dtype float32

Rank 0 prints greedy decode tokens/s (the captured decode step where the backend records
graphs) and prefill tokens/s; the issue's target is TP=2 >= 1.6x the one-GPU figure.
"""

from __future__ import annotations

import argparse
import math

from needle import backend_ndarray as nd
from needle import distributed as dist
from needle.distributed.tensor_parallel import Slicer, make_row_parallel, shard_config
from needle.models import GenerationStats
from needle.models.causal_lm import CausalLM
from needle.models.config import ModelConfig

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
}


def config(shapes: str) -> ModelConfig:
    raw = dict(SHAPES[shapes], architectures=["LlamaForCausalLM"], max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_theta=500000.0, eos_token_id=SHAPES[shapes]["vocab_size"]
               - 1)
    return ModelConfig.from_dict(raw)


def build(shapes: str, dtype: str, length: int, g) -> CausalLM:
    """This rank's share of a model of ``shapes`` (constant weights made on the device),
    ``length`` positions, its row-parallel projections all-reducing over the group ``g``."""
    full = config(shapes)
    cfg = shard_config(full, g.world_size)
    slicer = Slicer(full, g.rank, g.world_size)  # for the shape of the head's share

    def weights(name: str, shape: tuple[int, ...]) -> nd.NDArray:
        shape = slicer.shape(name, shape)
        value = 1.0 if name.endswith("norm.weight") else 0.5 / math.sqrt(shape[-1])
        return nd.full(shape, value, dtype, g.device)

    model = CausalLM(cfg, weights, length, g.device, dtype)
    if g.world_size > 1:
        make_row_parallel(model)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="llama3-8b", choices=SHAPES)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=256, help="tokens decoded")
    args = p.parse_args()
    g = dist.init_process_group()
    full = config(args.shapes)
    model = build(args.shapes, args.dtype, args.prompt + max(args.tokens, 8) + 1, g)
    prompt = [i % full.vocab_size for i in range(1, args.prompt + 1)]
    # warm-up: the first prefill of a bucket runs eagerly (compiles), the second is
    # captured, later ones replay (models/prefill_graphs.py); decode steps likewise
    for _ in range(2):
        model.generate(prompt, max_new_tokens=8, temperature=0)
    stats = GenerationStats()
    model.generate(prompt, max_new_tokens=args.tokens, temperature=0, stats=stats)
    if g.rank == 0:
        print(f"TP={g.world_size} {args.shapes} {args.dtype} on {g.device.name} "
              f"({g.backend.name}): decode {stats.decode_tokens_per_s:.1f} tok/s "
              f"({stats.decode_tokens} tokens), prefill {stats.prefill_tokens_per_s:.0f} tok/s "
              f"({stats.prefill_tokens} tokens)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
