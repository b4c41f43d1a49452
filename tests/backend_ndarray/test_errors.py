"""Bad input: every mistake a user can make raises the NeedleError subclass that names it,
with a message saying what was wrong, and none of them can crash the process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.errors import (
    AxisError,
    DeviceError,
    DTypeError,
    IndexOutOfRangeError,
    NeedleError,
    OutOfMemoryError,
    ShapeError,
)

from ..conftest import enabled_devices, supports

ROOT = Path(__file__).resolve().parents[2]


def arr(d, shape, dtype="float32"):
    return nd.array(np.ones(shape), device=d, dtype=dtype)


def _setitem(a, index, value):
    a[index] = value


def _attention(d, q, kv, v=None, **kw):
    return nd.attention(arr(d, q), arr(d, kv), arr(d, v or kv), **kw)


# (id, error class, regex the message must match, what to do on a device)
CASES: list[tuple[str, type[NeedleError], str, Callable]] = [
    # shapes
    ("add_shape_mismatch", ShapeError, "cannot be broadcast",
     lambda d: arr(d, (2, 3)) + arr(d, (4,))),
    ("compare_shape_mismatch", ShapeError, "cannot be broadcast",
     lambda d: arr(d, (2, 3)) < arr(d, (3, 2))),
    ("where_shape_mismatch", ShapeError, "cannot be broadcast",
     lambda d: nd.where(arr(d, (2,), "bool"), arr(d, (3,)), arr(d, (3,)))),
    ("broadcast_to_impossible", ShapeError, "cannot broadcast",
     lambda d: arr(d, (3,)).broadcast_to((4,))),
    ("broadcast_to_fewer_dims", ShapeError, "cannot broadcast",
     lambda d: arr(d, (2, 3)).broadcast_to((3,))),
    ("reshape_other_size", ShapeError, "cannot reshape", lambda d: arr(d, (2, 3)).reshape((4, 2))),
    ("reshape_two_unknown", ShapeError, "only one dimension",
     lambda d: arr(d, (2, 3)).reshape((-1, -1))),
    ("reshape_unknown_impossible", ShapeError, "cannot reshape",
     lambda d: arr(d, (2, 3)).reshape((-1, 4))),
    ("reshape_negative", ShapeError, "negative", lambda d: arr(d, (2, 3)).reshape((-2, -3))),
    ("empty_negative", ShapeError, "negative", lambda d: nd.empty((2, -1), device=d)),
    ("full_negative", ShapeError, "negative", lambda d: nd.full((-3,), 1.0, device=d)),
    ("device_empty_negative", ShapeError, "negative", lambda d: d.empty((-1,))),
    ("shape_not_ints", ShapeError, "tuple of ints", lambda d: nd.zeros((2.5,), device=d)),
    ("ragged_data", ShapeError, "ragged", lambda d: nd.array([[1, 2], [3]], device=d)),
    ("matmul_inner", ShapeError, "inner dimensions", lambda d: arr(d, (2, 3)) @ arr(d, (4, 5))),
    ("matmul_vector_inner", ShapeError, "inner dimensions", lambda d: arr(d, (3,)) @ arr(d, (4,))),
    ("matmul_batch", ShapeError, "cannot be broadcast",
     lambda d: arr(d, (2, 3, 4)) @ arr(d, (3, 4, 5))),
    ("matmul_0d", ShapeError, "at least one dimension", lambda d: arr(d, ()) @ arr(d, (3,))),
    ("setitem_shape", ShapeError, "cannot broadcast",
     lambda d: _setitem(arr(d, (4, 3)), slice(0, 2), arr(d, (3, 2)))),
    ("setitem_list_shape", ShapeError, "cannot broadcast",
     lambda d: _setitem(arr(d, (2, 3)), 0, [1.0, 2.0])),
    ("item_of_many", ShapeError, "one element", lambda d: arr(d, (2,)).item()),
    ("len_of_0d", ShapeError, "0-d", lambda d: len(arr(d, ()))),
    ("max_of_empty", ShapeError, "no identity", lambda d: arr(d, (0, 3)).max(axis=0)),
    ("argmax_of_empty", ShapeError, "no identity", lambda d: arr(d, (0,)).argmax()),
    ("pad_pairs", ShapeError, "pair", lambda d: arr(d, (2, 3)).pad(((1, 1),))),
    ("pad_negative", ShapeError, "non-negative", lambda d: arr(d, (2, 3)).pad(((0, -1), (0, 0)))),
    ("stack_shapes", ShapeError, "one shape", lambda d: nd.stack([arr(d, (2,)), arr(d, (3,))])),
    ("stack_nothing", ShapeError, "at least one", lambda d: nd.stack([])),
    ("concatenate_shapes", ShapeError, "differ",
     lambda d: nd.concatenate([arr(d, (2, 3)), arr(d, (2, 4))], axis=0)),
    ("concatenate_nothing", ShapeError, "at least one", lambda d: nd.concatenate([])),
    ("take_from_1d", ShapeError, "2-d table", lambda d: arr(d, (5,)).take([0])),
    ("scatter_add_values", ShapeError, "indices need values",
     lambda d: nd.scatter_add([0, 1], arr(d, (3, 4)), 5)),
    ("softmax_0d", ShapeError, "at least one dimension", lambda d: arr(d, ()).softmax()),
    ("rmsnorm_weight", ShapeError, "weight must have shape",
     lambda d: arr(d, (2, 4)).rmsnorm(arr(d, (3,)))),
    ("layernorm_bias", ShapeError, "bias must have shape",
     lambda d: arr(d, (2, 4)).layernorm(arr(d, (4,)), arr(d, (5,)))),
    ("rope_odd_head_dim", ShapeError, "even head_dim",
     lambda d: arr(d, (1, 2, 1, 3)).rope(arr(d, (2, 1)), arr(d, (2, 1)))),
    ("rope_3d", ShapeError, "batch, seq, heads, head_dim",
     lambda d: arr(d, (2, 1, 4)).rope(arr(d, (1, 2)), arr(d, (1, 2)))),
    ("rope_table_shape", ShapeError, "cos must have shape",
     lambda d: arr(d, (1, 2, 1, 4)).rope(arr(d, (3, 2)), arr(d, (3, 2)))),
    ("silu_mul_shapes", ShapeError, "equal shapes",
     lambda d: arr(d, (2, 3)).silu_mul(arr(d, (3, 2)))),
    ("attention_heads", ShapeError, "multiple",
     lambda d: _attention(d, (1, 3, 2, 4), (1, 2, 2, 4))),
    ("attention_kv_len", ShapeError, "kv_len",
     lambda d: _attention(d, (1, 2, 2, 4), (1, 2, 4, 4), kv_len=5)),
    ("attention_kv_len_zero", ShapeError, "kv_len",
     lambda d: _attention(d, (1, 2, 2, 4), (1, 2, 4, 4), kv_len=0)),
    ("attention_causal_short", ShapeError, "at least q_len",
     lambda d: _attention(d, (1, 2, 3, 4), (1, 2, 4, 4), kv_len=2, causal=True)),
    ("attention_3d", ShapeError, "4-d", lambda d: _attention(d, (2, 2, 4), (1, 2, 2, 4))),
    ("attention_k_v_differ", ShapeError, "one shape",
     lambda d: _attention(d, (1, 2, 2, 4), (1, 2, 4, 4), (1, 2, 5, 4))),
    ("attention_head_dim", ShapeError, "head_dim",
     lambda d: _attention(d, (1, 2, 2, 4), (1, 2, 2, 8))),
    ("as_strided_strides", ShapeError, "strides", lambda d: arr(d, (4,)).as_strided((2, 2), (1,))),
    # axes
    ("sum_axis_too_big", AxisError, "out of range", lambda d: arr(d, (2, 3)).sum(axis=2)),
    ("sum_axis_too_negative", AxisError, "out of range", lambda d: arr(d, (2, 3)).sum(axis=-3)),
    ("sum_axis_repeated", AxisError, "repeated", lambda d: arr(d, (2, 3)).sum(axis=(0, 0))),
    ("sum_axis_repeated_negative", AxisError, "repeated",
     lambda d: arr(d, (2, 3)).sum(axis=(1, -1))),
    ("sum_axis_float", AxisError, "axis must be", lambda d: arr(d, (2, 3)).sum(axis=1.5)),
    ("max_axis_str", AxisError, "axis must be", lambda d: arr(d, (2, 3)).max(axis="0")),
    ("mean_axis", AxisError, "out of range", lambda d: arr(d, (2, 3)).mean(axis=5)),
    ("argmax_tuple", AxisError, "single axis", lambda d: arr(d, (2, 3)).argmax(axis=(0, 1))),
    ("argmax_axis", AxisError, "out of range", lambda d: arr(d, (2, 3)).argmax(axis=2)),
    ("permute_count", AxisError, "all 2 axes", lambda d: arr(d, (2, 3)).permute((0,))),
    ("permute_repeated", AxisError, "repeated", lambda d: arr(d, (2, 3)).permute((0, 0))),
    ("permute_range", AxisError, "out of range", lambda d: arr(d, (2, 3)).permute((0, 2))),
    ("transpose_int", AxisError, "out of range", lambda d: arr(d, (2, 3)).transpose(5)),
    ("swapaxes", AxisError, "out of range", lambda d: arr(d, (2, 3)).swapaxes(0, 2)),
    ("flip_axis", AxisError, "out of range", lambda d: arr(d, (2, 3)).flip(2)),
    ("stack_axis", AxisError, "out of range",
     lambda d: nd.stack([arr(d, (2, 3)), arr(d, (2, 3))], axis=3)),
    ("concatenate_axis", AxisError, "out of range",
     lambda d: nd.concatenate([arr(d, (2, 3)), arr(d, (2, 3))], axis=2)),
    # indices
    ("getitem_past_end", IndexOutOfRangeError, "out of range", lambda d: arr(d, (5, 6))[5]),
    ("getitem_before_start", IndexOutOfRangeError, "out of range", lambda d: arr(d, (5, 6))[-6]),
    ("getitem_second_axis", IndexOutOfRangeError, "axis 1", lambda d: arr(d, (5, 6))[0, 6]),
    ("too_many_indices", IndexOutOfRangeError, "too many indices",
     lambda d: arr(d, (5, 6))[0, 0, 0]),
    ("too_many_indices_with_none", IndexOutOfRangeError, "too many indices",
     lambda d: arr(d, (5, 6))[None, 0, ..., 0, 0]),
    ("index_0d", IndexOutOfRangeError, "too many indices", lambda d: arr(d, ())[0]),
    ("two_ellipses", IndexOutOfRangeError, "single ellipsis",
     lambda d: arr(d, (5, 6))[..., 0, ...]),
    ("index_list", IndexOutOfRangeError, "take", lambda d: arr(d, (5, 6))[[0, 1]]),
    ("index_float", IndexOutOfRangeError, "unsupported index", lambda d: arr(d, (5, 6))[1.5]),
    ("index_bool", IndexOutOfRangeError, "unsupported index", lambda d: arr(d, (5, 6))[True]),
    ("index_array", IndexOutOfRangeError, "unsupported index",
     lambda d: arr(d, (5, 6))[arr(d, (2,), "int64")]),
    ("slice_step_zero", IndexOutOfRangeError, "bad slice", lambda d: arr(d, (5, 6))[::0]),
    ("slice_float_bound", IndexOutOfRangeError, "bad slice", lambda d: arr(d, (5, 6))[0.5:]),
    ("setitem_past_end", IndexOutOfRangeError, "out of range",
     lambda d: _setitem(arr(d, (5, 6)), 7, 1.0)),
    ("take_past_end", IndexOutOfRangeError, "out of range",
     lambda d: arr(d, (5, 3)).take([0, 5])),
    ("take_negative", IndexOutOfRangeError, "out of range", lambda d: arr(d, (5, 3)).take([-1])),
    ("take_huge", IndexOutOfRangeError, "out of range",
     lambda d: arr(d, (5, 3)).take(np.array([2**40], np.int64))),
    ("scatter_add_past_end", IndexOutOfRangeError, "out of range",
     lambda d: nd.scatter_add([0, 5], arr(d, (2, 3)), 5)),
    ("scatter_add_negative", IndexOutOfRangeError, "out of range",
     lambda d: nd.scatter_add([-1], arr(d, (1, 3)), 5)),
    ("as_strided_past_end", IndexOutOfRangeError, "buffer",
     lambda d: arr(d, (4,)).as_strided((3,), (2,))),
    ("as_strided_before_start", IndexOutOfRangeError, "buffer",
     lambda d: arr(d, (4,)).as_strided((2,), (-1,))),
    ("as_strided_wild", IndexOutOfRangeError, "buffer",
     lambda d: arr(d, (4,)).as_strided((10**6,), (10**6,))),
    # dtypes
    ("matmul_bool", DTypeError, "bool", lambda d: arr(d, (2, 2), "bool") @ arr(d, (2, 2), "bool")),
    ("matmul_bool_float", DTypeError, "bool", lambda d: arr(d, (2, 2), "bool") @ arr(d, (2, 2))),
    ("softmax_int", DTypeError, "floating", lambda d: arr(d, (3,), "int32").softmax()),
    ("log_softmax_bool", DTypeError, "floating", lambda d: arr(d, (3,), "bool").log_softmax()),
    ("rmsnorm_int", DTypeError, "floating",
     lambda d: arr(d, (2, 3), "int64").rmsnorm(arr(d, (3,)))),
    ("layernorm_int", DTypeError, "floating",
     lambda d: arr(d, (2, 3), "int32").layernorm(arr(d, (3,)), arr(d, (3,)))),
    ("rope_int", DTypeError, "floating",
     lambda d: arr(d, (1, 2, 1, 4), "int32").rope(arr(d, (2, 2)), arr(d, (2, 2)))),
    ("silu_mul_int", DTypeError, "floating",
     lambda d: arr(d, (3,), "int32").silu_mul(arr(d, (3,), "int32"))),
    ("attention_int", DTypeError, "floating",
     lambda d: nd.attention(arr(d, (1, 1, 2, 4), "int32"), arr(d, (1, 1, 2, 4), "int32"),
                            arr(d, (1, 1, 2, 4), "int32"))),
    ("floor_division", DTypeError, "floor division", lambda d: arr(d, (2,)) // arr(d, (2,))),
    ("dtype_name_array", DTypeError, "unknown dtype",
     lambda d: nd.array([1.0], device=d, dtype="float8")),
    ("dtype_name_astype", DTypeError, "unknown dtype", lambda d: arr(d, (2,)).astype("complex64")),
    ("dtype_name_zeros", DTypeError, "unknown dtype", lambda d: nd.zeros((2,), "int16", d)),
    ("dtype_name_device_empty", DTypeError, "unknown dtype", lambda d: d.empty((2,), "f32")),
    ("numpy_dtype_complex", DTypeError, "complex",
     lambda d: nd.array(np.ones(2, np.complex64), device=d)),
    ("object_data", DTypeError, "object", lambda d: nd.array([object()], device=d)),
    ("string_data", DTypeError, "not supported", lambda d: nd.array(["a"], device=d)),
    ("take_float_indices", DTypeError, "int32 or int64",
     lambda d: arr(d, (5, 3)).take(np.array([0.0]))),
    ("scatter_add_bool_indices", DTypeError, "int32 or int64",
     lambda d: nd.scatter_add(np.array([True]), arr(d, (1, 3)), 2)),
    ("fill_str", DTypeError, "must be a number", lambda d: nd.full((2,), "x", device=d)),
    ("fill_none", DTypeError, "must be a number", lambda d: arr(d, (2,)).fill(None)),
    ("setitem_str", DTypeError, "not supported", lambda d: _setitem(arr(d, (2,)), 0, "x")),
    ("scalar_str", DTypeError, "str", lambda d: nd.where(arr(d, (2,), "bool"), "a", "b")),
    # memory
    ("alloc_petabyte", OutOfMemoryError, "bytes", lambda d: nd.empty((2**48,), device=d)),
    ("alloc_overflowing_size", OutOfMemoryError, "bytes",
     lambda d: nd.empty((2**40, 2**40), device=d)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises(device, case):
    _, error, pattern, fn = case
    with pytest.raises(error, match=pattern):
        fn(device)


def test_cases_are_unique():
    names = [c[0] for c in CASES]
    assert len(names) == len(set(names))


def test_float64_where_the_hardware_has_none(device):
    """Devices without float64 (Metal) refuse it with DTypeError; the others hold it."""
    if supports(device, "float64"):
        assert nd.array([1.0], device=device, dtype="float64").dtype == "float64"
        return
    with pytest.raises(DTypeError, match="float64"):
        nd.array([1.0], device=device, dtype="float64")
    with pytest.raises(DTypeError, match="float64"):
        nd.zeros((2,), "float64", device)
    with pytest.raises(DTypeError, match="float64"):
        arr(device, (2,)).astype("float64")


def test_out_of_range_indices_held_on_the_device(device):
    """Indices already in device memory: CPU devices check them (reading is free there); GPU
    kernels cannot raise, so take gives a row of zeros and scatter_add skips the index
    (docs/kernels.md) instead of reading or writing outside the table."""
    table = nd.array(np.arange(15.0).reshape(5, 3), device=device)
    idx = nd.array(np.array([1, 5, -1, 4]), device=device, dtype="int64")
    values = nd.array(np.ones((4, 3)), device=device)
    if device.kind.startswith("cpu"):
        with pytest.raises(IndexOutOfRangeError, match="take: index -1"):
            table.take(idx)
        with pytest.raises(IndexOutOfRangeError, match="scatter_add: index -1"):
            nd.scatter_add(idx, values, 5)
        return
    want = np.arange(15.0).reshape(5, 3)[[1, 0, 0, 4]]
    want[1:3] = 0
    np.testing.assert_array_equal(table.take(idx).numpy(), want)
    added = np.zeros((5, 3))
    added[[1, 4]] = 1
    np.testing.assert_array_equal(nd.scatter_add(idx, values, 5).numpy(), added)


def _device_pairs():
    devs = enabled_devices()
    return [(a, b) for a in devs for b in devs if a != b]


CROSS_DEVICE: list[tuple[str, Callable]] = [
    ("add", lambda a, b: arr(a, (3,)) + arr(b, (3,))),
    ("compare", lambda a, b: arr(a, (3,)) == arr(b, (3,))),
    ("matmul", lambda a, b: arr(a, (2, 2)) @ arr(b, (2, 2))),
    ("where", lambda a, b: nd.where(arr(a, (2,), "bool"), arr(b, (2,)), arr(a, (2,)))),
    ("setitem", lambda a, b: _setitem(arr(a, (2, 2)), 0, arr(b, (2,)))),
    ("stack", lambda a, b: nd.stack([arr(a, (2,)), arr(b, (2,))])),
    ("concatenate", lambda a, b: nd.concatenate([arr(a, (2,)), arr(b, (2,))])),
    ("take", lambda a, b: arr(a, (4, 2)).take(arr(b, (3,), "int64"))),
    ("scatter_add", lambda a, b: nd.scatter_add(arr(a, (2,), "int64"), arr(b, (2, 3)), 3)),
    ("rmsnorm", lambda a, b: arr(a, (2, 4)).rmsnorm(arr(b, (4,)))),
    ("layernorm", lambda a, b: arr(a, (2, 4)).layernorm(arr(a, (4,)), arr(b, (4,)))),
    ("rope", lambda a, b: arr(a, (1, 2, 1, 4)).rope(arr(b, (2, 2)), arr(a, (2, 2)))),
    ("silu_mul", lambda a, b: arr(a, (3,)).silu_mul(arr(b, (3,)))),
    ("attention", lambda a, b: nd.attention(arr(a, (1, 1, 2, 4)), arr(b, (1, 1, 2, 4)),
                                            arr(a, (1, 1, 2, 4)))),
]


@pytest.mark.parametrize("case", CROSS_DEVICE, ids=[c[0] for c in CROSS_DEVICE])
def test_ops_across_two_devices(case):
    pairs = _device_pairs()
    if not pairs:
        pytest.skip("needs two enabled devices (only cpu_numpy is enabled)")
    _, fn = case
    for a, b in pairs:
        with pytest.raises(DeviceError, match="different devices|indices are on"):
            fn(a, b)
    a, b = pairs[0]
    moved = arr(b, (3,)).to(a)  # the way out that the message suggests works
    np.testing.assert_array_equal((arr(a, (3,)) + moved).numpy(), np.full(3, 2.0))


def test_disabled_device_says_why():
    disabled = [d for d in nd.all_devices() if not d.enabled()]
    if not disabled:
        pytest.skip("every device is enabled here")
    for d in disabled:
        with pytest.raises(DeviceError, match="not available") as e:
            nd.array([1.0], device=d)
        assert d.reason and d.reason in str(e.value)


def run_all(device_name: str) -> None:
    """Run every bad input on one device and report, in a process of its own (see below)."""
    device = nd.device_from_name(device_name)
    wrong = []
    for name, error, _, fn in CASES:
        try:
            fn(device)
            wrong.append(f"{name}: no error")
        except error:
            pass
        except Exception as e:  # report, keep going: the point is that the process survives
            wrong.append(f"{name}: {type(e).__name__}: {e}")
    for line in wrong:
        print("WRONG", line)
    print(f"survived {len(CASES)} bad inputs, {len(wrong)} with the wrong outcome")


def test_bad_inputs_do_not_crash_the_process(device):
    """A batch of bad inputs in a fresh interpreter: it must exit normally (a native
    backend that reads out of bounds or aborts would kill it with a signal)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    code = f"from tests.backend_ndarray.test_errors import run_all; run_all({device.name!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (f"exit code {proc.returncode}\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
    assert f"survived {len(CASES)} bad inputs, 0 with the wrong outcome" in proc.stdout, (
        proc.stdout[-3000:])
