"""PyTorch habits (#16 item 4): each name is checked against CPU PyTorch where it has an
answer to compare with."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import needle as ndl
from needle import cli, nn
from needle.errors import ArgumentError, AxisError, DeviceError


@pytest.fixture(autouse=True)
def _on_the_cpu(monkeypatch):
    """These compare needle's API with PyTorch's on the CPU, in float64 where the test asks:
    the default device would be metal under NEEDLE_METAL_EMULATOR=1 (no float64)."""
    monkeypatch.setenv("NEEDLE_DEVICE", "cpu")


def same(t: ndl.Tensor, ref: torch.Tensor, rtol=1e-6, atol=1e-6):
    assert t.dtype == str(ref.dtype).removeprefix("torch."), (t.dtype, ref.dtype)
    assert tuple(t.shape) == tuple(ref.shape)
    np.testing.assert_allclose(t.numpy().astype(np.float64),
                               ref.detach().numpy().astype(np.float64), rtol=rtol, atol=atol)


# --- factories -------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [[1.5, 2.0], [1, 2, 3], 2.5, 7, [True, False],
                                  np.arange(4, dtype=np.float64), np.ones((2, 2), np.float32),
                                  np.arange(3, dtype=np.int32)],
                         ids=lambda d: type(d).__name__)
def test_tensor_like_torch_tensor(data):
    t, ref = ndl.tensor(data), torch.tensor(data)
    same(t, ref)
    assert not t.requires_grad
    assert ndl.tensor([1.0], requires_grad=True).requires_grad
    assert ndl.tensor([1, 2], dtype="float32").dtype == "float32"


def test_constant_factories_like_torch():
    for name in ("zeros", "ones"):
        same(getattr(ndl, name)(2, 3), getattr(torch, name)(2, 3))
        same(getattr(ndl, name)((2, 3)), getattr(torch, name)((2, 3)))
        same(getattr(ndl, name)(4, dtype="int64"), getattr(torch, name)(4, dtype=torch.int64))
    for value in (2.5, 3, True):
        same(ndl.full((2, 2), value), torch.full((2, 2), value))
    same(ndl.full(3, 1.0, dtype="float64"), torch.full((3,), 1.0, dtype=torch.float64))
    x = ndl.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    xt = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    same(ndl.zeros_like(x), torch.zeros_like(xt))
    same(ndl.ones_like(x, dtype="int32"), torch.ones_like(xt, dtype=torch.int32))
    same(ndl.full_like(x, 7.0), torch.full_like(xt, 7.0))
    assert ndl.zeros(2, requires_grad=True).requires_grad


@pytest.mark.parametrize("args", [(5,), (2, 7), (1, 2, 0.25), (0.5, 3.0), (10, 0, -3),
                                  (3, 3)])
def test_arange_like_torch(args):
    same(ndl.arange(*args), torch.arange(*args))


def test_arange_rejects_zero_step():
    with pytest.raises(TypeError):
        ndl.arange(0, 5, 0)


def test_random_factories_and_manual_seed():
    ndl.manual_seed(3)
    a = (ndl.randn(3, 4), ndl.rand(2, 2), nn.Linear(3, 2).weight.numpy(),
         nn.Dropout(0.5)(ndl.ones(100)).numpy())
    ndl.manual_seed(3)
    b = (ndl.randn(3, 4), ndl.rand(2, 2), nn.Linear(3, 2).weight.numpy(),
         nn.Dropout(0.5)(ndl.ones(100)).numpy())
    np.testing.assert_array_equal(a[0].numpy(), b[0].numpy())
    np.testing.assert_array_equal(a[1].numpy(), b[1].numpy())
    np.testing.assert_array_equal(a[2], b[2])
    np.testing.assert_array_equal(a[3], b[3])  # dropout masks too
    assert a[0].dtype == "float32" and a[0].shape == (3, 4)
    u = ndl.rand(1000).numpy()
    assert 0 <= u.min() and u.max() < 1
    # shuffling and transforms follow the same seed
    ds = ndl.data.ArrayDataset(np.arange(20, dtype=np.float32).reshape(20, 1, 1, 1),
                               transforms=[ndl.data.RandomFlipHorizontal()])

    def epoch():
        ndl.manual_seed(9)
        return [b[0].numpy().ravel().tolist()
                for b in ndl.data.DataLoader(ds, batch_size=5, shuffle=True)]

    assert epoch() == epoch()


def test_cat_like_torch():
    a, b = np.ones((2, 3), np.float32), np.zeros((2, 2), np.float32)
    same(ndl.cat([ndl.tensor(a), ndl.tensor(b)], dim=1),
         torch.cat([torch.tensor(a), torch.tensor(b)], dim=1))
    x = ndl.tensor(a, requires_grad=True)
    ndl.cat([x, x], dim=0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.full((2, 3), 2.0))


# --- Tensor methods ----------------------------------------------------------------------------


def _pair(shape=(2, 3, 4), seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return ndl.tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)


def test_tensor_shape_methods_like_torch():
    x, xt = _pair()
    same(x.T, xt.permute(2, 1, 0))
    m, mt = _pair((3, 5))
    same(m.T, mt.T)
    same(x.view(6, 4), xt.view(6, 4))
    same(x.view(-1), xt.view(-1))
    same(x.reshape(4, 6), xt.reshape(4, 6))
    same(x.reshape((4, -1)), xt.reshape((4, -1)))
    assert x.tolist() == xt.tolist()
    assert ndl.tensor(3.5).tolist() == 3.5
    assert (x.numel(), x.dim()) == (xt.numel(), xt.dim())


def test_argmax_like_torch():
    x, xt = _pair()
    same(x.argmax(), xt.argmax())
    for dim in (0, 1, -1):
        same(x.argmax(dim=dim), xt.argmax(dim=dim))
        same(x.argmax(dim, keepdim=True), xt.argmax(dim, keepdim=True))
    assert not x.argmax().requires_grad
    with pytest.raises(AxisError):
        x.argmax(dim=(0, 1))


def test_reductions_take_dim_and_keepdim():
    x, xt = _pair()
    for dim in (0, 1, (0, 2), -1):
        for keepdim in (False, True):
            same(x.sum(dim=dim, keepdim=keepdim), xt.sum(dim=dim, keepdim=keepdim), rtol=1e-5)
            same(x.mean(dim=dim, keepdim=keepdim), xt.mean(dim=dim, keepdim=keepdim),
                 rtol=1e-5)
    same(x.sum(axes=(1,), keepdims=True), xt.sum(dim=1, keepdim=True), rtol=1e-5)
    same(x.sum(), xt.sum(), rtol=1e-5)
    values, indices = x.max(dim=1)  # PyTorch's (values, indices)
    ref = xt.max(dim=1)
    same(values, ref.values)
    same(indices, ref.indices)
    assert x.max(dim=2, keepdim=True).values.shape == (2, 3, 1)
    same(x.max(axes=1), ref.values)  # needle's form gives the values
    with pytest.raises(ArgumentError):
        x.sum(axes=0, dim=1)
    # gradients through the dim= forms match PyTorch's
    (x.sum(dim=1) * 2.0).sum().backward()
    (xt.sum(dim=1) * 2.0).sum().backward()
    same(x.grad, xt.grad)


def test_clone_contiguous_and_dtype_shorthands():
    x, xt = _pair((3, 4))
    c = x.clone()
    assert c.realize_cached_data()._handle is not x.realize_cached_data()._handle
    (c * 3.0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.full((3, 4), 3.0))  # differentiable
    t = x.transpose()
    assert not t.realize_cached_data().is_compact()
    assert t.contiguous().realize_cached_data().is_compact()
    same(t.contiguous(), xt.t().contiguous())
    assert x.contiguous() is x
    for method in ("float", "half", "bfloat16", "double", "long", "int"):
        got, ref = getattr(x, method)(), getattr(xt, method)()
        assert got.dtype == str(ref.dtype).removeprefix("torch.")
    same(x.half(), xt.half(), rtol=1e-3)


def test_cpu_and_cuda_methods():
    x = ndl.tensor([1.0, 2.0], device=ndl.cpu_numpy())
    assert x.cpu() is x
    if ndl.cuda(0).enabled():
        assert x.cuda().device == ndl.cuda(0)
        assert ndl.tensor([1.0], device=0).device == ndl.cuda(0)
    else:
        with pytest.raises(DeviceError, match="cuda:0"):
            x.cuda()
        with pytest.raises(DeviceError, match="cuda:0"):
            ndl.tensor([1.0], device=0)  # device=0 means cuda:0, as in PyTorch
        with pytest.raises(DeviceError, match="cuda:0"):
            ndl.Tensor([1.0], device=0)


# --- nn ------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_loss_like_torch(reduction):
    rng = np.random.default_rng(0)
    z = rng.standard_normal((6, 5)).astype(np.float32)
    y = rng.integers(0, 5, 6)
    zn, zt = ndl.tensor(z, requires_grad=True), torch.tensor(z, requires_grad=True)
    loss = nn.CrossEntropyLoss(reduction)(zn, ndl.tensor(y))
    ref = torch.nn.CrossEntropyLoss(reduction=reduction)(zt, torch.tensor(y))
    same(loss, ref, rtol=1e-5)
    loss.sum().backward()
    ref.sum().backward()
    same(zn.grad, zt.grad, rtol=1e-5)
    with pytest.raises(IndexError):
        nn.CrossEntropyLoss(reduction)(zn, ndl.tensor(np.array([0, 1, 2, 3, 4, 5])))
    with pytest.raises(ArgumentError):
        nn.CrossEntropyLoss("avg")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss_like_torch(reduction):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 4, 3)).astype(np.float32)
    an, at = ndl.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)
    loss = nn.MSELoss(reduction)(an, ndl.tensor(b))
    ref = torch.nn.MSELoss(reduction=reduction)(at, torch.tensor(b))
    same(loss, ref, rtol=1e-5)
    loss.sum().backward()
    ref.sum().backward()
    same(an.grad, at.grad, rtol=1e-5)


@pytest.mark.parametrize("kernel,stride,padding", [(3, 1, 0), (3, 2, 1), (1, 1, 0),
                                                   (5, 1, "same"), ((3, 3), (2, 2), (1, 1))])
def test_conv2d_like_torch(kernel, stride, padding):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    conv = nn.Conv2d(3, 4, kernel, stride=stride, padding=padding)
    ref = torch.nn.Conv2d(3, 4, kernel, stride=stride, padding=padding)
    with torch.no_grad():  # PyTorch's weight (out, in, kh, kw) is needle's permuted
        ref.weight.copy_(torch.tensor(conv.weight.numpy()).permute(3, 2, 0, 1))
        ref.bias.copy_(torch.tensor(conv.bias.numpy()))
    xn, xt = ndl.tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
    out, expected = conv(xn), ref(xt)
    same(out, expected, rtol=1e-4, atol=1e-5)
    out.sum().backward()
    expected.sum().backward()
    same(xn.grad, xt.grad, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(conv.weight.grad.numpy(),
                               ref.weight.grad.permute(2, 3, 1, 0).numpy(), rtol=1e-4,
                               atol=1e-4)


def test_conv2d_rejects_what_it_cannot_do():
    with pytest.raises(ArgumentError):
        nn.Conv2d(3, 4, (3, 5))
    with pytest.raises(ArgumentError):
        nn.Conv2d(3, 4, 4, padding="same")


def test_module_repr_like_torch():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2),
                                                                    nn.Tanh()))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                              torch.nn.Sequential(torch.nn.Linear(8, 2), torch.nn.Tanh()))
    assert repr(model) == repr(ref)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(2, 3, bias=False)
            self.head = nn.Dropout(0.25)

    assert repr(Net()) == ("Net(\n  (body): Linear(in_features=2, out_features=3, bias=False)"
                           "\n  (head): Dropout(p=0.25)\n)")


# --- DataLoader workers --------------------------------------------------------------------


class _SlowDataset(ndl.data.Dataset):
    """Each batch waits at a barrier that needs two batches loading at the same time: it
    only completes when the loader really loads in parallel."""

    def __init__(self, n: int, parties: int):
        super().__init__()
        self.x = np.arange(n, dtype=np.float32)[:, None]
        self.barrier = threading.Barrier(parties, timeout=20) if parties > 1 else None
        self.threads: set[str] = set()

    def __len__(self):
        return len(self.x)

    def get_batch(self, indices):
        self.threads.add(threading.current_thread().name)
        if self.barrier is not None:
            self.barrier.wait()
        return (self.x[indices],)


def test_dataloader_workers_load_in_parallel_and_in_order():
    ds = _SlowDataset(16, parties=2)
    loader = ndl.data.DataLoader(ds, batch_size=2, shuffle=True, seed=5, num_workers=2)
    got = [b[0].numpy().ravel().tolist() for b in loader]
    serial = ndl.data.DataLoader(_SlowDataset(16, parties=1), batch_size=2, shuffle=True,
                                 seed=5)
    assert got == [b[0].numpy().ravel().tolist() for b in serial]
    assert len(ds.threads) == 2 and all(n.startswith("needle-loader") for n in ds.threads)


def test_dataloader_workers_stop_early_and_report_errors():
    loader = ndl.data.DataLoader(_SlowDataset(40, parties=1), batch_size=2, num_workers=3)
    for k, _ in enumerate(loader):
        if k == 1:
            break
    assert [b[0].shape for b in loader][-1] == (2, 1)

    class Broken(_SlowDataset):
        def get_batch(self, indices):
            if 6 in indices:
                raise ValueError("bad sample 6")
            return super().get_batch(indices)

    with pytest.raises(ValueError, match="bad sample 6"):
        list(ndl.data.DataLoader(Broken(10, parties=1), batch_size=2, num_workers=2))
    with pytest.raises(TypeError):
        ndl.data.DataLoader(Broken(10, parties=1), num_workers=1.5)
    with pytest.raises(ValueError):
        ndl.data.DataLoader(Broken(10, parties=1), num_workers=-1)


# --- the needle command ----------------------------------------------------------------------


def test_cli_version_and_unknown_command(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"needle {ndl.__version__}"
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'" in err
    for name in ("devices", "demo", "generate"):
        assert name in err
