"""``ndl.checkpoint`` (activation checkpointing): the same gradients as the plain call on
every device, dropout and autocast repeated exactly in the second run, nothing of the
function's insides held by the graph (and on CUDA a lower peak), clear errors."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import needle as ndl
import needle.backend_ndarray as nd
from needle import nn
from needle.errors import ArgumentTypeError, GradientError
from needle.nn import Parameter


class Block(nn.Module):
    """A residual MLP block with a norm and dropout, as a transformer layer has."""

    def __init__(self, width: int, device, p: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm1d(width, device=device)
        self.up = nn.Linear(width, 4 * width, device=device)
        self.down = nn.Linear(4 * width, width, device=device)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.down(ndl.ops.relu(self.up(self.norm(x)))))


def _grads(blocks, x, checkpointed: bool, seed: int = 1):
    for b in blocks:
        for p in b.parameters():
            p.grad = None
    x.grad = None
    ndl.init.manual_seed(seed)
    h = x
    for b in blocks:
        h = ndl.checkpoint(b, h) if checkpointed else b(h)
    (h * h).sum().backward()
    return [x.grad.numpy()] + [p.grad.numpy() for b in blocks for p in b.parameters()]


def _model(device, p=0.0, layers=3, width=16):
    ndl.init.manual_seed(0)
    blocks = [Block(width, device, p) for _ in range(layers)]
    rng = np.random.default_rng(0)
    x = ndl.Tensor(rng.standard_normal((8, width)).astype(np.float32), device=device,
                   requires_grad=True)
    return blocks, x


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["plain", "dropout"])
def test_same_gradients_as_the_plain_call(device, p):
    """Every parameter's and the input's gradient, bitwise: the second run computes the
    same arrays (dropout draws the same masks: the host generator is rewound)."""
    blocks, x = _model(device, p)
    plain = _grads(blocks, x, False)
    again = _grads(blocks, x, True)
    assert len(plain) == len(again) == 1 + 3 * 6
    for a, b in zip(plain, again):
        np.testing.assert_array_equal(a, b)


def test_the_graph_holds_only_the_inputs_and_parameters():
    blocks, x = _model(nd.cpu_numpy(), layers=1)
    out = ndl.checkpoint(blocks[0], x)
    params = [p for p in blocks[0].parameters() if p.requires_grad]
    assert out.inputs[0] is x and out.inputs[1:] == params
    frozen = blocks[0].up.weight
    frozen.requires_grad = False  # a frozen weight (LoRA's base) is not an input
    out = ndl.checkpoint(blocks[0], x)
    assert all(t is not frozen for t in out.inputs) and len(out.inputs) == len(params)
    out.sum().backward()
    assert frozen.grad is None and blocks[0].down.weight.grad is not None


def test_autocast_is_repeated_in_the_backward_pass(device):
    """A forward under autocast, the backward outside it: the recomputation runs in bf16
    as the first run did, so the gradients are the plain call's."""
    blocks, x = _model(device)

    def grads(checkpointed):
        for b in blocks:
            for p in b.parameters():
                p.grad = None
        x.grad = None
        with ndl.autocast("bfloat16"):
            h = x
            for b in blocks:
                h = ndl.checkpoint(b, h) if checkpointed else b(h)
            loss = (h.astype("float32") ** 2).sum()
        loss.backward()
        return [x.grad.numpy()] + [p.grad.numpy() for b in blocks for p in b.parameters()]

    for a, b in zip(grads(False), grads(True)):
        np.testing.assert_array_equal(a, b)


def test_functions_and_closures_with_explicit_parameters():
    dev = nd.cpu_numpy()
    rng = np.random.default_rng(1)
    w = Parameter(rng.standard_normal((4, 4)).astype(np.float32), device=dev)
    bias = ndl.Tensor(rng.standard_normal(4).astype(np.float32), device=dev,
                      requires_grad=False)
    x = ndl.Tensor(rng.standard_normal((3, 4)).astype(np.float32), device=dev,
                   requires_grad=True)

    def f(t):
        return ndl.ops.tanh(t @ w + bias.broadcast_to(t.shape))

    f(x).sum().backward()
    want = (x.grad.numpy(), w.grad.numpy())
    x.grad = w.grad = None
    ndl.checkpoint(f, x, params=[w]).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), want[0])
    np.testing.assert_array_equal(w.grad.numpy(), want[1])


def test_outside_grad_mode_it_is_the_plain_call():
    blocks, x = _model(nd.cpu_numpy(), layers=1)
    with ndl.no_grad():
        out = ndl.checkpoint(blocks[0], x)
    assert out.op is None or type(out.op).__name__ != "_Recompute"
    np.testing.assert_array_equal(out.numpy(), blocks[0](x).numpy())


def test_bad_calls_are_clear_errors():
    blocks, x = _model(nd.cpu_numpy(), layers=1)
    with pytest.raises(ArgumentTypeError, match="argument 0 must be a Tensor"):
        ndl.checkpoint(blocks[0], x.numpy())
    with pytest.raises(ArgumentTypeError, match="pass params="):
        ndl.checkpoint(lambda t: t * 2, x)
    with pytest.raises(ArgumentTypeError, match="must be callable"):
        ndl.checkpoint(3, x)
    with pytest.raises(ArgumentTypeError, match="must return one Tensor"):
        ndl.checkpoint(lambda t: (t, t), x, params=[])
    out = ndl.checkpoint(blocks[0], x)
    with pytest.raises(GradientError, match="create_graph"):
        ndl.grad(out.sum(), [x], create_graph=True)


CUDA = nd.cuda(0)


@pytest.mark.skipif(not CUDA.enabled(), reason=f"cuda disabled: {CUDA.reason}")
def test_cuda_peak_memory_is_one_block_not_all():
    """12 blocks of 4 x 1024-wide activations on 2,048 rows: with checkpoints the peak
    holds the block inputs and one block's insides, not every block's."""
    allocator = CUDA.backend.allocator

    def peak(checkpointed):
        blocks, _ = _model(CUDA, layers=12, width=1024)
        x = ndl.Tensor(np.random.default_rng(2).standard_normal((2048, 1024))
                       .astype(np.float32), device=CUDA, requires_grad=True)
        gc.collect()
        CUDA.synchronize()
        allocator.reset_peak()
        base = allocator.stats().in_use
        _grads(blocks, x, checkpointed)
        CUDA.synchronize()
        return (allocator.stats().peak - base) / 2**20

    plain, ckpt = peak(False), peak(True)
    assert ckpt < 0.5 * plain, f"peak {ckpt:.0f} MiB with checkpoints, {plain:.0f} without"
