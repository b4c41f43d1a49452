"""Higher-order gradients (#16 item 2): ``backward(create_graph=True)`` and
``ndl.grad(..., create_graph=True)`` build differentiable graphs of the gradient; checked
against PyTorch with Hessian-vector products and a gradient penalty."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import needle as ndl
from needle import nn, ops


@pytest.fixture(autouse=True)
def _on_the_cpu(monkeypatch):
    """These compare needle's API with PyTorch's on the CPU, in float64 where the test asks:
    the default device would be metal under NEEDLE_METAL_EMULATOR=1 (no float64)."""
    monkeypatch.setenv("NEEDLE_DEVICE", "cpu")


def _const(x):
    return ndl.Tensor(x, requires_grad=False)


def _torch_sdpa(q, k, v):
    s = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / np.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), -np.inf)
    return torch.softmax(scores, -1) @ v


CONV_W = np.random.default_rng(5).standard_normal((3, 3, 2, 4))

# (needle function, PyTorch function, input shape): each non-linear in its input
OPS = {
    "mul": (lambda x: x * x * x, lambda x: x * x * x, (4, 6)),
    "divide": (lambda x: 1.0 / (x * x + 1.0), lambda x: 1.0 / (x * x + 1.0), (4, 6)),
    "exp_log": (lambda x: ops.log(ops.exp(x) + 1.0), lambda x: torch.log(torch.exp(x) + 1),
                (4, 6)),
    "tanh": (ops.tanh, torch.tanh, (4, 6)),
    "sigmoid": (ops.sigmoid, torch.sigmoid, (4, 6)),
    "silu": (ops.silu, torch.nn.functional.silu, (4, 6)),
    "gelu": (ops.gelu, torch.nn.functional.gelu, (4, 6)),
    "sqrt_power": (lambda x: ops.sqrt(x * x + 1.0) ** 1.5,
                   lambda x: torch.sqrt(x * x + 1.0) ** 1.5, (4, 6)),
    "relu": (lambda x: ops.relu(x) * x, lambda x: torch.relu(x) * x, (4, 6)),
    "softmax": (ops.softmax, lambda x: torch.softmax(x, -1), (4, 6)),
    "log_softmax": (ops.log_softmax, lambda x: torch.log_softmax(x, -1), (4, 6)),
    "logsumexp": (lambda x: ops.logsumexp(x, axes=(1,), keepdims=True) * x,
                  lambda x: torch.logsumexp(x, 1, keepdim=True) * x, (4, 6)),
    "max": (lambda x: ops.max(x, axes=(1,), keepdims=True) * x,
            lambda x: torch.amax(x, 1, keepdim=True) * x, (4, 6)),
    "matmul": (lambda x: (x @ x.transpose()) @ x, lambda x: (x @ x.T) @ x, (4, 6)),
    "mean_broadcast": (lambda x: ops.mean(x * x, axes=(1,), keepdims=True) * x,
                       lambda x: (x * x).mean(1, keepdim=True) * x, (4, 6)),
    "views": (lambda x: ops.reshape(x * x, (6, 4)).transpose().reshape((4, 6))[1:3, ::2],
              lambda x: (x * x).reshape(6, 4).T.reshape(4, 6)[1:3, ::2], (4, 6)),
    "stack_concat": (lambda x: ops.concatenate([ops.stack([x * x, x], axis=0)[0], x], 1) * 2.0,
                     lambda x: torch.cat([torch.stack([x * x, x], 0)[0], x], 1) * 2.0,
                     (4, 6)),
    "where_maximum": (lambda x: ops.where(x > 0, x * x * x, ops.maximum(x * x, x)),
                      lambda x: torch.where(x > 0, x * x * x, torch.maximum(x * x, x)),
                      (4, 6)),
    "layernorm": (lambda x: nn.LayerNorm1d(6, dtype="float64")(x),
                  lambda x: torch.nn.functional.layer_norm(x, (6,), eps=1e-5), (4, 6)),
    "rmsnorm": (lambda x: nn.RMSNorm(6, dtype="float64")(x),
                lambda x: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6), (4, 6)),
    "cross_entropy": (lambda x: ops.softmax_cross_entropy(x, _const(np.eye(6)[[0, 1, 2, 3]]))
                      * x,
                      lambda x: torch.nn.functional.cross_entropy(x, torch.tensor([0, 1, 2, 3]))
                      * x, (4, 6)),
    "conv": (lambda x: ops.conv(x * x, _const(CONV_W), 1, 1),
             lambda x: torch.nn.functional.conv2d(
                 (x * x).permute(0, 3, 1, 2), torch.tensor(CONV_W).permute(3, 2, 0, 1),
                 padding=1).permute(0, 2, 3, 1), (2, 5, 5, 2)),
    "attention": (lambda x: ops.scaled_dot_product_attention(x, x * x, x, causal=True),
                  lambda x: _torch_sdpa(x, x * x, x), (1, 2, 4, 8)),
}


@pytest.mark.parametrize("name", list(OPS))
def test_hessian_vector_product_like_torch(name):
    fn, ft, shape = OPS[name]
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    x0 = rng.standard_normal(shape)
    x = ndl.Tensor(x0)
    out = fn(x)
    w, v = rng.standard_normal(out.shape), rng.standard_normal(shape)
    (g,) = ndl.grad((out * _const(w)).sum(), [x], create_graph=True)
    assert g.requires_grad
    (hvp,) = ndl.grad((g * _const(v)).sum(), [x])

    xt = torch.tensor(x0, requires_grad=True)
    (gt,) = torch.autograd.grad((ft(xt) * torch.tensor(w)).sum(), xt, create_graph=True)
    (hvpt,) = torch.autograd.grad((gt * torch.tensor(v)).sum(), xt)
    np.testing.assert_allclose(g.numpy(), gt.detach().numpy(), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(hvp.numpy(), hvpt.numpy(), rtol=1e-6, atol=1e-8)


def _mlps(seed: int):
    """The same two-layer MLP in needle and PyTorch (float64)."""
    rng = np.random.default_rng(seed)
    w1, b1 = rng.standard_normal((5, 8)) * 0.5, rng.standard_normal(8) * 0.1
    w2, b2 = rng.standard_normal((8, 1)) * 0.5, rng.standard_normal(1) * 0.1
    ours = nn.Sequential(nn.Linear(5, 8, dtype="float64"), nn.Tanh(),
                         nn.Linear(8, 1, dtype="float64"))
    for p, value in zip(ours.parameters(), (w1, b1, w2, b2)):
        p.data = ndl.Tensor(value)
    theirs = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    theirs = theirs.double()
    with torch.no_grad():
        for p, value in zip(theirs.parameters(), (w1.T, b1, w2.T, b2)):
            p.copy_(torch.tensor(value))
    return ours, theirs


def test_gradient_penalty_like_torch():
    """WGAN-GP: penalise the input-gradient norm of a critic, then train on it."""
    ours, theirs = _mlps(0)
    x0 = np.random.default_rng(1).standard_normal((6, 5))

    x = ndl.Tensor(x0)
    (gx,) = ndl.grad(ours(x).sum(), [x], create_graph=True)
    norm = ops.sqrt(ops.summation(gx * gx, axes=(1,)) + 1e-12)
    penalty = ((norm - 1.0) ** 2).mean()
    penalty.backward()

    xt = torch.tensor(x0, requires_grad=True)
    (gxt,) = torch.autograd.grad(theirs(xt).sum(), xt, create_graph=True)
    penalty_t = ((gxt.pow(2).sum(1) + 1e-12).sqrt() - 1).pow(2).mean()
    penalty_t.backward()

    np.testing.assert_allclose(penalty.numpy(), penalty_t.detach().numpy(), rtol=1e-10)
    got = [p.grad for p in ours.parameters()]
    want = [theirs[0].weight.grad.T, theirs[0].bias.grad, theirs[2].weight.grad.T]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-8, atol=1e-12)
    # the output bias does not change the input gradient: no gradient, in both
    assert got[3] is None and theirs[2].bias.grad is None


def test_parameter_hessian_vector_product_with_backward_create_graph():
    """backward(create_graph=True) leaves .grad as graphs: H v over all parameters."""
    ours, theirs = _mlps(2)
    x0 = np.random.default_rng(3).standard_normal((7, 5))
    y0 = np.random.default_rng(4).standard_normal((7, 1))
    vs = [np.random.default_rng(10 + i).standard_normal(p.shape)
          for i, p in enumerate(ours.parameters())]

    loss = nn.MSELoss()(ours(_const(x0)), _const(y0))
    loss.backward(create_graph=True)
    params = ours.parameters()
    assert all(p.grad.requires_grad for p in params)
    dot = sum((p.grad * _const(v)).sum() for p, v in zip(params, vs))
    hvp = ndl.grad(dot, params)

    loss_t = torch.nn.functional.mse_loss(theirs(torch.tensor(x0)), torch.tensor(y0))
    params_t = list(theirs.parameters())
    grads_t = torch.autograd.grad(loss_t, params_t, create_graph=True)
    vs_t = [torch.tensor(v.T) if v.ndim == 2 else torch.tensor(v) for v in vs]
    dot_t = sum((g * v).sum() for g, v in zip(grads_t, vs_t))
    hvp_t = torch.autograd.grad(dot_t, params_t)
    for h, ht in zip(hvp, hvp_t):
        ref = ht.numpy().T if ht.ndim == 2 else ht.numpy()
        np.testing.assert_allclose(h.numpy(), ref, rtol=1e-8, atol=1e-12)


def test_third_derivative_and_accumulation_with_create_graph():
    x = ndl.Tensor(np.array([0.3, -1.2, 2.0]))
    (d1,) = ndl.grad(ops.tanh(x).sum(), [x], create_graph=True)
    (d2,) = ndl.grad(d1.sum(), [x], create_graph=True)
    (d3,) = ndl.grad(d2.sum(), [x])
    xt = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64, requires_grad=True)
    (t1,) = torch.autograd.grad(torch.tanh(xt).sum(), xt, create_graph=True)
    (t2,) = torch.autograd.grad(t1.sum(), xt, create_graph=True)
    (t3,) = torch.autograd.grad(t2.sum(), xt)
    np.testing.assert_allclose(d3.numpy(), t3.numpy(), rtol=1e-10)
    # two backward(create_graph=True) calls accumulate into a differentiable .grad
    x.grad = None
    (x * x * x).sum().backward(create_graph=True)
    (x * x).sum().backward(create_graph=True)
    assert x.grad.requires_grad
    (second,) = ndl.grad(x.grad.sum(), [x])
    np.testing.assert_allclose(second.numpy(), 6 * x.numpy() + 2, rtol=1e-12)
    # without create_graph the stored gradient is a constant
    x.grad = None
    (x * x).sum().backward()
    assert not x.grad.requires_grad
