"""Checkpoints: round trips of nested state, interoperability with the safetensors package,
atomic writes, and errors that name the broken file."""

import json
import os
import struct

import numpy as np
import pytest

import needle as ndl
import needle.backend_ndarray as nd
from needle.errors import ModelFormatError


def sample_state(device):
    rng = np.random.default_rng(0)
    return {
        "model": {"fc.weight": nd.array(rng.standard_normal((3, 4)), device=device),
                  "fc.bias": ndl.Tensor(rng.standard_normal(4), device=device)},
        "optimizer": {"type": "Adam", "step": 7, "hyper": {"lr": 1e-3, "betas": [0.9, 0.99]},
                      "state": {"0": {"m": rng.standard_normal((3, 4)).astype(np.float32)}}},
        "epoch": 3, "note": "hello", "best": None,
        "half": nd.array(rng.standard_normal(5), dtype="bfloat16", device=device),
        "ids": np.arange(6, dtype=np.int64).reshape(2, 3), "mask": np.array([True, False]),
        "empty": np.zeros((0, 2), np.float32),
    }


def test_round_trip(tmp_path, device):
    state = sample_state(device)
    ndl.save(state, tmp_path / "ck.safetensors")
    back = ndl.load(tmp_path / "ck.safetensors", device=device)
    assert back.keys() == state.keys()
    assert back["model"].keys() == {"fc.weight", "fc.bias"}
    assert (back["epoch"], back["note"], back["best"]) == (3, "hello", None)
    assert back["optimizer"]["hyper"] == {"lr": 1e-3, "betas": [0.9, 0.99]}
    assert back["optimizer"]["step"] == 7
    for got, want in [(back["model"]["fc.weight"], state["model"]["fc.weight"]),
                      (back["model"]["fc.bias"], state["model"]["fc.bias"]),
                      (back["optimizer"]["state"]["0"]["m"], state["optimizer"]["state"]["0"]["m"]),
                      (back["half"], state["half"]), (back["ids"], state["ids"]),
                      (back["mask"], state["mask"]), (back["empty"], state["empty"])]:
        assert isinstance(got, nd.NDArray) and got.device == device
        want = np.asarray(want.numpy() if hasattr(want, "numpy") else want)
        assert got.dtype == nd.dtypes.canonical(want.dtype)
        np.testing.assert_array_equal(got.numpy(), want)


def test_readable_by_safetensors_and_back(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    ndl.save(sample_state(nd.cpu_numpy()), tmp_path / "ck.safetensors")
    theirs = st.load_file(str(tmp_path / "ck.safetensors"))
    assert set(theirs) == {"model.fc.weight", "model.fc.bias", "optimizer.state.0.m", "half",
                           "ids", "mask", "empty"}
    st.save_file({"a": np.ones((2, 2), np.float32), "b.c": np.arange(3, dtype=np.int32)},
                 str(tmp_path / "theirs.safetensors"), metadata={"epoch": "1"})
    flat = ndl.load(tmp_path / "theirs.safetensors", device=nd.cpu_numpy())
    assert set(flat) == {"a", "b.c"}
    np.testing.assert_array_equal(flat["b.c"].numpy(), [0, 1, 2])


def test_atomic_replace_leaves_no_temp_files(tmp_path):
    path = tmp_path / "sub" / "ck.safetensors"
    ndl.save({"a": np.ones(3)}, path)
    ndl.save({"a": np.zeros(3)}, path)
    assert os.listdir(path.parent) == ["ck.safetensors"]
    np.testing.assert_array_equal(ndl.load(path, nd.cpu_numpy())["a"].numpy(), np.zeros(3))


def test_failed_save_keeps_old_file(tmp_path):
    path = tmp_path / "ck.safetensors"
    ndl.save({"a": np.ones(3)}, path)
    with pytest.raises(ModelFormatError, match="object"):
        ndl.save({"a": np.ones(3), "b": object()}, path)
    with pytest.raises(ModelFormatError, match="collide|flatten"):
        ndl.save({"a.b": np.ones(1), "a": {"b": np.ones(1)}}, path)
    with pytest.raises(ModelFormatError, match="not a string"):
        ndl.save({1: np.ones(1)}, path)
    assert os.listdir(tmp_path) == ["ck.safetensors"]
    np.testing.assert_array_equal(ndl.load(path, nd.cpu_numpy())["a"].numpy(), np.ones(3))


def write_raw(path, header: dict, data: bytes, header_len: int | None = None):
    blob = json.dumps(header).encode()
    n = len(blob) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + blob + data)


@pytest.mark.parametrize("cut", [0, 5, 8, 20, -1])
def test_truncated_file(tmp_path, cut):
    path = tmp_path / "ck.safetensors"
    ndl.save({"w": np.ones((4, 4), np.float32), "epoch": 1}, path)
    raw = path.read_bytes()
    path.write_bytes(raw[:cut] if cut >= 0 else raw[:-3])
    with pytest.raises(ModelFormatError, match="ck.safetensors"):
        ndl.load(path)


def test_corrupt_files(tmp_path):
    path = tmp_path / "bad.safetensors"
    cases = [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, 10**12,
         "header length"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None,
         "needs 12 bytes"),
        ({"w": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, b"\0" * 8, None,
         "dtype U8"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None,
         "starts at byte 4"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, None,
         "holds 12"),
        ({"w": {"dtype": "F32"}}, b"", None, "malformed"),
        ({"__metadata__": {"needle.tree": '{"x": "tensor"}'}}, b"", None, "no such entry"),
        ({"__metadata__": {"needle.tree": "{oops"}}, b"", None, "not valid JSON"),
    ]
    for header, data, header_len, message in cases:
        write_raw(path, header, data, header_len)
        with pytest.raises(ModelFormatError, match=message) as info:
            ndl.load(path)
        assert "bad.safetensors" in str(info.value)
    path.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{}" + b"")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        ndl.load(path)
    with pytest.raises(ModelFormatError, match="does not exist"):
        ndl.load(tmp_path / "missing.safetensors")
