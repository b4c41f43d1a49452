"""Devices: names, enabled() and the reason a device is disabled, default_device() and
NEEDLE_DEVICE, device_from_name, and the constructors a Device offers."""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backend_ndarray import device as device_module
from needle.errors import DeviceError

from ..conftest import assert_equal, enabled_devices


def test_all_devices_are_listed_with_a_state():
    devices = nd.all_devices()
    names = [d.name for d in devices]
    assert len(names) == len(set(names))
    assert {"cpu_numpy", "cpu", "metal", "cuda:0"} <= set(names)
    for d in devices:
        assert isinstance(d.enabled(), bool)
        if d.enabled():
            assert d.reason is None
        else:
            assert isinstance(d.reason, str) and d.reason, f"{d.name} is disabled without a reason"


def test_reference_device_is_always_enabled():
    assert nd.cpu_numpy().enabled()
    assert nd.cpu_numpy() in enabled_devices()


def test_devices_are_singletons_compared_by_name():
    assert nd.cpu() is nd.cpu()
    assert nd.cuda(0) is nd.cuda()
    assert nd.cpu_numpy() == nd.device_from_name("cpu_numpy")
    assert nd.cpu() != nd.cpu_numpy()
    assert hash(nd.metal()) == hash(nd.device_from_name("metal"))
    assert repr(nd.cuda(1)) == "cuda(1)" and nd.cuda(1).name == "cuda:1"
    assert repr(nd.cpu_numpy()) == "cpu_numpy()"


@pytest.mark.parametrize("name,want", [
    ("cpu_numpy", "cpu_numpy"), ("cpu", "cpu"), (" CPU ", "cpu"), ("metal", "metal"),
    ("cuda", "cuda:0"), ("cuda:0", "cuda:0"), ("cuda:2", "cuda:2"), ("Cuda:1", "cuda:1"),
])
def test_device_from_name(name, want):
    assert nd.device_from_name(name).name == want


@pytest.mark.parametrize("name", ["auto", "default", ""])
def test_device_from_name_auto_is_the_default(name, monkeypatch):
    monkeypatch.delenv("NEEDLE_DEVICE", raising=False)
    assert nd.device_from_name(name) == nd.default_device()


@pytest.mark.parametrize("name,message", [
    ("tpu", "unknown device"), ("gpu", "unknown device"), ("cpu:1", "bad device index"),
    ("cuda:x", "bad device index"), ("cuda:-1", "bad device index"), ("metal:0", "bad device"),
])
def test_device_from_name_rejects(name, message):
    with pytest.raises(DeviceError, match=message):
        nd.device_from_name(name)


@pytest.mark.parametrize("index", [-1, "0", 1.0])
def test_cuda_index_must_be_a_non_negative_int(index):
    with pytest.raises(DeviceError, match="non-negative int"):
        nd.cuda(index)


def test_default_device_prefers_gpus_then_cpu(monkeypatch):
    monkeypatch.delenv("NEEDLE_DEVICE", raising=False)
    order = [nd.cuda(0), nd.metal(), nd.cpu(), nd.cpu_numpy()]
    want = next(d for d in order if d.enabled())
    assert nd.default_device() == want


def test_needle_device_names_the_default(monkeypatch):
    for dev in enabled_devices():
        monkeypatch.setenv("NEEDLE_DEVICE", dev.name)
        assert nd.default_device() == dev
        assert nd.array([1.0, 2.0]).device == dev  # arrays without a device go there
    monkeypatch.setenv("NEEDLE_DEVICE", "cpu_numpy")
    assert nd.zeros((2,)).device == nd.cpu_numpy()


def test_needle_device_naming_a_disabled_device_says_why(monkeypatch):
    disabled = [d for d in nd.all_devices() if not d.enabled()]
    if not disabled:
        pytest.skip("every device is enabled here")
    for dev in disabled:
        monkeypatch.setenv("NEEDLE_DEVICE", dev.name)
        with pytest.raises(DeviceError, match="disabled device") as e:
            nd.default_device()
        assert dev.reason in str(e.value)


def test_needle_device_unknown_name(monkeypatch):
    monkeypatch.setenv("NEEDLE_DEVICE", "quantum")
    with pytest.raises(DeviceError, match="unknown device"):
        nd.default_device()


def _fresh_device(monkeypatch, tmp_path, source: str | None) -> nd.Device:
    """A Device whose backend module is a temporary package (``source`` is its
    ``__init__.py``; None leaves a bare folder, a namespace package)."""
    name = f"fake_backend_{tmp_path.name}"  # one module name per test: imports are cached
    pkg = tmp_path / name
    pkg.mkdir()
    if source is not None:
        (pkg / "__init__.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(device_module._MODULES, "cpu", name)
    return device_module.Device("cpu")  # not the cached cpu(): the real one stays as it is


def test_backend_folder_without_a_package_is_disabled(monkeypatch, tmp_path):
    dev = _fresh_device(monkeypatch, tmp_path, None)
    assert not dev.enabled()
    assert "does not implement the array API" in dev.reason


def test_backend_that_cannot_load_is_disabled_with_its_reason(monkeypatch, tmp_path):
    source = ("from needle.errors import DeviceError\n"
              "def load(index):\n"
              "    raise DeviceError('extension _cpu not built: run pip install -e .')\n")
    dev = _fresh_device(monkeypatch, tmp_path, source)
    assert not dev.enabled()
    assert dev.reason == "extension _cpu not built: run pip install -e ."
    with pytest.raises(DeviceError, match="not built"):
        dev.backend  # noqa: B018


def test_backend_that_fails_to_import_is_disabled(monkeypatch, tmp_path):
    dev = _fresh_device(monkeypatch, tmp_path, "import a_module_that_does_not_exist\n")
    assert not dev.enabled()
    assert "could not be imported" in dev.reason


def test_synchronize(device):
    a = nd.ones((100,), device=device) * 3.0
    device.synchronize()
    assert a.sum().item() == 300.0


def test_device_constructors(device):
    e = device.empty((2, 3), "int32")
    assert (e.shape, e.dtype, e.device) == ((2, 3), "int32", device)
    assert_equal(device.full((2,), 7, "int64"), np.full(2, 7))
    r = device.rand(3, 4, generator=np.random.default_rng(0))
    assert r.shape == (3, 4) and r.dtype == "float32"
    x = r.numpy()
    assert ((0 <= x) & (x < 1)).all()
    r2 = device.rand(3, 4, generator=np.random.default_rng(0))
    assert_equal(r2, x)  # a seeded generator makes the same numbers on every device
    n = device.randn(1000, dtype="float32", generator=np.random.default_rng(1)).numpy()
    assert abs(n.mean()) < 0.2 and 0.8 < n.std() < 1.2
    h = device.one_hot(4, [0, 3, 1])
    assert_equal(h, np.eye(4, dtype=np.float32)[[0, 3, 1]])
    h2 = device.one_hot(3, nd.array(np.array([2, 0]), device=device), dtype="int32")
    assert h2.dtype == "int32"
    assert_equal(h2, np.eye(3, dtype=np.int32)[[2, 0]])
