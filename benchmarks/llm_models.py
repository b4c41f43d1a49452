"""The models the LLM cases (``cases_llm.py``) time, built once per run and shared by cases.

Two families, each needle's model plus the peers that run it on the same weights:

* ``1.1b`` (TinyLlama-1.1B shapes; ``tiny`` on a CPU or with ``--quick``): random weights
  made on the host from a fixed seed, copied to needle and to a transformers twin. A second
  needle model over the same weights holds a cache long enough for the long-context cases.
* ``8b`` (Llama-3-8B shapes, 16 GB of bf16; ``8b_tiny`` on a CPU or with ``--quick``):
  random weights made *on the device* (see ``DeviceRandom``), no transformers twin.

Both get the gpt-fast-style PyTorch peer (``torch_llama.py``) over needle's own weight
arrays, viewed through DLPack.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from needle.backend_ndarray.dtypes import ITEMSIZE, to_numpy_dtype

from .runner import Context, Skip

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)
TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
# Llama-3-8B: the same shapes, random values, plain RoPE (its rope scaling changes no cost)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 rope_theta=500000.0)
# 8B's proportions (4 query heads per KV head, intermediate 3.5 x hidden) at a tiny size
TINY_8B = dict(hidden_size=128, intermediate_size=448, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
               rope_theta=500000.0)


@dataclass(frozen=True)
class Family:
    """One model family's sizes on this device."""

    key: str  # "1.1b" or "8b": which builder
    size: str  # the size as case names spell it: "1.1b", "tiny", "8b", "8b_tiny"
    shapes: dict
    dtype: str
    prefill: int  # tokens of the prefill case
    long_prompt: int  # the long-context cases' position
    long_window: int  # ... and how many positions they decode past it before rewinding


def families(ctx: Context) -> dict[str, Family]:
    big = ctx.gpu and not ctx.quick
    dtype = "bfloat16" if ctx.gpu else "float32"
    if big:
        return {"1.1b": Family("1.1b", "1.1b", TINYLLAMA, dtype, 2048, 8000, 256),
                "8b": Family("8b", "8b", LLAMA3_8B, dtype, 0, 0, 0)}
    return {"1.1b": Family("1.1b", "tiny", TINY, dtype, 64, 200, 32),
            "8b": Family("8b", "8b_tiny", TINY_8B, dtype, 0, 0, 0)}


def hf_config(shapes: dict, max_positions: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": max_positions,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
            **shapes}


def weight_bytes(cfg, dtype: str) -> int:
    """Weight bytes one decode step reads: all but the embedding table (one row of it)."""
    total = sum(int(np.prod(s)) for s in cfg.tensor_shapes().values())
    return (total - cfg.vocab_size * cfg.hidden_size + cfg.hidden_size) * ITEMSIZE[dtype]


def kv_bytes_per_position(cfg, dtype: str) -> int:
    """Bytes of keys and values one position holds, all layers: what a decode step reads
    per cached position."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * ITEMSIZE[dtype]


# --- weights ----------------------------------------------------------------------------------

def host_random_weights(cfg, dtype: str) -> dict[str, np.ndarray]:
    """Uniform weights of std 0.02 (norm scales near 1), in the model's dtype on the host."""
    rng = np.random.default_rng(0)
    amplitude = np.float32(0.02 * np.sqrt(3))
    out = {}
    for name, shape in cfg.tensor_shapes().items():
        if name.endswith("norm.weight"):
            x = 1 + 0.1 * rng.random(shape, dtype=np.float32)
        else:
            x = (rng.random(shape, dtype=np.float32) * 2 - 1) * amplitude
        out[name] = x.astype(to_numpy_dtype(dtype))
    return out


class DeviceRandom:
    """A weight source making every tensor on the device from a few random host blocks.

    Making 16 GB of random numbers on the host and copying them over is slow (and needs the
    16 GB twice over on the host); needle has no random-number kernels. So one block of
    ``BLOCK_ROWS`` random rows is made on the host per row width (for Llama-3-8B: 4096 x 4096
    and 4096 x 14336, 150 MB of bf16, and one row for the norms), copied once, and each
    tensor is assembled on the device from rows of its block, starting at an offset drawn
    from the tensor's name and wrapping round. Every tensor is its own memory: a decode step
    streams all 16 GB, nothing comes from a cache. Values are uniform of std 0.02 (norm
    scales 1 to 1.1), as the 1.1B model's are.
    """

    BLOCK_ROWS = 4096

    def __init__(self, ctx: Context, dtype: str):
        self.ctx, self.dtype = ctx, dtype
        self.blocks: dict[tuple[int, bool], object] = {}
        self.rng = np.random.default_rng(0)

    def _block(self, width: int, norm: bool):
        from needle.backend_ndarray import NDArray

        key = (width, norm)
        if key not in self.blocks:
            rows = 1 if norm else self.BLOCK_ROWS
            x = self.rng.random((rows, width), dtype=np.float32)
            x = 1 + 0.1 * x if norm else (x * 2 - 1) * np.float32(0.02 * np.sqrt(3))
            self.blocks[key] = NDArray(x.astype(to_numpy_dtype(self.dtype)),
                                       device=self.ctx.device, dtype=self.dtype)
        return self.blocks[key]

    def __call__(self, name: str, shape: tuple[int, ...]):
        from needle.backend_ndarray import concatenate

        if len(shape) == 1:
            return self._block(shape[0], True).reshape(shape).copy()
        rows, width = shape
        block = self._block(width, False)
        n = block.shape[0]
        start = zlib.crc32(name.encode()) % n
        parts, done = [], 0
        while done < rows:
            take = min(rows - done, n - start)
            parts.append(block[start:start + take])
            done, start = done + take, (start + take) % n
        return concatenate(parts) if len(parts) > 1 else parts[0].copy()  # own memory


def reuse_weights(model):
    """A weight source handing out ``model``'s own arrays (q/k/v and gate/up as row slices
    of its stacked matrices): a second model over the same weights, without the host."""
    cfg, w = model.config, model.weights
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size

    def source(name: str, shape):
        if name == "model.embed_tokens.weight":
            return w.embed
        if name == "model.norm.weight":
            return w.final_norm
        if name == "lm_head.weight":
            return w.lm_head.weight
        _, _, i, group, part = name.split(".", 4)
        layer = w.layers[int(i)]
        found = {
            "input_layernorm.weight": lambda: layer.attn_norm,
            "post_attention_layernorm.weight": lambda: layer.mlp_norm,
            "self_attn.q_proj.weight": lambda: layer.qkv.weight[:q],
            "self_attn.k_proj.weight": lambda: layer.qkv.weight[q:q + kv],
            "self_attn.v_proj.weight": lambda: layer.qkv.weight[q + kv:],
            "self_attn.o_proj.weight": lambda: layer.o.weight,
            "mlp.gate_proj.weight": lambda: layer.gate_up.weight[:inter],
            "mlp.up_proj.weight": lambda: layer.gate_up.weight[inter:],
            "mlp.down_proj.weight": lambda: layer.down.weight,
        }[f"{group}.{part}"]()
        assert tuple(found.shape) == tuple(shape), (name, found.shape, shape)
        return found

    return source


# --- the peers --------------------------------------------------------------------------------

def hf_model(ctx: Context, raw: dict, weights: dict[str, np.ndarray], dtype: str):
    """transformers' LlamaForCausalLM on the peer device with ``weights``, or None."""
    fw = ctx.frameworks.get("torch")
    if fw is None:
        return None
    try:
        import transformers
    except ImportError:
        return None
    torch = fw.torch
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    config = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    config._attn_implementation = "eager"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(tdtype)  # what from_pretrained does: rotary tables stay float32
    try:
        with torch.device(fw.device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    state = {}
    for name, array in weights.items():
        t = (torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
             if dtype == "bfloat16" else torch.from_numpy(array))
        state[name] = t
    model.load_state_dict(state)
    return model.eval()


def static_llama(ctx: Context, model, capacity: int):
    """The gpt-fast-style PyTorch model over ``model``'s weight arrays (torch_llama.py),
    with a static cache of ``capacity`` positions; Skip when torch is absent."""
    fw = ctx.frameworks.get("torch")
    if fw is None:
        raise Skip("no torch peer on this device")
    from .torch_llama import StaticLlama

    cfg, w = model.config, model.weights
    if (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.attn_softcap is not None
            or any(w is not None for w in cfg.layer_windows)):
        raise Skip("the gpt-fast-style peer runs plain Llama only")
    ctx.device.synchronize()

    def view(a):
        return _to_torch(fw, a)

    layers = [dict(attn_norm=view(x.attn_norm), qkv=view(x.qkv.weight), o=view(x.o.weight),
                   mlp_norm=view(x.mlp_norm), gate_up=view(x.gate_up.weight),
                   down=view(x.down.weight)) for x in w.layers]
    weights = dict(embed=view(w.embed), final_norm=view(w.final_norm),
                   lm_head=view(w.lm_head.weight), layers=layers)
    return StaticLlama(cfg, weights, view(model.rope.cos), view(model.rope.sin), capacity)


def _to_torch(fw, array):
    """needle's array as a torch tensor on the peer's device: a DLPack view of the same
    memory where the backend exports it, else a copy through the host."""
    torch = fw.torch
    try:
        t = torch.from_dlpack(array)
    except Exception:  # e.g. a host backend whose dtype numpy cannot export
        t = fw.put(array.astype("float32").numpy(), array.dtype)
    if t.device != fw.device:
        t = t.to(fw.device)
    return t
