"""Tensor-parallel inference of Llama-family models (Megatron-LM's split).

Each of the group's ranks holds 1/world_size of every layer: the query, key and value
projections of its share of the heads (column-parallel: whole output rows), the matching
columns of the output projection (row-parallel), and a share of the MLP's intermediate
units (gate and up by rows, down by columns). Attention needs no communication, since
heads are independent; the row-parallel projections each give a partial sum, made whole
by one all-reduce: one per attention block and one per MLP block. The output head is split
by vocabulary rows (vocabulary-parallel): each rank makes its share of the logits and one
all-gather gives every rank all of them, so every rank samples the same next token.
Embeddings and norms stay whole on every rank; so does a head tied to the embeddings, or
one whose rows do not divide evenly.

Each rank reads only its slices from the checkpoint before they reach the device, and
runs the ordinary decoder (``models/``) on a config of its share of the heads, with its
two row-parallel projections replaced by ones that all-reduce.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from .. import backend_ndarray as nd
from ..backend_ndarray import NDArray, dtypes
from ..errors import ModelFormatError
from ..models import memory
from ..models.causal_lm import CausalLM
from ..models.checkpoint import Checkpoint
from ..models.config import ModelConfig, read_json_object
from ..models.generation_config import GenerationConfig
from ..models.gguf import is_gguf
from ..models.loader import LoadStats, _dtype, _max_seq_len, build
from ..models.tokenizer import load_tokenizer
from ..models.weights import Projection
from .collectives import all_gather, all_reduce, symmetric_empty
from .group import group

# NCCL's symmetric all-reduce beats its ordinary one up to here (two H200s, bf16, 64 in a
# graph, benchmarks/distributed_allreduce_latency.py: 8 KiB 4.3 vs 6.6 µs, 32 KiB 6.2 vs
# 6.9) and loses above (64 KiB 8.1 vs 7.0, 128 KiB 11.0 vs 7.2)
SYMMETRIC_MAX_BYTES = 32 * 1024


@dataclasses.dataclass
class RowParallelProjection(Projection):
    """y = all_reduce(x @ weight_shard.T) (+ bias): the shards' partial sums, summed over
    the ranks; the bias (whole on every rank) is added once, after the sum."""

    def __call__(self, x: NDArray) -> NDArray:
        y = all_reduce(self.product(x).compact(), "sum")
        return y if self.bias is None else y + self.bias

    def add_into(self, h: NDArray, x: NDArray) -> NDArray:
        """x += all_reduce(h @ weight_shard.T), as the five fused decode operations add a
        projection into the residual stream x (the same on every rank): rank 0 adds its
        partial product into x (``nd.matvec_add``), the other ranks write theirs over x
        (their x is rank 0's, so the sum restores it), and one all-reduce of x in place sums
        them. A rank runs one product and one collective, no separate add or norm; x is the
        only buffer, so in the decoder's symmetric residual (``symmetric_empty``) the
        all-reduce takes NCCL's symmetric kernels."""
        if group().rank == 0:
            return all_reduce(super().add_into(h, x), "sum")
        return all_reduce(_product_into(h, self.weight, x), "sum")


def _product_into(h: NDArray, weight: NDArray, out: NDArray) -> NDArray:
    """out = h @ weight.T, written over ``out`` (compact, h's leading shape); weight dense."""
    if not isinstance(weight, NDArray) or not out.is_compact():
        raise ModelFormatError("a row-parallel projection adds into the residual stream with "
                               "dense weights and a compact residual")
    h = h.compact()
    dim, p = h.shape[-1], weight.shape[0]
    h.device.backend.matmul(h._handle, weight.compact()._handle, out._handle, h.size // dim,
                            dim, p, batch=1, stride_a=0, stride_b=0, transpose_a=False,
                            transpose_b=True)
    return out


@dataclasses.dataclass
class VocabParallelHead(Projection):
    """The output head, this rank's block of vocabulary rows: a product makes those logits
    and ``whole`` all-gathers the ranks' blocks into every rank's (..., vocab) logits. A
    rank reads 1/world_size of the head a token (Llama-3-8B's is 1 GB in bfloat16)."""

    def __call__(self, x: NDArray) -> NDArray:
        y = self.whole(self.product(x))
        return y if self.bias is None else y + self.bias

    def whole(self, y: NDArray) -> NDArray:
        share = y.shape[-1]
        blocks = all_gather(y)  # (world_size, *y.shape): rank r's block of columns is row r
        shape = (*y.shape[:-1], blocks.shape[0] * share)
        rows = y.size // share
        if rows == 1:  # a decode step: the blocks lie in vocabulary order already
            return blocks.reshape(shape)
        return blocks.reshape((blocks.shape[0], rows, share)).permute((1, 0, 2)) \
            .compact().reshape(shape)


def shard_config(cfg: ModelConfig, parts: int) -> ModelConfig:
    """The config of one rank's share: heads, KV heads and intermediate units / parts."""
    for what, n in (("attention heads", cfg.num_heads), ("key/value heads", cfg.num_kv_heads),
                    ("intermediate units", cfg.intermediate_size)):
        if n % parts:
            raise ModelFormatError(f"tensor parallelism over {parts} ranks needs the model's "
                                   f"{what} ({n}) to divide evenly; choose a world size that "
                                   f"divides {n}")
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // parts,
                               num_kv_heads=cfg.num_kv_heads // parts,
                               intermediate_size=cfg.intermediate_size // parts)


class Slicer:
    """Rank ``rank``'s slice of each checkpoint tensor of ``cfg`` (host arrays)."""

    def __init__(self, cfg: ModelConfig, rank: int, parts: int):
        self.rank, self.parts = rank, parts
        d = cfg.head_dim
        self.q, self.kv, self.inter = cfg.num_heads * d, cfg.num_kv_heads * d, \
            cfg.intermediate_size
        self.split_head = splits_head(cfg, parts)

    def shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this rank's slice of ``name``, given its shape in the rank's
        config (``shard_config``), which keeps the whole vocabulary."""
        if name == "lm_head.weight" and self.split_head:
            return (shape[0] // self.parts, *shape[1:])
        return tuple(shape)

    def _mine(self, a: np.ndarray, n: int, axis: int = 0) -> np.ndarray:
        """This rank's block of the first ``n`` entries' split along ``axis``."""
        size = n // self.parts
        index = [slice(None)] * a.ndim
        index[axis] = slice(self.rank * size, (self.rank + 1) * size)
        return a[tuple(index)]

    def __call__(self, name: str, a: np.ndarray) -> np.ndarray:
        q, kv, inter = self.q, self.kv, self.inter
        kind = name.rsplit(".", 1)[-1]  # weight or bias
        if any(f".{p}_proj." in name for p in "qkv"):
            return self._mine(a, a.shape[0])
        if ".qkv_proj." in name:  # fused (Phi-3): [q; k; v] rows
            parts = (a[:q], a[q:q + kv], a[q + kv:])
            return np.concatenate([self._mine(p, p.shape[0]) for p in parts])
        if ".gate_proj." in name or ".up_proj." in name:
            return self._mine(a, a.shape[0])
        if ".gate_up_proj." in name:  # fused (Phi-3): [gate; up] rows
            return np.concatenate([self._mine(a[:inter], inter), self._mine(a[inter:], inter)])
        if (".o_proj." in name or ".down_proj." in name) and kind == "weight":
            return self._mine(a, a.shape[1], axis=1)
        if name == "lm_head.weight" and self.split_head:
            return self._mine(a, a.shape[0])
        return a  # embeddings, norms, a tied or uneven head, row-parallel biases: whole


def splits_head(cfg: ModelConfig, parts: int) -> bool:
    """Whether tensor parallelism over ``parts`` ranks splits the output head by vocabulary
    rows: a head of its own (tied to the embeddings, every rank needs all of it for the
    lookup) whose rows divide evenly."""
    return parts > 1 and not cfg.tie_word_embeddings and cfg.vocab_size % parts == 0


def make_row_parallel(model: CausalLM) -> CausalLM:
    """Make each layer's output and down projections all-reduce their partial sums, and a
    head that holds a block of the vocabulary rows gather the ranks' logits (the model
    already holds one rank's shards, on a config from ``shard_config``). A decode step keeps
    its five fused operations a layer, two of them ending in an all-reduce."""
    w = model.weights
    for layer in w.layers:
        layer.o = RowParallelProjection(layer.o.weight, layer.o.bias)
        layer.down = RowParallelProjection(layer.down.weight, layer.down.bias)
    if w.lm_head.weight.shape[0] < model.config.vocab_size:
        w.lm_head = VocabParallelHead(w.lm_head.weight, w.lm_head.bias)
    # the decode step's residual stream, which the row-parallel projections all-reduce in
    # place: in symmetric memory where NCCL has it and it is small enough to gain
    hidden = model.config.hidden_size
    small = hidden * dtypes.ITEMSIZE[model.dtype] <= SYMMETRIC_MAX_BYTES
    model.transformer.decode_residual = (symmetric_empty((hidden,), model.dtype) if small
                                         else nd.empty((hidden,), model.dtype, model.device))
    model.transformer.plan_decode()  # the five fused operations add them via add_into
    return model


def _splittable_config(path: Path) -> ModelConfig:
    """The config of a checkpoint directory whose weights can be split: not a GGUF file, not
    quantized (their packed rows and groups are not split yet), with a clear error."""
    if is_gguf(path):
        raise ModelFormatError(f"{path} is a GGUF file; tensor parallelism (--tp) splits "
                               "Hugging Face checkpoint directories (bf16, fp16 or fp32 "
                               "safetensors): run the GGUF file on one device, without --tp")
    if not path.is_dir():
        raise ModelFormatError(f"{path} is not a directory; pass the folder holding "
                               "config.json and the safetensors weights")
    raw = read_json_object(path, "config.json")
    full = ModelConfig.from_dict(raw, source=str(path / "config.json"))
    if raw.get("quantization_config") is not None:
        raise ModelFormatError(f"{path} holds quantized weights (config.json has a "
                               "quantization_config); tensor parallelism (--tp) splits "
                               "unquantized checkpoints (bf16, fp16 or fp32): run this one on "
                               "one device, without --tp, or split the checkpoint it was "
                               "quantized from")
    return full


def load_tensor_parallel(path: str | Path, dtype: str | None = None,
                         max_seq_len: int | None = None) -> CausalLM:
    """Load this rank's share of the model in ``path`` onto the process group's device.

    Call it on every rank of the group (``init_process_group()`` first); every rank gets a
    ``CausalLM`` whose passes and ``generate`` give the whole model's results (all ranks
    must run the same calls, since each pass all-reduces).
    """
    path = Path(path)
    full = _splittable_config(path)
    g = group()
    local = shard_config(full, g.world_size)
    dtype = _dtype(dtype or full.dtype)
    max_seq_len = _max_seq_len(full, max_seq_len)
    device = g.device
    checkpoint = Checkpoint(path)
    shapes = full.tensor_shapes()
    for name, shape in shapes.items():
        checkpoint.info(name, shape)
    memory.check_fits(memory.estimate(local, dtype, max_seq_len), device, max_seq_len, dtype)
    slicer, read = Slicer(full, g.rank, g.world_size), 0

    def weights(name: str, shape: tuple[int, ...]) -> NDArray:
        nonlocal read
        host = np.ascontiguousarray(slicer(name, checkpoint.read(name, shapes[name])))
        if host.shape != slicer.shape(name, shape):
            raise ModelFormatError(f"{name}: rank {g.rank}'s slice has shape {host.shape}, "
                                   f"expected {slicer.shape(name, shape)}")
        read += host.nbytes
        return nd.array(host, dtype=dtype, device=device)

    model, seconds = build(local, weights, max_seq_len, device, dtype, checkpoint)
    make_row_parallel(model)
    model.load_stats = LoadStats(read, seconds)
    model.generation_config = GenerationConfig.read(path, full.eos_token_ids)
    model.tokenizer = load_tokenizer(path)
    return model
