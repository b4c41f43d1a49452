"""Array cases (issues 2 and 4): matmul, a 1.1B layer's products (linear), elementwise,
reductions, softmax, rmsnorm, tiny ops.

Sizes follow the device: a CPU gets sizes that fit its memory and time (matmul up to 2048,
16M-element elementwise ops), a GPU gets sizes that fill it (matmul up to 8192 in fp32 and bf16,
256M elements, a 16384x16384 reduction). ``--quick`` shrinks everything for smoke tests. Inputs
are standard-normal floats from a fixed seed, identical for every framework.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .runner import Bench, Case, Context

F32 = 4
RMS_EPS = 1e-6
_SHORT = {"float32": "f32", "bfloat16": "bf16"}


def _count(n: int) -> str:
    """16777216 -> '16M', 1024 -> '1k': how the case names spell sizes."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10}k"
    return str(n)


def _normal(*shapes) -> Callable[[np.random.Generator], tuple[np.ndarray, ...]]:
    return lambda rng: tuple(rng.standard_normal(s, dtype=np.float32) for s in shapes)


def _matmul(n: int, dtype: str) -> Case:
    def build(ctx: Context) -> Bench:
        ops = {"needle": _mm, "torch": _mm}
        if dtype == "float32":
            ops["numpy"] = _mm
        sets = ctx.input_sets(_normal((n, n), (n, n)))
        return Bench(ctx.bind(ops, sets, dtype), flops=2.0 * n**3, ceiling=f"matmul_{dtype}",
                     rtol=1e-4 if dtype == "float32" else 2e-2)

    return Case(f"matmul_{_SHORT[dtype]}_{n}", "matmul", build)


def _mm(a, b):
    return a @ b


# a 1.1B Llama layer's products x (m, k) @ W^T, W stored (n, k) as a Linear layer keeps it:
# fused q/k/v, o, fused gate/up, down (issue 20: "GEMMs for the model's shapes")
LAYER_SHAPES = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (11264, 2048),
                "down": (2048, 5632)}


def _linear(m: int, name: str, dtype: str) -> Case:
    n, k = LAYER_SHAPES[name]

    def build(ctx: Context) -> Bench:
        ops = {"needle": _mm_t, "torch": _mm_t}
        if dtype == "float32":
            ops["numpy"] = _mm_t
        sets = ctx.input_sets(_normal((m, k), (n, k)))
        return Bench(ctx.bind(ops, sets, dtype), flops=2.0 * m * n * k,
                     ceiling=f"matmul_{dtype}", rtol=1e-4 if dtype == "float32" else 2e-2)

    return Case(f"linear_{_SHORT[dtype]}_{name}_{m}", "linear", build)


def _mm_t(x, w):
    return x @ w.T


def _matmul_tf32(n: int) -> Case:
    """float32 products with TF32 allowed in both frameworks (needle's
    set_float32_matmul_precision("high"), torch's allow_tf32), each call restoring the
    setting it found; no ceiling (the float32 one is for IEEE products)."""
    def build(ctx: Context) -> Bench:
        from needle.backends import precision

        def needle_tf32(a, b):
            before = precision.get_float32_matmul_precision()
            precision.set_float32_matmul_precision("high")
            try:
                return a @ b
            finally:
                precision.set_float32_matmul_precision(before)

        def torch_tf32(a, b):
            import torch

            before = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                return a @ b
            finally:
                torch.backends.cuda.matmul.allow_tf32 = before

        sets = ctx.input_sets(_normal((n, n), (n, n)))
        return Bench(ctx.bind({"needle": needle_tf32, "torch": torch_tf32}, sets, "float32"),
                     flops=2.0 * n**3, rtol=1e-2)

    return Case(f"matmul_tf32_{n}", "matmul", build)


def _add(n: int, small: bool = False) -> Case:
    """``a + b``; ``small`` sizes time the fixed cost of one op (dispatch, launch), not bytes."""
    def build(ctx: Context) -> Bench:
        add = lambda a, b: a + b  # noqa: E731 - the same expression in every framework
        sets = ctx.input_sets(_normal(n, n))
        return Bench(ctx.bind({"needle": add, "numpy": add, "torch": add}, sets),
                     bytes=None if small else 3 * n * F32, rtol=1e-6)

    if small:
        return Case(f"small_add_{_count(n)}", "small_op", build)
    return Case(f"add_{_count(n)}", "add", build)


def _exp(n: int) -> Case:
    def build(ctx: Context) -> Bench:
        ops = {"needle": lambda a: a.exp(), "numpy": np.exp, "torch": lambda a: a.exp()}
        return Bench(ctx.bind(ops, ctx.input_sets(_normal(n))), bytes=2 * n * F32, rtol=1e-5)

    return Case(f"exp_{_count(n)}", "exp", build)


def _sum(rows: int, cols: int, axis: int) -> Case:
    """axis=1: each row to one value (contiguous); axis=0: each column (strided)."""
    def build(ctx: Context) -> Bench:
        ops = {"needle": lambda a: a.sum(axis=axis), "numpy": lambda a: a.sum(axis=axis),
               "torch": lambda a: a.sum(dim=axis)}
        out = rows if axis == 1 else cols
        return Bench(ctx.bind(ops, ctx.input_sets(_normal((rows, cols)))),
                     bytes=(rows * cols + out) * F32, rtol=1e-4)

    kind = "rows" if axis == 1 else "cols"
    return Case(f"sum_{kind}_{rows}x{cols}", "sum", build)


def _np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    e /= e.sum(axis=-1, keepdims=True)
    return e


def _softmax(rows: int, cols: int) -> Case:
    def build(ctx: Context) -> Bench:
        ops = {"needle": lambda x: x.softmax(), "numpy": _np_softmax,
               "torch": lambda x: x.softmax(-1)}
        return Bench(ctx.bind(ops, ctx.input_sets(_normal((rows, cols)))),
                     bytes=2 * rows * cols * F32, rtol=1e-4)

    return Case(f"softmax_{rows}x{cols}", "softmax", build)


def _np_rmsnorm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + RMS_EPS) * w


def _torch_rmsnorm(ctx: Context) -> Callable | None:
    if "torch" not in ctx.frameworks:
        return None
    import torch.nn.functional as F  # noqa: N812 - PyTorch's own spelling

    if hasattr(F, "rms_norm"):
        return lambda x, w: F.rms_norm(x, (x.shape[-1],), w, RMS_EPS)
    return lambda x, w: x * (x.pow(2).mean(-1, keepdim=True) + RMS_EPS).rsqrt() * w


def _rmsnorm(rows: int, cols: int) -> Case:
    def build(ctx: Context) -> Bench:
        ops = {"needle": lambda x, w: x.rmsnorm(w, RMS_EPS), "numpy": _np_rmsnorm,
               "torch": _torch_rmsnorm(ctx)}
        ops = {k: v for k, v in ops.items() if v is not None}
        sets = ctx.input_sets(_normal((rows, cols), (cols,)))
        return Bench(ctx.bind(ops, sets), bytes=(2 * rows * cols + cols) * F32, rtol=1e-4)

    return Case(f"rmsnorm_{rows}x{cols}", "rmsnorm", build)


def cases(ctx: Context) -> list[Case]:
    if ctx.quick:
        mm, n, sums, rows = ([256] if ctx.gpu else [64, 128]), 1 << 16, [(256, 256)], (256, 256)
    elif ctx.gpu:
        mm, n, sums, rows = [1024, 4096, 8192], 1 << 28, [(4096, 4096), (16384, 16384)], \
            (4096, 4096)
    else:
        mm, n, sums, rows = [256, 1024, 2048], 1 << 24, [(4096, 4096)], (4096, 4096)
    dtypes = ("float32", "bfloat16") if ctx.gpu else ("float32",)
    found = [_matmul(s, dt) for dt in dtypes for s in mm]
    found += [_matmul_tf32(s) for s in mm] if ctx.gpu else []
    # a GPU: bf16 prefill chunks of 512 and 2,048 tokens; a CPU: float32, fewer rows
    tokens = (16,) if ctx.quick and not ctx.gpu else (512, 2048) if ctx.gpu else (128,)
    found += [_linear(m, name, "bfloat16" if ctx.gpu else "float32") for m in tokens
              for name in LAYER_SHAPES]
    found += [_add(n), _exp(n)]
    found += [_sum(r, c, axis) for r, c in sums for axis in (1, 0)]
    found += [_softmax(*rows), _rmsnorm(*rows)]
    found += [_add(1, small=True), _add(1 << 10, small=True)]
    return found
