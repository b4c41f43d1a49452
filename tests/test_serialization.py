"""Checkpoints: round trips of nested state, interoperability with the safetensors package,
atomic writes, and errors that name the broken file."""

import json
import os
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest

import needle as ndl
import needle.backend_ndarray as nd
from needle.errors import ArgumentError, ModelFormatError


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
    import safetensors.numpy as st
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
    path.parent.mkdir()
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
        ({"w": {"dtype": "I16", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8, None,
         "dtype I16"),
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


def test_save_does_not_create_directories(tmp_path):
    with pytest.raises(ArgumentError, match="does not exist; create it first"):
        ndl.save({"a": np.ones(3)}, tmp_path / "missing" / "ck.safetensors")
    assert not (tmp_path / "missing").exists()
    with pytest.raises(ArgumentError, match="is a directory"):
        ndl.save({"a": np.ones(3)}, tmp_path)


def test_save_removes_temp_files_of_dead_writers(tmp_path):
    path = tmp_path / "ck.safetensors"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = tmp_path / f".ck.safetensors.{int(dead.stdout)}.abc123.tmp"
    stale.write_bytes(b"x" * 1000)
    live = tmp_path / f".ck.safetensors.{os.getppid()}.def456.tmp"  # a live writer's temp
    live.write_bytes(b"y")
    other = tmp_path / f".other.safetensors.{int(dead.stdout)}.abc.tmp"
    other.write_bytes(b"z")
    ndl.save({"a": np.ones(3)}, path)
    assert sorted(os.listdir(tmp_path)) == sorted([path.name, live.name, other.name])


def test_save_killed_midway_leaves_temp_that_next_save_removes(tmp_path):
    path = tmp_path / "ck.safetensors"
    code = ("import needle as ndl, numpy as np, os, signal\n"
            "import needle.serialization as s\n"
            "real = s._host\n"
            "def host(x):\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "s._host = host\n"
            f"ndl.save({{'a': np.ones(1000)}}, {str(path)!r})\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert result.returncode == -signal.SIGKILL
    assert any(name.endswith(".tmp") for name in os.listdir(tmp_path))
    ndl.save({"a": np.zeros(2)}, path)
    assert os.listdir(tmp_path) == [path.name]


def _rewrite_header(path, edit):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = edit(raw[8:8 + n])
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])


def test_flipped_byte_in_tree_key_is_an_error_not_a_silent_flat_dict(tmp_path):
    path = tmp_path / "ck.safetensors"
    ndl.save({"model": {"w": np.ones(3, dtype="float32")}, "epoch": 3}, path)
    _rewrite_header(path, lambda h: h.replace(b"needle.tree", b"needle.trfe"))
    with pytest.raises(ModelFormatError, match="needle.tree metadata entry is missing"):
        ndl.load(path, nd.cpu_numpy())


def test_header_nested_100000_deep_is_a_format_error(tmp_path):
    path = tmp_path / "deep.safetensors"
    header = b"[" * 100_000 + b"]" * 100_000
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ModelFormatError, match="nests too deeply"):
        ndl.load(path, nd.cpu_numpy())
    ndl.save({"a": np.ones(1)}, tmp_path / "ok.safetensors")
    deep = b'"' + b'[' * 100_000 + b']' * 100_000 + b'"'
    _rewrite_header(tmp_path / "ok.safetensors",
                    lambda h: h.replace(b'"needle.format"', b'"x":' + deep + b',"needle.format"'))
    with pytest.raises(ModelFormatError, match="nests too deeply"):
        ndl.load(tmp_path / "ok.safetensors", nd.cpu_numpy())


def test_fractional_shape_in_header_is_an_error(tmp_path):
    path = tmp_path / "ck.safetensors"
    ndl.save({"a": np.ones(2, dtype="float32")}, path)
    _rewrite_header(path, lambda h: h.replace(b'"shape":[2]', b'"shape":[2.7]'))
    with pytest.raises(ModelFormatError, match="malformed header entry"):
        ndl.load(path, nd.cpu_numpy())


def test_uint8_and_int8_round_trip_with_safetensors(tmp_path, device):
    """U8/I8 tensors: written by the safetensors package, loaded by needle with their
    dtype, and written back readable by it."""
    import safetensors.numpy as st
    image = np.arange(24, dtype=np.uint8).reshape(2, 3, 4) * 10
    codes = np.array([-128, -1, 0, 1, 127], np.int8)
    st.save_file({"image": image, "codes": codes}, str(tmp_path / "theirs.safetensors"))
    got = ndl.load(tmp_path / "theirs.safetensors", device=device)
    assert (got["image"].dtype, got["codes"].dtype) == ("uint8", "int8")
    np.testing.assert_array_equal(got["image"].numpy(), image)
    np.testing.assert_array_equal(got["codes"].numpy(), codes)
    ndl.save(got, tmp_path / "ours.safetensors")
    back = st.load_file(str(tmp_path / "ours.safetensors"))
    assert back["image"].dtype == np.uint8 and back["codes"].dtype == np.int8
    np.testing.assert_array_equal(back["image"], image)
    np.testing.assert_array_equal(back["codes"], codes)
