"""Elementwise fusion inside ``ndl.compile`` (needle/fusion): a fused step gives the unfused
step's results (bitwise where kernels are deterministic), with fewer kernels; what is used
after the step is still written; unsafe moves split a group; the generated CUDA source
compiles with NVRTC."""

from __future__ import annotations

import numpy as np
import pytest

import needle as ndl
from needle import nn, optim
from needle.errors import ArgumentTypeError, DeviceError
from needle.fusion import Call
from needle.fusion.call import is_array
from needle.fusion.codegen import module
from needle.fusion.plan import dead_arrays, plan

STEPS = 6


def _model(device):
    ndl.init.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24, device=device), nn.GELU(),
                         nn.Linear(24, 24, device=device), nn.Tanh(),
                         nn.Linear(24, 24, device=device), nn.ReLU(),
                         nn.Linear(24, 5, device=device))


def _train(device, fuse, held=None, steps=STEPS):
    """A step with a classifier loss plus hand-written elementwise terms (where, sigmoid,
    exp, scalar ops, a broadcast row), Adam, a fresh batch each call."""
    model = _model(device)
    opt = optim.Adam(model.parameters(), lr=0.01)
    loss_fn = nn.SoftmaxLoss()

    def step(x, y):
        opt.zero_grad()
        logits = model(x)
        gate = logits.sigmoid()
        extra = ((gate * 0.5 - 0.25) ** 2).sum() / 10.0 + (logits.exp() * 0.001).sum()
        loss = loss_fn(logits, y) + extra
        loss.backward()
        opt.step()
        if held is not None:
            held[:] = [gate]  # used after the step: must be written on every replay
        return loss

    fn = ndl.compile(step, fuse=fuse, warn=False)
    rng = np.random.default_rng(1)
    losses, gates = [], []
    for _ in range(steps):
        x = ndl.Tensor(rng.standard_normal((8, 12)).astype(np.float32), device=device,
                       requires_grad=False)
        y = ndl.Tensor(rng.integers(0, 5, 8), device=device, requires_grad=False)
        losses.append(fn(x, y).numpy())
        if held is not None:
            gates.append(held[0].numpy().copy())
    return fn, (x, y), np.array(losses), [p.numpy() for p in model.parameters()], gates


def _same(device, a, b, low=None):
    """Bitwise, except on cuda, whose split-K matmuls may add in another order from run to
    run (in bf16 a last-bit difference can round the other way; a wrong fusion is far off)."""
    if device.kind in ("cuda",):
        tol = (2e-2, 1e-3) if low else (1e-4, 1e-5)
        np.testing.assert_allclose(a, b, rtol=tol[0], atol=tol[1])
    else:
        np.testing.assert_array_equal(a, b)


def test_fused_step_matches_unfused(device):
    fn_f, args, losses_f, params_f, gates_f = _train(device, True, held=[])
    fn_u, _, losses_u, params_u, gates_u = _train(device, False, held=[])
    stats_f, stats_u = fn_f.stats(*args), fn_u.stats(*args)
    assert stats_f["recorded"] and stats_u["recorded"], (stats_f, stats_u)
    assert stats_u["fused_kernels"] == 0
    assert stats_f["fused_kernels"] >= 5 and stats_f["fused_calls"] > stats_f["fused_kernels"]
    _same(device, losses_f, losses_u)
    for a, b in zip(params_f, params_u):
        _same(device, a, b)
    for a, b in zip(gates_f, gates_u):  # an array held after the step is kept up to date
        _same(device, a, b)
    assert len({float(v) for v in losses_f}) == STEPS
    saved = stats_f["fused_calls"] - stats_f["fused_kernels"]
    if stats_f["graphs"]:  # fewer kernels in the graph: one per group instead of its calls
        # (not exactly ``saved`` fewer: some calls launch no kernel, e.g. a same-dtype cast)
        assert stats_f["graph_kernels"] < 0.6 * stats_u["graph_kernels"], (stats_f, stats_u)
    else:
        assert stats_f["replay_calls"] == stats_u["replay_calls"] - saved


def test_fused_step_matches_eager(device):
    """The fused, replayed step against plain eager steps (no compile at all)."""
    model_e = _model(device)
    opt_e = optim.Adam(model_e.parameters(), lr=0.01)
    loss_fn = nn.SoftmaxLoss()
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(STEPS):
        x = ndl.Tensor(rng.standard_normal((8, 12)).astype(np.float32), device=device,
                       requires_grad=False)
        y = ndl.Tensor(rng.integers(0, 5, 8), device=device, requires_grad=False)
        opt_e.zero_grad()
        logits = model_e(x)
        gate = logits.sigmoid()
        loss = loss_fn(logits, y) + (((gate * 0.5 - 0.25) ** 2).sum() / 10.0
                                     + (logits.exp() * 0.001).sum())
        loss.backward()
        opt_e.step()
        losses.append(loss.numpy())
    _, _, losses_f, params_f, _ = _train(device, True)
    np.testing.assert_allclose(losses_f, np.array(losses), rtol=1e-5, atol=1e-6)
    for a, p in zip(params_f, model_e.parameters()):
        np.testing.assert_allclose(a, p.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("low", [None, "bfloat16"])
def test_fused_transformer_step_matches_unfused(device, low):
    """A small GPT step (embedding, attention, LayerNorm, AdamW), fp32 and bf16 autocast."""
    if not device.enabled() or device.kind in ("cpu", "cpu_numpy"):
        pytest.skip("the CPUs check nn.Embedding's indices on the host, so this step runs "
                    "eagerly there (docs/training.md): nothing is recorded to fuse")

    def train(fuse):
        ndl.init.manual_seed(0)
        embed = nn.Embedding(32, 16, device=device)
        body = nn.Transformer(16, 32, 1, num_heads=2, max_len=8, batch_first=True,
                              device=device)
        head = nn.Linear(16, 32, device=device)
        opt = optim.AdamW(embed.parameters() + body.parameters() + head.parameters(),
                          lr=3e-3)
        loss_fn = nn.SoftmaxLoss()

        def step(x, y):
            opt.zero_grad()
            with ndl.autocast(low or "bfloat16", enabled=low is not None):
                loss = loss_fn(head(body(embed(x))), y)
            loss.backward()
            opt.step()
            return loss

        fn = ndl.compile(step, fuse=fuse, warn=False)
        rng = np.random.default_rng(4)
        losses = []
        for _ in range(5):
            ids = rng.integers(0, 32, (2, 9))
            x = ndl.Tensor(ids[:, :-1], device=device, requires_grad=False)
            y = ndl.Tensor(ids[:, 1:], device=device, requires_grad=False)
            losses.append(fn(x, y).numpy())
        return fn.stats(x, y), np.array(losses), [p.numpy() for p in opt.params]

    stats_f, losses_f, params_f = train(True)
    stats_u, losses_u, params_u = train(False)
    assert stats_f["recorded"] and stats_f["fused_kernels"] > 10, stats_f
    assert stats_f["graph_kernels"] < 0.7 * stats_u["graph_kernels"], (stats_f, stats_u)
    _same(device, losses_f, losses_u, low)
    for a, b in zip(params_f, params_u):
        _same(device, a, b, low)


def test_a_host_read_while_recording_runs_the_call_eagerly(device):
    """A read that only the recorded (third) call makes: nothing of that call has run yet
    when fusion keeps the calls back, so the call runs eagerly and returns the right value."""
    calls = []

    def step(x):
        calls.append(1)
        y = (x * 2.0 + 1.0).relu() - 0.5
        if len(calls) == 3:
            float(y.sum().numpy())
        return y * 3.0

    fn = ndl.compile(step, fuse=True, warn=False)
    rng = np.random.default_rng(2)
    for _ in range(4):
        data = rng.standard_normal((4, 5)).astype(np.float32)
        x = ndl.Tensor(data, device=device, requires_grad=False)
        want = (np.maximum(data * 2 + 1, 0) - 0.5) * 3
        np.testing.assert_allclose(fn(x).numpy(), want, rtol=1e-6)
    assert "numpy" in (fn.fallback_reason(x) or "")


def test_work_outside_the_backend_keeps_its_place(device):
    """Device work that bypasses the backend (NCCL collectives do: they go on the queue's
    stream) is kept back with the step's calls through ``step_hooks.deferred``, so it runs
    after the fused kernel that makes its input. Here: a queue copy of a result."""
    from needle import step_hooks

    def copy(src, dst):
        be = device.backend
        if not hasattr(be, "queue"):
            be.compact(src._handle, dst._handle, dst.shape, dst.strides, 0)  # the CPUs
            return
        be.queue.copy(src._handle.buffer, 0, dst._handle.buffer, 0, src.size * 4)

    def step(x):
        y = ((x * 2.0).exp() + 1.0).realize_cached_data()
        z = ndl.backend_ndarray.NDArray.make(y.shape, device=device, dtype="float32")
        if not step_hooks.deferred(lambda: copy(y, z), y, z):
            copy(y, z)
        return ndl.Tensor.make_const(z) * 3.0 - 1.0

    fn = ndl.compile(step, fuse=True, warn=False)
    rng = np.random.default_rng(3)
    for _ in range(5):
        data = rng.standard_normal((3, 4)).astype(np.float32)
        x = ndl.Tensor(data, device=device, requires_grad=False)
        np.testing.assert_allclose(fn(x).numpy(), (np.exp(data * 2) + 1) * 3 - 1, rtol=1e-5)
    assert fn.stats(x)["recorded"]


def test_fusion_switch(monkeypatch):
    dev = ndl.cpu_numpy()
    monkeypatch.setenv("NEEDLE_FUSION", "1")
    fn, args, *_ = _train(dev, None, steps=4)
    assert fn.stats(*args)["fused_kernels"] > 0
    monkeypatch.setenv("NEEDLE_FUSION", "0")
    fn, args, *_ = _train(dev, None, steps=4)
    assert fn.stats(*args)["fused_kernels"] == 0
    monkeypatch.delenv("NEEDLE_FUSION")
    fn, args, *_ = _train(dev, None, steps=4)  # the CPUs do not fuse by default
    assert fn.stats(*args)["fused_kernels"] == 0
    with pytest.raises(ArgumentTypeError, match="fuse must be"):
        ndl.compile(lambda x: x, fuse="yes")


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
    compiler = pytest.importorskip("needle.backends.cuda.compiler")
    try:
        compiler.nvrtc_version()
    except DeviceError as e:
        pytest.skip(f"NVRTC unavailable: {e}")
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

