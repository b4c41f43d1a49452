"""Elementwise fusion's plan (needle/fusion/plan.py) on hand-made call lists: what is an
intermediate, where groups split, what a gather inlines; random programs fused == unfused
bitwise (the CPU's executor, generated Metal and CUDA kernels); the generated CUDA source
compiles with NVRTC and the MSL with the Metal compiler."""

from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
from needle.errors import DeviceError
from needle.fusion import Call
from needle.fusion.call import is_array
from needle.fusion.codegen import module
from needle.fusion.plan import dead_arrays, plan

# --- the plan, on hand-made call lists --------------------------------------------------------

def _arrays(n, size=6, dtype="float32"):
    be = ndl.cpu_numpy().backend
    return be, [be.Array(size, dtype) for _ in range(n)]


def test_dead_arrays_counts_references_outside_the_calls():
    be, (a, b, c) = _arrays(3)
    calls = [Call("ewise_relu", be.ewise_relu, (a, b), {}),
             Call("ewise_exp", be.ewise_exp, (b, c), {})]
    ids = {id(a), id(b), id(c)}
    assert dead_arrays(calls) == set()
    del b
    assert dead_arrays(calls) == ids - {id(a), id(c)}
    del a, c
    assert dead_arrays(calls) == ids


def _plan(calls):
    groups = plan([calls], dead_arrays(calls))[0]
    return [[calls.index(m.call) for m in g.nodes] for g in groups], groups


def test_a_read_in_between_splits_the_group():
    """The one-hot of a loss: used by a product before a reduction and by a difference after
    it; the reduction reads the product, so the group parts there and the one-hot is written."""
    be, (lab, ls, onehot_b, onehot, prod, total, sm, diff) = _arrays(8)
    calls = [Call("scalar_eq", be.scalar_eq, (lab, 1.0, onehot_b), {}),
             Call("ewise_cast", be.ewise_cast, (onehot_b, onehot), {}),
             Call("ewise_mul", be.ewise_mul, (ls, onehot, prod), {}),
             Call("reduce_sum", be.reduce_sum, (prod, total, 1, 6, 1), {}),
             Call("ewise_sub", be.ewise_sub, (sm, onehot, diff), {})]
    del onehot_b, onehot, prod
    order, groups = _plan(calls)
    assert order == [[0, 1, 2]]  # the difference alone is no group
    (g,) = groups
    assert [calls.index(m.call) for m, _ in g.outputs] == [1, 2]  # one-hot and product
    assert len(g.internal) == 1


def test_a_write_of_an_input_in_between_splits_the_group():
    be, (x, t, u, out) = _arrays(4)
    calls = [Call("ewise_exp", be.ewise_exp, (x, t), {}),
             Call("fill", be.fill, (x, 0.0), {}),  # overwrites x after exp read it
             Call("ewise_add", be.ewise_add, (t, x, u), {}),
             Call("ewise_neg", be.ewise_neg, (u, out), {})]
    del t, u
    order, _ = _plan(calls)
    assert order == [[2, 3]]
    be2, (x2, t2, out2) = _arrays(3)
    calls = [Call("ewise_exp", be2.ewise_exp, (x2, t2), {}),
             Call("ewise_neg", be2.ewise_neg, (t2, out2), {})]
    del t2
    assert _plan(calls)[0] == [[0, 1]]


def test_an_array_used_after_the_step_is_an_output():
    be, (x, t, out) = _arrays(3)
    calls = [Call("ewise_exp", be.ewise_exp, (x, t), {}),
             Call("ewise_neg", be.ewise_neg, (t, out), {})]
    _, groups = _plan(calls)  # t is still referenced here: not an intermediate
    assert groups == [] or not groups[0].internal


def test_a_group_with_too_many_buffers_is_split():
    """A sum of 40 arrays would take 41 buffers, more than a Metal kernel binds."""
    from needle.fusion.plan import MAX_BUFFERS

    be, xs = _arrays(40)
    acc = xs[0]
    calls = []
    for x in xs[1:]:
        nxt = be.Array(6, "float32")
        calls.append(Call("ewise_add", be.ewise_add, (acc, x, nxt), {}))
        acc = nxt
    del nxt, x
    _, groups = _plan(calls)
    assert len(groups) >= 2 and sum(len(g.nodes) for g in groups) == len(calls)
    assert all(len(g.leaves) + len(g.outputs) <= MAX_BUFFERS for g in groups)


def test_gathered_rows_are_leaves():
    """Linear's bias: compact of a broadcast row, added, then the activation: one group whose
    leaves are the product and the bias itself."""
    be, (mm, bias_row, act) = _arrays(3)
    bias = be.Array(3, "float32")
    wide, added = be.Array(6, "float32"), be.Array(6, "float32")
    calls = [Call("compact", be.compact, (bias, wide, (2, 3), (0, 1), 0), {}),
             Call("ewise_add", be.ewise_add, (mm, wide, added), {}),
             Call("ewise_relu", be.ewise_relu, (added, act), {})]
    del wide, added, bias_row
    order, (g,) = _plan(calls)
    assert order == [[0, 1, 2]]
    assert g.leaves == [bias, mm] and [x for _, x in g.outputs] == [act]


def test_a_reduction_tail_is_computed_where_it_is_broadcast():
    """sum -> divide -> broadcast to rows -> multiply: the division moves into the kernel
    that reads it through the broadcast (computed at the index it reads)."""
    be = ndl.cpu_numpy().backend
    x, total, mean, wide, out = (be.Array(6), be.Array(2), be.Array(2), be.Array(6),
                                 be.Array(6))
    calls = [Call("reduce_sum", be.reduce_sum, (x, total, 2, 3, 1), {}),
             Call("scalar_div", be.scalar_div, (total, 3.0, mean), {}),
             Call("compact", be.compact, (mean, wide, (2, 3), (1, 0), 0), {}),
             Call("ewise_mul", be.ewise_mul, (x, wide, out), {})]
    del mean, wide
    order, (g,) = _plan(calls)
    assert order == [[1, 2, 3]]
    assert g.leaves == [total, x] and g.n == 6
    source, _ = module("cuda", "// ---- instantiation", [g])
    assert "in0[((i / 3) % 2) * 1]" in source  # the row's total, read through the broadcast


# --- generated CUDA source ----------------------------------------------------------------

def _chain(be, dt):
    """Every node kind on one dtype: gather of a row, add, scalar mul, compare, cast, where,
    a unary op, multiply; plus fill."""
    f = dt in ("float16", "bfloat16", "float32", "float64")
    a, b, bias = be.Array(12, dt), be.Array(12, dt), be.Array(4, dt)
    t = [be.Array(12, d) for d in (dt, dt, dt, "bool", dt, dt, dt, dt, dt)]
    out = be.Array(12, dt)
    calls = [Call("compact", be.compact, (bias, t[0], (3, 4), (0, 1), 0), {}),
             Call("ewise_add", be.ewise_add, (a, t[0], t[1]), {}),
             Call("scalar_mul", be.scalar_mul, (t[1], 3, t[2]), {}),
             Call("scalar_gt", be.scalar_gt, (t[2], 1, t[3]), {}),
             Call("ewise_cast", be.ewise_cast, (t[3], t[4]), {}),
             Call("where", be.where, (t[3], t[2], b, t[5]), {}),
             Call("ewise_exp" if f else "ewise_neg", None, (t[5], t[6]), {}),
             Call("fill", be.fill, (t[7], 2), {}),
             Call("ewise_maximum", be.ewise_maximum, (t[6], t[7], t[8]), {}),
             Call("ewise_mul", be.ewise_mul, (t[8], t[4], out), {})]
    return calls, (a, b, bias, out)


def _cuda_compiler():
    from needle.backends.cuda import compiler

    try:
        compiler.nvrtc_version()
    except DeviceError as e:
        pytest.fail(f"NVRTC unavailable: {e} (pip install 'needle[cuda]')")
    return compiler


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_generated_cuda_source_compiles(arch):
    compiler = _cuda_compiler()
    be = ndl.cpu_numpy().backend
    groups, keep = [], []
    for dt in ("float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8", "int8"):
        calls, arrays = _chain(be, dt)
        keep.append(arrays)
        found = plan([calls], dead_arrays(calls))[0]
        assert [len(g.nodes) for g in found] == [10], dt
        groups += found
    source, names = module("cuda", (compiler.KERNEL_DIR / "elementwise.cu").read_text(), groups)
    assert names == [f"fused_{k}" for k in range(8)]
    calls, arrays = _chain(be, "float32")  # the same computation on other arrays
    again = plan([calls], dead_arrays(calls))[0]
    assert module("cuda", "// ---- instantiation", groups + again)[1][-1] == "fused_0"
    assert "__int_as_float((int)0x40400000u)" in source  # the scalar 3.0 as float32 bits
    cubin = compiler.compile_source(source, "fused", arch, options=compiler.FUSED_OPTIONS)
    assert len(cubin) > 1000


def test_generated_msl_builds_for_every_dtype():
    """The same chains as MSL, built by the Metal device's compiler (the emulator's clang on
    Linux: NEEDLE_METAL_EMULATOR=1); each kernel becomes a pipeline."""
    dev = ndl.metal()
    if not dev.enabled():
        pytest.skip(f"metal disabled: {dev.reason}")
    be = ndl.cpu_numpy().backend
    groups, keep = [], []
    for dt in ("float32", "float16", "bfloat16", "int32", "int64", "uint8", "int8"):
        calls, arrays = _chain(be, dt)
        keep.append(arrays)
        groups += plan([calls], dead_arrays(calls))[0]
    cache = dev.backend.device.executables
    source, names = module("metal", cache.source("elementwise"), groups)
    assert "as_type<float>(0x40400000u)" in source
    exe = cache.fused_executable(source)
    assert all(exe.kernel(name).max_threads > 0 for name in names)


# --- random programs ----------------------------------------------------------------------

def _random_program(rng, be, held):
    """A random list of calls on (4, 6) float32 arrays: elementwise maps, comparisons,
    casts, where, broadcasts of row sums, transposes, in-place updates, fills, reductions.
    ``held`` gets the arrays used after the program (the rest only the calls hold)."""
    inputs = [be.Array(24, "float32") for _ in range(3)]
    held += inputs
    full, calls = list(inputs), []

    def new(size=24, dtype="float32"):
        return be.Array(size, dtype)

    for _ in range(int(rng.integers(8, 30))):
        kind = rng.choice(["unary", "binary", "scalar", "compare", "where", "rowsum",
                           "transpose", "inplace", "fill", "reduce"])
        a, b = full[rng.integers(len(full))], full[rng.integers(len(full))]
        out = new()
        if kind == "unary":
            op = rng.choice(["neg", "abs", "relu", "tanh", "sigmoid", "exp"])
            calls.append(Call(f"ewise_{op}", getattr(be, f"ewise_{op}"), (a, out), {}))
        elif kind == "binary":
            op = rng.choice(["add", "sub", "mul", "maximum"])
            calls.append(Call(f"ewise_{op}", getattr(be, f"ewise_{op}"), (a, b, out), {}))
        elif kind == "scalar":
            op = rng.choice(["add", "mul", "div", "power"])
            value = float(rng.choice([0.5, -1.5, 2.0]))
            calls.append(Call(f"scalar_{op}", getattr(be, f"scalar_{op}"), (a, value, out), {}))
        elif kind in ("compare", "where"):
            mask = new(dtype="bool")
            calls.append(Call("scalar_gt", be.scalar_gt, (a, 0.0, mask), {}))
            if kind == "compare":
                calls.append(Call("ewise_cast", be.ewise_cast, (mask, out), {}))
            else:
                calls.append(Call("where", be.where, (mask, a, b, out), {}))
        elif kind == "rowsum":  # sum over rows, scaled, broadcast back: a gathered tail
            total, mean = new(6), new(6)
            calls.append(Call("reduce_sum", be.reduce_sum, (a, total, 1, 4, 6), {}))
            calls.append(Call("scalar_div", be.scalar_div, (total, 4.0, mean), {}))
            calls.append(Call("compact", be.compact, (mean, out, (4, 6), (0, 1), 0), {}))
        elif kind == "transpose":  # read (6, 4) storage as (4, 6): a permuting gather
            calls.append(Call("compact", be.compact, (a, out, (4, 6), (1, 4), 0), {}))
        elif kind == "inplace":  # written twice: never an intermediate
            calls.append(Call("ewise_add", be.ewise_add, (a, b, a), {}))
            continue
        elif kind == "fill":
            calls.append(Call("fill", be.fill, (a, float(rng.integers(-2, 3))), {}))
            continue
        else:
            total = new(4)
            calls.append(Call("reduce_sum", be.reduce_sum, (a, total, 4, 6, 1), {}))
            held.append(total)
            continue
        full.append(out)
        if rng.random() < 0.2:
            held.append(out)
    held.append(full[-1])
    return inputs, calls


def _random_cases():
    """40 programs through the CPU's executor of the plan, 8 through generated Metal
    kernels (each is a new library for the emulator's compiler), 8 on cuda."""
    return ([("cpu_numpy", s) for s in range(40)] + [("metal", s) for s in range(8)]
            + [("cuda", s) for s in range(8)])


@pytest.mark.parametrize("kind,seed", _random_cases())
def test_random_programs_fused_equal_unfused(kind, seed):
    """Fused and unfused give the same bits in every array used afterwards, with every other
    array holding garbage before the fused run."""
    from needle.fusion import fuse

    dev = ndl.backend_ndarray.device_from_name(kind)
    if not dev.enabled():
        pytest.skip(f"{kind} disabled: {dev.reason}")
    rng = np.random.default_rng(seed)
    be = dev.backend
    held: list = []
    inputs, calls = _random_program(rng, be, held)
    data = [rng.standard_normal(24).astype(np.float32) for _ in inputs]

    def run(items):
        for x, d in zip(inputs, data):
            be.from_numpy(d, x)
        for c in calls:  # garbage everywhere the program writes
            for x in c.args:
                if is_array(x) and not any(x is i for i in inputs):
                    be.fill(x, float("nan"))
        for item in items:
            item()
        return [be.to_numpy(x, (x.size,), (1,), 0).copy() for x in held]

    want = run(list(calls))
    fused = fuse(be, [calls])
    assert fused.groups > 0  # (every seed's program has something to fuse)
    got = run(fused.segments[0])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)

