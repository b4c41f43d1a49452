"""Basic layers and the conv layer against their formulas (numpy) and PyTorch."""

import math

import numpy as np
import pytest
import torch

import needle as ndl
from needle import init, nn
from needle.backends.api import has

from ..conftest import assert_close


def tensor(x, device, requires_grad=True):
    return ndl.Tensor(np.asarray(x, np.float32), device=device, requires_grad=requires_grad)


def torch_t(x):
    return torch.tensor(np.asarray(x, np.float32), requires_grad=True)


@pytest.fixture
def x(rng):
    return rng.standard_normal((6, 5)).astype(np.float32)


def test_linear(device, x):
    layer = nn.Linear(5, 3, device=device)
    assert layer.weight.shape == (5, 3) and layer.bias.shape == (3,)
    assert np.abs(layer.bias.numpy()).max() <= 1 / math.sqrt(5)
    w, b = layer.weight.numpy(), layer.bias.numpy()
    assert_close(layer(tensor(x, device)), x @ w + b, "float32", "matmul")
    no_bias = nn.Linear(5, 3, bias=False, device=device)
    assert no_bias.bias is None and len(no_bias.parameters()) == 1
    seq = tensor(np.stack([x, x]), device)  # (2, 6, 5): applies to the last axis
    assert_close(no_bias(seq), np.stack([x, x]) @ no_bias.weight.numpy(), "float32", "matmul")


@pytest.mark.parametrize("module,reference", [
    (nn.ReLU, lambda v: np.maximum(v, 0)),
    (nn.Tanh, np.tanh),
    (nn.Sigmoid, lambda v: 1 / (1 + np.exp(-v))),
    (nn.SiLU, lambda v: v / (1 + np.exp(-v))),
    (nn.GELU, lambda v: torch.nn.functional.gelu(torch.tensor(v)).numpy()),
    (nn.Identity, lambda v: v),
])
def test_activations(device, x, module, reference):
    assert_close(module()(tensor(x, device)), reference(x), "float32")


def test_flatten_sequential_residual(device, rng):
    images = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    assert nn.Flatten()(tensor(images, device)).shape == (2, 60)
    lin = nn.Linear(60, 60, device=device)
    model = nn.Sequential(nn.Flatten(), nn.Residual(nn.Sequential(lin, nn.ReLU())))
    flat = images.reshape(2, 60)
    expected = np.maximum(flat @ lin.weight.numpy() + lin.bias.numpy(), 0) + flat
    assert_close(model(tensor(images, device)), expected, "float32", "matmul")


def test_softmax_loss_and_gradient(device, rng):
    logits = rng.standard_normal((7, 4)).astype(np.float32) * 3
    labels = rng.integers(0, 4, 7)
    t = tensor(logits, device)
    loss = nn.SoftmaxLoss()(t, ndl.Tensor(labels, device=device, requires_grad=False))
    loss.backward()
    ref = torch_t(logits)
    ref_loss = torch.nn.functional.cross_entropy(ref, torch.tensor(labels))
    ref_loss.backward()
    assert_close(loss, ref_loss.detach().numpy(), "float32", "reduction")
    assert_close(t.grad, ref.grad.numpy(), "float32", "reduction")
    seq = tensor(logits.reshape(7, 1, 4), device)  # (..., classes) with labels (...)
    loss2 = nn.SoftmaxLoss()(seq, ndl.Tensor(labels.reshape(7, 1), device=device))
    assert_close(loss2, ref_loss.detach().numpy(), "float32", "reduction")
    with pytest.raises(ndl.ShapeError, match="labels"):
        nn.SoftmaxLoss()(t, ndl.Tensor(labels[:3], device=device))


def test_out_of_range_labels_raise_on_host_and_poison_the_loss_on_a_gpu(device, rng):
    """Host labels are checked at once; labels on a GPU are not read back (that would stall
    the device), so each out-of-range label makes its loss NaN instead of a wrong number."""
    logits = rng.standard_normal((5, 4)).astype(np.float32)
    good = np.array([0, 3, 1, 2, 3])
    bad = np.array([0, 4, 1, -1, 3])
    t = tensor(logits, device)
    ref = torch.nn.functional.cross_entropy(torch_t(logits), torch.tensor(good)).item()
    assert_close(nn.SoftmaxLoss()(t, ndl.Tensor(good, device=device)), ref, "float32",
                 "reduction")
    labels = ndl.Tensor(bad, device=device)
    if has(device.backend, "host_memory"):
        with pytest.raises(ndl.IndexOutOfRangeError, match="label"):
            nn.SoftmaxLoss()(t, labels)
        return
    assert np.isnan(nn.SoftmaxLoss()(t, labels).numpy())
    per_row = nn.CrossEntropyLoss(reduction="none")(t, labels).numpy()
    np.testing.assert_array_equal(np.isnan(per_row), (bad < 0) | (bad >= 4))
    finite = ~np.isnan(per_row)
    want = torch.nn.functional.cross_entropy(torch_t(logits), torch.tensor(np.clip(bad, 0, 3)),
                                             reduction="none").detach().numpy()
    np.testing.assert_allclose(per_row[finite], want[finite], rtol=1e-5, atol=1e-6)


def batchnorm_pair(dim, device, two_d):
    ours = (nn.BatchNorm2d if two_d else nn.BatchNorm1d)(dim, momentum=0.2, device=device)
    theirs = (torch.nn.BatchNorm2d if two_d else torch.nn.BatchNorm1d)(dim, momentum=0.2)
    w = np.linspace(0.5, 1.5, dim).astype(np.float32)
    b = np.linspace(-1, 1, dim).astype(np.float32)
    ours.weight.data = ndl.Tensor(w, device=device)
    ours.bias.data = ndl.Tensor(b, device=device)
    with torch.no_grad():
        theirs.weight.copy_(torch.tensor(w))
        theirs.bias.copy_(torch.tensor(b))
    return ours, theirs


@pytest.mark.parametrize("two_d", [False, True])
def test_batchnorm_against_torch(device, rng, two_d):
    shape = (8, 3, 4, 5) if two_d else (8, 3)
    ours, theirs = batchnorm_pair(3, device, two_d)
    for step in range(2):  # training: batch statistics and running averages
        data = rng.standard_normal(shape).astype(np.float32) * 2 + step
        t, r = tensor(data, device), torch_t(data)
        out, ref = ours(t), theirs(r)
        assert_close(out, ref.detach().numpy(), "float32", "reduction")
        upstream = rng.standard_normal(shape).astype(np.float32)
        (out * tensor(upstream, device, False)).sum().backward()
        (ref * torch.tensor(upstream)).sum().backward()
        assert_close(t.grad, r.grad.numpy(), "float32", "reduction")
        assert_close(ours.weight.grad, theirs.weight.grad.numpy(), "float32", "reduction")
    assert_close(ours.running_mean, theirs.running_mean.numpy(), "float32", "reduction")
    assert_close(ours.running_var, theirs.running_var.numpy(), "float32", "reduction")
    ours.eval(), theirs.eval()
    data = rng.standard_normal(shape).astype(np.float32)
    assert_close(ours(tensor(data, device)), theirs(torch_t(data)).detach().numpy(), "float32",
                 "reduction")


def test_batchnorm_rejects_wrong_width(device):
    with pytest.raises(ndl.ShapeError, match="BatchNorm1d"):
        nn.BatchNorm1d(3, device=device)(tensor(np.zeros((2, 4)), device))


def test_layernorm_and_rmsnorm(device, rng):
    data = rng.standard_normal((2, 3, 8)).astype(np.float32)
    ln = nn.LayerNorm1d(8, eps=1e-5, device=device)
    ln.weight.data = ndl.Tensor(np.arange(8, dtype=np.float32), device=device)
    ln.bias.data = ndl.Tensor(np.ones(8, np.float32), device=device)
    mu, var = data.mean(-1, keepdims=True), data.var(-1, keepdims=True)
    assert_close(ln(tensor(data, device)), (data - mu) / np.sqrt(var + 1e-5) * np.arange(8) + 1,
                 "float32", "reduction")
    rms = nn.RMSNorm(8, eps=1e-6, device=device)
    expected = data / np.sqrt((data**2).mean(-1, keepdims=True) + 1e-6)
    assert_close(rms(tensor(data, device)), expected, "float32", "reduction")
    t = tensor(data, device)
    rms(t).sum().backward()
    assert rms.weight.grad.shape == (8,) and t.grad.shape == data.shape


def test_dropout(device):
    init.manual_seed(0)
    drop = nn.Dropout(0.25)
    ones = tensor(np.ones((200, 50)), device)
    out = drop(ones).numpy()
    kept = out != 0
    assert abs(kept.mean() - 0.75) < 0.02
    np.testing.assert_allclose(out[kept], 1 / 0.75, rtol=1e-6)
    drop.eval()
    np.testing.assert_array_equal(drop(ones).numpy(), ones.numpy())
    assert not nn.Dropout(1.0)(ones).numpy().any()
    with pytest.raises(ndl.ArgumentError):
        nn.Dropout(1.5)


@pytest.mark.parametrize("stride,padding", [(1, None), (2, None), (2, 0)])
def test_conv_against_torch(device, rng, stride, padding):
    images = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    conv = nn.Conv(3, 4, 3, stride=stride, padding=padding, device=device)
    assert conv.weight.shape == (3, 3, 3, 4)
    t = tensor(images, device)
    out = conv(t)
    ref_in = torch_t(images)
    ref_w = torch.tensor(conv.weight.numpy().transpose(3, 2, 0, 1), requires_grad=True)
    ref_b = torch.tensor(conv.bias.numpy(), requires_grad=True)
    ref = torch.nn.functional.conv2d(ref_in, ref_w, ref_b, stride=stride,
                                     padding=1 if padding is None else padding)
    assert_close(out, ref.detach().numpy(), "float32", "matmul")
    upstream = rng.standard_normal(ref.shape).astype(np.float32)
    (out * tensor(upstream, device, False)).sum().backward()
    (ref * torch.tensor(upstream)).sum().backward()
    assert_close(t.grad, ref_in.grad.numpy(), "float32", "matmul")
    assert_close(conv.weight.grad, ref_w.grad.numpy().transpose(2, 3, 1, 0), "float32", "matmul")
    assert_close(conv.bias.grad, ref_b.grad.numpy(), "float32", "reduction")


def test_conv_checks_input(device):
    with pytest.raises(ndl.ShapeError, match="NCHW"):
        nn.Conv(3, 4, 3, device=device)(tensor(np.zeros((1, 4, 5, 5)), device))
