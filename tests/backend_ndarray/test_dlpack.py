"""DLPack exchange with numpy and PyTorch on CPU devices: zero-copy both ways, so a write on
one side is seen on the other."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import needle.backend_ndarray as nd
from needle.errors import DTypeError

from ..conftest import assert_equal
from .compare import np_dtype, on

EXCHANGED = ("float32", "float16", "float64", "int32", "int64", "bool", "uint8", "int8")


HOST_DEVICES = [d for d in nd.all_devices() if d.kind in ("cpu", "cpu_numpy")]


@pytest.fixture(params=HOST_DEVICES, ids=[d.name for d in HOST_DEVICES])
def host_device(request):
    """CPU devices only: their buffers are host memory that numpy and torch can alias (GPU
    devices' exchange is tested in tests/backends)."""
    device = request.param
    if not device.enabled():
        pytest.skip(f"{device.name} disabled: {device.reason}")
    assert nd.array([1.0], device=device).__dlpack_device__()[0] == 1  # kDLCPU
    return device


def _data(dtype):
    x = np.arange(12).reshape(3, 4)
    return (x % 2 == 0) if dtype == "bool" else x.astype(np_dtype(dtype))


@pytest.mark.parametrize("dtype", EXCHANGED)
def test_export_to_numpy_is_zero_copy(host_device, dtype):
    a = on(host_device, _data(dtype))
    x = np.from_dlpack(a)
    assert x.dtype == np_dtype(dtype) and x.shape == (3, 4)
    assert_equal(x, _data(dtype))
    x[1, 2] = 0  # numpy writes, needle sees
    a[0, 0] = 0  # needle writes, numpy sees
    want = _data(dtype)
    want[1, 2] = want[0, 0] = 0
    assert_equal(a, want)
    assert_equal(x, want)


@pytest.mark.parametrize("dtype", EXCHANGED)
def test_export_to_torch_is_zero_copy(host_device, dtype):
    a = on(host_device, _data(dtype))
    t = torch.from_dlpack(a)
    assert tuple(t.shape) == (3, 4)
    t[2, 3] = 0
    a[1, 1] = 0
    want = _data(dtype)
    want[2, 3] = want[1, 1] = 0
    assert_equal(a, want)
    assert_equal(t.numpy(), want)


@pytest.mark.parametrize("view", ["transposed", "sliced", "broadcast", "row"])
def test_export_strided_views(host_device, view):
    a = on(host_device, _data("float32"))
    v = {"transposed": lambda t: t.transpose((1, 0)), "sliced": lambda t: t[1:, ::2],
         "broadcast": lambda t: t[0].broadcast_to((2, 4)), "row": lambda t: t[2]}[view](a)
    want = v.numpy()
    assert_equal(np.from_dlpack(v), want)
    assert_equal(torch.from_dlpack(v).numpy(), want)
    if view != "broadcast":  # a write through the exported view reaches the array
        torch.from_dlpack(v).fill_(-1)
        assert (v.numpy() == -1).all()


def test_export_negative_strides_copies_safely(host_device):
    """torch aborts the process on negative DLPack strides; needle exports a copy instead."""
    a = on(host_device, _data("float32"))
    v = a[:, ::-1]
    assert_equal(torch.from_dlpack(v).numpy(), _data("float32")[:, ::-1])
    assert_equal(np.from_dlpack(v), _data("float32")[:, ::-1])


@pytest.mark.parametrize("dtype", EXCHANGED)
def test_import_from_numpy_is_zero_copy(host_device, dtype):
    x = _data(dtype)
    a = nd.from_dlpack(x, device=host_device)
    assert a.device == host_device and a.dtype == dtype
    x[0, 1] = 0
    a[2, 0] = 0
    want = _data(dtype)
    want[0, 1] = want[2, 0] = 0
    assert_equal(a, want)
    assert_equal(x, want)
    assert_equal(a + a, want.astype(np.int64) * 2 if dtype == "bool" else want + want)


def test_import_from_torch_is_zero_copy_with_strides(host_device):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    a = nd.from_dlpack(t.T, device=host_device)  # a transposed tensor keeps its strides
    assert a.shape == (4, 3)
    t[0, 1] = 100.0
    assert a.numpy()[1, 0] == 100.0
    a[3, 2] = -7.0
    assert t[2, 3].item() == -7.0
    assert_equal(a.sum(axis=0), t.T.sum(dim=0).numpy())


def test_import_copies_when_it_must(host_device):
    """Negative strides and empty arrays come in as copies, with the right values."""
    x = np.arange(6.0, dtype=np.float32)[::-1]
    a = nd.from_dlpack(x, device=host_device)
    assert_equal(a, x)
    e = nd.from_dlpack(np.zeros((0, 3), np.float32), device=host_device)
    assert e.shape == (0, 3)


def test_roundtrip_numpy_needle_torch(host_device):
    x = np.linspace(-1, 1, 10, dtype=np.float32)
    t = torch.from_dlpack(nd.from_dlpack(x, device=host_device))
    t.mul_(2)
    np.testing.assert_array_equal(x, np.linspace(-1, 1, 10, dtype=np.float32) * 2)


def test_bfloat16_is_refused_with_a_dtype_error(host_device):
    a = nd.zeros((2,), "bfloat16", host_device)
    with pytest.raises(DTypeError, match="bfloat16"):
        a.__dlpack__()
    with pytest.raises(DTypeError, match="DLPack"):
        nd.from_dlpack(torch.ones(2, dtype=torch.bfloat16), device=host_device)


def test_dlpack_device_is_cpu(host_device):
    assert on(host_device, _data("int32")).__dlpack_device__() == (1, 0)
