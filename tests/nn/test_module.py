"""Module bookkeeping: parameters, buffers, children, state dicts, modes and devices."""

import numpy as np
import pytest

import needle as ndl
from needle import nn
from needle.errors import ModelFormatError

from ..conftest import supports


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.BatchNorm1d(4))
        self.heads = {"a": nn.Linear(4, 2), "b": nn.Linear(4, 2, bias=False)}
        self.scale = nn.Parameter(ndl.Tensor([2.0]))
        self.tied = self.scale  # the same parameter twice is listed once
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.body(x)
        return self.heads["a"](h) * self.scale + self.heads["b"](h)


def test_named_parameters_and_buffers():
    net = Net()
    names = [n for n, _ in net.named_parameters()]
    assert names == ["body.layers.0.weight", "body.layers.0.bias", "body.layers.2.weight",
                     "body.layers.2.bias", "heads.a.weight", "heads.a.bias", "heads.b.weight",
                     "scale"]
    assert len(net.parameters()) == 8
    assert all(p.requires_grad for p in net.parameters())
    assert [n for n, _ in net.named_buffers()] == ["body.layers.2.running_mean",
                                                  "body.layers.2.running_var"]
    assert len(net.children()) == 4 and isinstance(net.children()[0], nn.Sequential)
    assert len(net.modules()) == 8  # Net, Sequential and its 3, two heads, Dropout
    assert set(net.state_dict()) == set(names) | {"body.layers.2.running_mean",
                                                  "body.layers.2.running_var"}


def test_train_eval_propagate():
    net = Net()
    assert net.eval() is net
    assert not any(m.training for m in net.modules())
    net.train()
    assert all(m.training for m in net.modules())


def test_state_dict_round_trip_and_snapshot():
    a, b = Net(), Net()
    x = ndl.Tensor(np.random.default_rng(0).standard_normal((5, 3)), requires_grad=False)
    a(x)  # moves BatchNorm's running statistics
    snapshot = a.state_dict()
    b.load_state_dict(snapshot)
    a.eval(), b.eval()
    np.testing.assert_array_equal(a(x).numpy(), b(x).numpy())
    # loading copies: changing b's parameters leaves a's state dict alone
    b.scale.data = ndl.Tensor([5.0])
    np.testing.assert_array_equal(snapshot["scale"].numpy(), [2.0])


def test_load_state_dict_errors():
    net = Net()
    state = net.state_dict()
    before = net.heads["a"].weight.numpy()
    with pytest.raises(ModelFormatError, match=r"missing keys \['scale'\]"):
        net.load_state_dict({k: v for k, v in state.items() if k != "scale"})
    with pytest.raises(ModelFormatError, match=r"unexpected keys \['extra'\]"):
        net.load_state_dict({**state, "extra": np.zeros(1)})
    bad = {**state, "heads.a.weight": np.zeros((2, 4)), "scale": np.ones(1) * 7}
    with pytest.raises(ModelFormatError, match=r"'heads.a.weight' has shape \(2, 4\).*\(4, 2\)"):
        net.load_state_dict(bad)
    np.testing.assert_array_equal(net.scale.numpy(), [2.0])  # nothing changed
    np.testing.assert_array_equal(net.heads["a"].weight.numpy(), before)
    net.load_state_dict({"scale": np.array([3.0])}, strict=False)
    np.testing.assert_array_equal(net.scale.numpy(), [3.0])
    assert net.scale.dtype == "float32"


def test_to_device_and_dtype(device):
    dtype = "float64" if supports(device, "float64") else "float16"
    net = Net().to(device, dtype)
    assert all(p.device == device and p.dtype == dtype for p in net.parameters())
    assert net.body.layers[2].running_mean.device == device
    x = ndl.Tensor(np.ones((4, 3)), device=device, dtype=dtype, requires_grad=False)
    out = net(x)
    assert out.device == device and out.shape == (4, 2)
    out.sum().backward()
    assert net.scale.grad.device == device


def test_checkpoint_through_save_and_load(tmp_path, device):
    a = Net().to(device)
    ndl.save({"model": a.state_dict(), "epoch": 4}, tmp_path / "m.safetensors")
    ckpt = ndl.load(tmp_path / "m.safetensors", device=device)
    b = Net().to(device)
    b.load_state_dict(ckpt["model"])
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=name)
    assert ckpt["epoch"] == 4
