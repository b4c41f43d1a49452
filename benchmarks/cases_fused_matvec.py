"""The decode step's fused projections (issue 20): ``nd.rmsnorm_matvec`` (norm + QKV),
``activation="swiglu"`` (norm + gate/up + SiLU·mul) and ``nd.matvec_add`` (down projection +
residual, in place), one token, against the same composition in numpy and PyTorch (whose
residual add makes a new array: an in-place peer would change its result after the check).

Every call reads its whole weight once, so the cases are memory-bound: the rate is the bytes
of the weight, the input and the output per call against the copy bandwidth. Shapes are the
1.1B Llama's (hidden 2048, 32 query / 4 KV heads of 64, intermediate 5632) on a CPU and
Llama-3-8B's (4096, 32 / 8 heads of 128, 14336) on a GPU; ``--quick`` shrinks them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import needle.backend_ndarray as nd

from .runner import Bench, Case, Context

EPS = 1e-6
_SHORT = {"float32": "f32", "bfloat16": "bf16"}
_ITEM = {"float32": 4, "bfloat16": 2}


def _np_normed(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def _np_swiglu(y):
    g, u = np.split(y, 2, axis=-1)
    return g / (1 + np.exp(-g)) * u


def _np_add(a, weight, total):
    # out of place: the peers' result must not change after the check reads it
    return total + a @ weight.T


def _torch_ops(ctx: Context, kind: str) -> Callable | None:
    if "torch" not in ctx.frameworks:
        return None
    torch = ctx.frameworks["torch"].torch
    F = torch.nn.functional  # noqa: N806 - PyTorch's own spelling

    def normed(x, w):
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), w, EPS)
        return x * (x.float().pow(2).mean(-1, keepdim=True) + EPS).rsqrt().to(x.dtype) * w

    if kind == "qkv":
        return lambda x, w, weight: F.linear(normed(x, w), weight)
    if kind == "gate_up":
        def gate_up(x, w, weight):
            g, u = F.linear(normed(x, w), weight).chunk(2, dim=-1)
            return F.silu(g) * u
        return gate_up
    return lambda a, weight, total: total + F.linear(a, weight)


def _case(kind: str, dim: int, p: int, dtype: str) -> Case:
    """kind: "qkv" (x (1, dim) -> (1, p)), "gate_up" (weight (2p, dim) -> (1, p)) or "down"
    (a (1, dim) added into total (1, p))."""
    rows = 2 * p if kind == "gate_up" else p
    scale = 1 / np.sqrt(dim)

    def make(rng):
        x = rng.standard_normal((1, dim), dtype=np.float32)
        weight = (rng.standard_normal((rows, dim), dtype=np.float32) * scale).astype(np.float32)
        if kind == "down":
            return x, weight, rng.standard_normal((1, p), dtype=np.float32)
        return x, (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32), weight

    def build(ctx: Context) -> Bench:
        if kind == "qkv":
            ops = {"needle": lambda x, w, weight: nd.rmsnorm_matvec(x, w, weight, EPS),
                   "numpy": lambda x, w, weight: _np_normed(x, w) @ weight.T}
        elif kind == "gate_up":
            ops = {"needle": lambda x, w, weight: nd.rmsnorm_matvec(x, w, weight, EPS,
                                                                    activation="swiglu"),
                   "numpy": lambda x, w, weight: _np_swiglu(_np_normed(x, w) @ weight.T)}
        else:
            ops = {"needle": nd.matvec_add, "numpy": _np_add}
        torch_op = _torch_ops(ctx, kind)
        if torch_op is not None:
            ops["torch"] = torch_op
        if dtype != "float32":  # numpy has no fast bfloat16 product: not a fair peer
            ops.pop("numpy")
        item = _ITEM[dtype]
        moved = (rows * dim + dim + (2 * p if kind == "down" else p)) * item
        return Bench(ctx.bind(ops, ctx.input_sets(make), dtype), bytes=moved,
                     rtol=1e-4 if dtype == "float32" else 2e-2)

    name = {"qkv": "rmsnorm_matvec", "gate_up": "rmsnorm_matvec_swiglu", "down": "matvec_add"}
    return Case(f"{name[kind]}_{_SHORT[dtype]}_{dim}x{p}", "fused_matvec", build)


def cases(ctx: Context) -> list[Case]:
    if ctx.quick:
        dim, qkv, ffn = 64, 96, 160
    elif ctx.gpu:
        dim, qkv, ffn = 4096, 4096 + 2 * 8 * 128, 14336
    else:
        dim, qkv, ffn = 2048, 2048 + 2 * 4 * 64, 5632
    found = []
    for dtype in ("float32", "bfloat16"):
        found += [_case("qkv", dim, qkv, dtype), _case("gate_up", dim, ffn, dtype),
                  _case("down", ffn, dim, dtype)]
    return found
