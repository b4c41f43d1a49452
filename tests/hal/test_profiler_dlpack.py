"""The profiler's per-kernel sums, and DLPack capsules checked against numpy's own."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from needle.hal import Event, Profiler, dlpack


class FixedEvent(Event):
    def __init__(self, t_ms: float):
        self.t = t_ms

    def elapsed_ms(self, end):
        return end.t - self.t


def test_profiler_sums_time_per_kernel():
    prof = Profiler()
    prof.add("ewise_add_f32", FixedEvent(0.0), FixedEvent(1.5))
    prof.add("ewise_add_f32", FixedEvent(2.0), FixedEvent(2.5))
    prof.add("matmul_nn_f32", FixedEvent(3.0), FixedEvent(7.0))
    prof.finish()
    add = prof.totals["ewise_add_f32"]
    assert add.calls == 2 and add.total_ms == pytest.approx(2.0) and add.mean_us == 1000.0
    assert prof.total_ms == pytest.approx(6.0)
    table = prof.table()
    assert table.index("matmul_nn_f32") < table.index("ewise_add_f32")  # by total time


class Exported:
    """What a backend hands numpy: a capsule plus the device it lives on (here: host)."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64"])
def test_export_is_read_by_numpy_without_copy(dtype):
    host = np.arange(24).astype(dtype).reshape(4, 6)
    keep = object()
    cap = dlpack.export(host.ctypes.data + host.itemsize * 7, (2, 3), (6, 1), dtype, 1, 0, keep)
    seen = np.from_dlpack(Exported(cap))
    np.testing.assert_array_equal(seen, host[1:3, 1:4])
    host[1, 1] = 99
    assert seen[0, 0] == 99  # same memory


def test_unconsumed_capsule_releases_what_it_keeps():
    before = len(dlpack._live)
    cap = dlpack.export(0, (1,), (1,), "float32", 1, 0, object())
    assert len(dlpack._live) == before + 1
    del cap
    assert len(dlpack._live) == before


def test_capsules_are_released_whatever_others_do_to_ctypes_pythonapi():
    """dill (which datasets imports) sets ctypes.pythonapi's PyCapsule functions to take
    Python objects; needle's capsule destructor, which passes pointers, must not go through
    those shared function objects (it did: exported buffers were then kept forever)."""
    import ctypes

    fns = [getattr(ctypes.pythonapi, f"PyCapsule_{n}") for n in ("IsValid", "GetPointer")]
    saved = [(f.argtypes, f.restype) for f in fns]
    try:
        for f in fns:
            f.argtypes = [ctypes.py_object, ctypes.c_char_p]  # as dill's _dill.py does
        before = len(dlpack._live)
        cap = dlpack.export(0, (1,), (1,), "float32", 1, 0, object())
        del cap
        assert len(dlpack._live) == before
    finally:
        for f, (argtypes, restype) in zip(fns, saved):
            f.argtypes, f.restype = argtypes, restype


def test_consume_reads_numpy_capsules():
    x = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]
    t = dlpack.consume(x.__dlpack__())
    assert t.address == x.ctypes.data and t.shape == (3, 2) and t.dtype == "int64"
    assert t.strides in ((4, 2),) and (t.device_type, t.device_id) == (1, 0)
    assert ctypes.c_int64.from_address(t.address + 8 * 2).value == 2
    del t  # the owner calls numpy's deleter
