"""Views and array helpers: reshape, permute, broadcast_to, getitem, flip, pad, stack,
concatenate, item, ``__array__``, ``to(device)`` and ``astype``.

Views must share the buffer (a write through the view shows in the base) and read the same
elements numpy's views read.
"""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd

from ..conftest import assert_equal, check_unsupported_dtype, enabled_devices, supports
from .compare import np_dtype, on, random


def _arange(device, shape, dtype="float32"):
    x = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape).astype(np_dtype(dtype))
    return on(device, x), x


def _shares_memory(view: nd.NDArray, base: nd.NDArray) -> bool:
    return view.handle is base.handle


@pytest.mark.parametrize("shape,new", [
    ((2, 3, 4), (6, 4)), ((2, 3, 4), (24,)), ((2, 3, 4), (4, -1)), ((24,), (2, 3, 2, 2)),
    ((1, 5), (5, 1)), ((0, 3), (-1, 3)), ((0, 3), (3, 0)), ((), (1, 1)), ((1,), ()),
])
def test_reshape_compact_is_a_view(device, shape, new):
    a, x = _arange(device, shape)
    r = a.reshape(new)
    want = x.reshape(new)
    assert r.shape == want.shape
    assert_equal(r, want)
    assert _shares_memory(r, a)


def test_reshape_accepts_an_int(device):
    a, x = _arange(device, (2, 3))
    assert_equal(a.reshape(6), x.reshape(6))


NON_COMPACT = {
    "transposed": lambda t: t.transpose((1, 0)),
    "strided": lambda t: t[:, ::2],
    "flipped": lambda t: t[::-1],
    "sliced": lambda t: t[1:3, 1:],
    "broadcast": lambda t: (np.broadcast_to(t, (4, 4, 6)) if isinstance(t, np.ndarray)
                            else t.broadcast_to((4, 4, 6)))[:, 1:3],
}


@pytest.mark.parametrize("kind", list(NON_COMPACT))
def test_reshape_of_non_compact_views(device, kind):
    a, x = _arange(device, (4, 6))
    v, xv = NON_COMPACT[kind](a), NON_COMPACT[kind](x)
    for new in ((-1,), (xv.size // xv.shape[-1], xv.shape[-1]), (1, -1), xv.shape[::-1]):
        assert_equal(v.reshape(new), xv.reshape(new))


def test_reshape_keeps_views_where_strides_allow(device):
    a, x = _arange(device, (4, 6))
    v = a[:, 1:3]  # rows of 2 contiguous elements: (4, 2) -> (4, 2, 1) is a view
    assert _shares_memory(v.reshape((4, 2, 1)), a)
    t = a.transpose((1, 0))  # (6, 4) -> (24,) needs a copy
    flat = t.reshape((24,))
    assert flat.is_compact()
    assert_equal(flat, x.T.reshape(24))


@pytest.mark.parametrize("axes", [(0, 1, 2), (2, 1, 0), (1, 2, 0), (0, 2, 1), (-1, 0, 1)])
def test_permute(device, axes):
    a, x = _arange(device, (2, 3, 4))
    p = a.permute(axes)
    assert_equal(p, x.transpose(axes))
    assert _shares_memory(p, a)
    assert_equal(a.transpose(axes), x.transpose(axes))


def test_transpose_default_swapaxes_and_t(device):
    a, x = _arange(device, (2, 3, 4))
    assert_equal(a.transpose(), x.transpose())
    assert_equal(a.T, x.T)
    assert_equal(a.swapaxes(0, 2), x.swapaxes(0, 2))
    assert_equal(a.swapaxes(-1, 1), x.swapaxes(-1, 1))
    assert_equal(a.swapaxes(1, 1), x)


@pytest.mark.parametrize("shape,new", [
    ((3, 1), (3, 5)), ((1,), (4,)), ((), (2, 3)), ((2, 1, 3), (4, 2, 5, 3)), ((3,), (0, 3)),
])
def test_broadcast_to(device, shape, new):
    a, x = _arange(device, shape)
    b = a.broadcast_to(new)
    assert_equal(b, np.broadcast_to(x, new))
    assert _shares_memory(b, a)
    assert_equal(nd.broadcast_to(a, new).compact(), np.broadcast_to(x, new))


GETITEMS = [
    0, -1, (1, 2), (slice(None), 1), (Ellipsis, 1), (1, Ellipsis), (None, 1), (Ellipsis, None),
    (slice(1, None), slice(None, None, -1)), (slice(None, None, -2), slice(3, 0, -2)),
    (slice(-2, None),), (slice(10, 20),), (slice(None, None, 3), None, slice(1, 2)),
    (slice(4, 1, -1), -2, None), (np.int64(2),), (slice(None),) * 2, (),
    (slice(0, 0), slice(None, None, -1)), (slice(5, -8, -3),),
]


@pytest.mark.parametrize("index", GETITEMS, ids=repr)
def test_getitem(device, index):
    a, x = _arange(device, (5, 6))
    v = a[index]
    want = x[index]
    assert v.shape == want.shape
    assert_equal(v, want)
    assert_equal(v.compact(), want)
    assert _shares_memory(v, a)


def test_getitem_of_getitem_and_3d(device):
    a, x = _arange(device, (4, 5, 6))
    assert_equal(a[1:, ::-1][::2, 1, 2:5], x[1:, ::-1][::2, 1, 2:5])
    assert_equal(a[..., ::-2][-1], x[..., ::-2][-1])
    index = (slice(1, 4), None, Ellipsis, 0)
    assert_equal(a.transpose((2, 0, 1))[index], x.transpose((2, 0, 1))[index])


@pytest.mark.parametrize("axes", [None, 0, 1, -1, (0, 2), (2, 1, 0), ()])
def test_flip(device, axes):
    a, x = _arange(device, (3, 4, 2))
    want = np.flip(x, axis=axes) if axes != () else x
    assert_equal(a.flip(axes), want)
    assert_equal(nd.flip(a, axes).compact(), want)
    assert _shares_memory(a.flip(axes), a)


def test_flip_of_view_and_empty(device):
    a, x = _arange(device, (4, 6))
    assert_equal(a[1:, ::2].flip((0, 1)), np.flip(x[1:, ::2]))
    e, xe = _arange(device, (0, 3))
    assert_equal(e.flip(0), np.flip(xe, 0))


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool", "float16"])
def test_pad(device, dtype):
    if check_unsupported_dtype(device, dtype):
        return
    a, x = _arange(device, (2, 3), dtype)
    for pads in (((0, 0), (0, 0)), ((1, 2), (0, 3)), ((0, 1), (2, 0))):
        p = a.pad(pads)
        assert p.dtype == dtype
        assert_equal(p, np.pad(x, pads))
    assert_equal(a[:, ::-1].pad(((1, 1), (1, 1))), np.pad(x[:, ::-1], 1))


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_stack(device, axis, rng):
    xs = [random(rng, (2, 3), "float32") for _ in range(3)]
    arrays = [on(device, x) for x in xs]
    arrays[1] = arrays[1] if axis % 2 else on(device, xs[1].T.copy()).transpose((1, 0))
    got = nd.stack(arrays, axis=axis)
    assert_equal(got, np.stack(xs, axis=axis))


def test_stack_promotes_and_takes_one(device):
    a = on(device, np.array([1, 2], np.int32))
    b = on(device, np.array([0.5, 1.5], np.float32))
    got = nd.stack([a, b])
    assert got.dtype == "float32"
    assert_equal(got, np.array([[1, 2], [0.5, 1.5]], np.float32))
    assert_equal(nd.stack([a]), np.array([[1, 2]], np.int32))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concatenate(device, axis, rng):
    shapes = [(2, 3), (2, 1), (2, 0), (2, 4)] if axis != 0 else [(2, 3), (1, 3), (0, 3), (4, 3)]
    xs = [random(rng, s, "float32") for s in shapes]
    got = nd.concatenate([on(device, x)[::-1] for x in xs], axis=axis)
    assert_equal(got, np.concatenate([x[::-1] for x in xs], axis=axis))


def test_concatenate_promotes_dtypes(device):
    a = on(device, np.array([True, False]))
    b = on(device, np.array([7, 8], np.int64))
    got = nd.concatenate([a, b])
    assert got.dtype == "int64"
    assert_equal(got, np.array([1, 0, 7, 8]))


# --- conversion ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", nd.ALL_DTYPES)
def test_item_and_python_scalars(device, dtype):
    if check_unsupported_dtype(device, dtype):
        return
    value = {"bool": True, "int32": -7, "int64": 2**40, "uint8": 200, "int8": -7}.get(dtype, 2.5)
    a = nd.full((1, 1), value, dtype, device)
    assert a.item() == value
    assert type(a.item()) is type(value)
    assert a[0, 0].item() == value
    assert bool(a) is bool(value)
    assert float(a) == float(value) and int(a) == int(value)


def test_array_protocol(device, rng):
    x = random(rng, (3, 4), "float32")
    a = on(device, x)
    assert_equal(np.asarray(a), x)
    assert np.asarray(a, dtype=np.float64).dtype == np.float64
    assert_equal(np.asarray(a[:, ::-1]), x[:, ::-1])
    assert_equal(np.array(a.transpose((1, 0))) + 1, x.T + 1)


def test_repr_str_len(device):
    a, x = _arange(device, (3, 2), "int32")
    assert len(a) == 3
    assert str(a) == str(x)
    assert device.name in repr(a) or repr(device) in repr(a)
    assert "int32" in repr(a)


@pytest.mark.parametrize("dtype", nd.ALL_DTYPES)
def test_to_every_enabled_device(device, dtype, rng):
    if check_unsupported_dtype(device, dtype):
        return
    x = random(rng, (3, 5), dtype, -9, 9)
    a = on(device, x)[:, 1:]
    for other in enabled_devices():
        if check_unsupported_dtype(other, dtype):
            continue
        b = a.to(other)
        assert b.device == other and b.dtype == dtype
        assert_equal(b, x[:, 1:])
        assert_equal(b.to(device), x[:, 1:])
    assert a.to(device) is a


def test_astype_same_dtype_and_chain(device, rng):
    x = random(rng, (4, 4), "float32")
    a = on(device, x)
    assert a.astype("float32") is a
    assert a.astype(np.float32) is a  # numpy dtypes and aliases name the same dtype
    assert a.astype("half").dtype == "float16"
    back = a[::-1].astype("int64").astype("float32")
    assert_equal(back, x[::-1].astype(np.int64).astype(np.float32))


def test_copy_is_independent(device, rng):
    x = random(rng, (3, 3), "float32")
    a = on(device, x)
    c = a.copy()
    c[0, 0] = 99.0
    assert_equal(a, x)
    assert c.handle is not a.handle


@pytest.mark.parametrize("source,dtype", [
    (np.arange(6, dtype=np.float64).reshape(2, 3), "float64"),  # numpy keeps its dtype (torch)
    (np.arange(6, dtype=np.int8), "int8"),
    (np.arange(6, dtype=np.uint8), "uint8"),
    (np.arange(6, dtype=np.int16), "int32"),
    (np.arange(6, dtype=np.uint16), "int32"),
    (np.arange(6, dtype=np.int64), "int64"),
    (np.arange(6, dtype=np.float16), "float16"),
    (np.array([True, False]), "bool"),
    ([[1.5, 2.0], [3.0, 4.0]], "float32"),
    ([1, 2, 3], "int64"),
    (3.5, "float32"),
    (np.arange(24, dtype=np.float32).reshape(4, 6)[::2, ::-3].T, "float32"),  # not contiguous
])
def test_array_from_numpy_and_python(device, source, dtype):
    if dtype == "float64" and not supports(device, dtype):
        dtype = "float32"  # a device without float64 (Metal) holds float64 data as float32
    a = nd.array(source, device=device)
    assert a.dtype == dtype and a.device == device
    assert_equal(a, np.asarray(source).astype(np_dtype(dtype)))


def test_array_from_ndarray_copies_and_converts(device):
    a, x = _arange(device, (2, 3))
    b = nd.NDArray(a[:, ::-1], dtype="int32")
    assert b.dtype == "int32"
    assert_equal(b, x[:, ::-1].astype(np.int32))
    c = nd.NDArray(a)
    c[0, 0] = -1.0
    assert_equal(a, x)  # NDArray(NDArray) copies


def test_array_from_torch(device):
    import torch
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    a = nd.array(t, device=device)
    assert a.dtype == "float32"
    assert_equal(a, t.numpy())
    g = torch.ones(3, requires_grad=True)  # tensors that need grad are read too
    assert_equal(nd.array(g, device=device), np.ones(3, np.float32))
