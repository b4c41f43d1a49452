"""Elementwise fusion inside ``ndl.compile`` (needle/fusion), whole steps: a fused step gives
the unfused step's results (bitwise where kernels are deterministic) with fewer kernels,
keeps what is used after the step up to date, and runs eagerly or unfused where it must.
The plan itself and the generated source: tests/test_fusion_plan.py."""

from __future__ import annotations

import numpy as np
import pytest
from benchmarks.cases_gpt_train import needle_gpt_step

import needle as ndl
import needle.backend_ndarray as nd
from needle import nn, optim
from needle.errors import ArgumentTypeError

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


# The GPUs only: the CPUs check nn.Embedding's indices on the host, so a step with an
# embedding runs eagerly there (docs/training.md) and nothing is recorded to fuse.
RECORDING_DEVICES = [d for d in nd.all_devices() if d.kind in ("cuda", "metal")]


@pytest.fixture(params=RECORDING_DEVICES, ids=[d.name for d in RECORDING_DEVICES])
def gpu(request):
    dev = request.param
    if not dev.enabled():
        pytest.skip(f"{dev.name} disabled: {dev.reason}")
    return dev


@pytest.mark.parametrize("low", [None, "bfloat16"])
def test_fused_transformer_step_matches_unfused(gpu, low):
    """A small GPT step (embedding, attention, LayerNorm, AdamW), fp32 and bf16 autocast."""
    device = gpu

    def train(fuse):
        step, opt = needle_gpt_step(device, vocab=32, dim=16, hidden=32, layers=1, heads=2,
                                    seq=8, lr=3e-3, low=low)
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
        if device.kind == "cuda":
            # the key projection's bias has a zero gradient in exact arithmetic (softmax is
            # shift-invariant), so AdamW turns split-K rounding noise into steps of ~lr:
            # parameters may differ by up to lr per step (3e-3 x 5); a wrong fusion is far off
            np.testing.assert_allclose(a, b, rtol=2e-2, atol=1.5e-2)
        else:
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
