"""Small host-to-device copies on CUDA go through page-locked slots (queue.py's _UploadRing),
so that they are queued like kernels instead of waiting for the stream: what arrives, at the
slot size's edges and when the slots wrap around while the device is busy, and that an
upload returns before the work queued ahead of it has finished."""

from __future__ import annotations

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle.backends.cuda import queue as cuda_queue

DEV = nd.cuda(0)
pytestmark = pytest.mark.skipif(not DEV.enabled(), reason=f"cuda disabled: {DEV.reason}")
SLOT = cuda_queue._UPLOAD_SLOT
NOT_READY = 600  # CUDA_ERROR_NOT_READY


def _busy(n: int = 2048, repeats: int = 96):
    """Queue ~40 ms of matmuls (enough that a test process descheduled under a parallel
    run still finds them queued); returns what keeps their arrays alive."""
    a = nd.array(np.ones((n, n), np.float32), device=DEV)
    out = [a @ a for _ in range(repeats)]
    return a, out


@pytest.mark.parametrize("dtype,count", [("float32", 1), ("float32", SLOT // 4),
                                         ("float32", SLOT // 4 + 1), ("int64", 3),
                                         ("bool", 5), ("bfloat16", 7), ("int8", 1)])
def test_small_and_edge_uploads_arrive_whole(dtype, count):
    rng = np.random.default_rng(count)
    host = rng.standard_normal(count) * 100
    want = nd.array(host, device=nd.cpu_numpy(), dtype=dtype).numpy()
    got = nd.array(want, device=DEV, dtype=dtype).numpy()
    np.testing.assert_array_equal(got, want)


def test_uploads_wrapping_the_slots_while_the_device_is_busy_all_arrive():
    keep = _busy()
    arrays = [nd.array(np.full(100 + i, i, np.int32), device=DEV)
              for i in range(3 * cuda_queue._UPLOAD_SLOTS)]
    for i, a in enumerate(arrays):  # a slot reused before its copy left would show here
        np.testing.assert_array_equal(a.numpy(), np.full(100 + i, i, np.int32))
    del keep


def test_a_small_upload_does_not_wait_for_queued_work():
    keep = _busy()
    q = DEV.backend.queue
    label = nd.array(np.arange(10, dtype=np.int64), device=DEV)
    status = int(cuda_queue.cu.cuStreamQuery(q.stream)[0])
    assert status == NOT_READY, "the upload waited for the matmuls queued before it"
    np.testing.assert_array_equal(label.numpy(), np.arange(10))
    del keep
