"""A CUDA device used from a thread other than the one that opened it: the driver calls
that act on the thread's current context (allocation, events, page-locked memory, loading a
module, instantiating a graph) bind the device's context first. Run in a fresh process so
that every one of them happens for the first time in the worker thread. The second test
loads a kernel file in the main thread and looks up its other kernels in the worker (their
occupancy queries act on the current context too)."""

from __future__ import annotations

import ast
import subprocess
import sys

import numpy as np
import pytest

import needle.backend_ndarray as nd

DEV = nd.cuda(0)
pytestmark = pytest.mark.skipif(not DEV.enabled(), reason=f"cuda disabled: {DEV.reason}")

_SCRIPT = r"""
import threading
import numpy as np
import needle as ndl
from needle import backend_ndarray as nd

dev = nd.cuda(0)
dev.enabled()  # the device (and its context) opened in the main thread
out = {}

def work():
    try:
        x = nd.array(np.arange(6, dtype=np.float32).reshape(2, 3), device=dev)  # upload ring
        y = (x @ x.permute((1, 0))).exp().sum()  # kernels loaded in this thread
        big = nd.array(np.ones((1 << 20,), np.float32), device=dev)  # a pool miss
        ev = dev.backend.queue.event()
        ev.record()
        ev.synchronize()
        step = ndl.compile(lambda a: (a * 2.0 + 1.0).sum())
        t = ndl.Tensor(np.ones((4, 4), np.float32), device=dev)
        got = [float(step(t).numpy()) for _ in range(3)]  # captured and replayed
        out["ok"] = (float(y.numpy()), float(big.sum().numpy()), got)
    except Exception as e:
        out["error"] = repr(e)

t = threading.Thread(target=work)
t.start()
t.join()
print(out)
"""


def test_a_worker_thread_allocates_uploads_loads_and_captures():
    result = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert "error" not in out, out["error"]
    x = np.arange(6, dtype=np.float64).reshape(2, 3)
    y, big, got = out["ok"]
    assert abs(y - np.exp(x @ x.T).sum()) <= 1e-4 * np.exp(x @ x.T).sum()
    assert big == float(1 << 20)
    assert got == [48.0, 48.0, 48.0]


_LOOKUP_SCRIPT = r"""
import threading
import numpy as np
from needle import backend_ndarray as nd

dev = nd.cuda(0)
rng = np.random.default_rng(0)
w = rng.standard_normal((64, 48)).astype(np.float32)
W = nd.array(w, device=dev)
square = rng.standard_normal((64, 64)).astype(np.float32)
(nd.array(square, device=dev) @ W).numpy()  # matmul.cu's float32 shard loads here
xs = {m: rng.standard_normal((m, 64)).astype(np.float32) for m in (1, 2, 5)}
X = {m: nd.array(x, device=dev) for m, x in xs.items()}  # uploaded here
for m in xs:  # each product's output block freed into the pool here: the worker allocates
    nd.array(np.zeros((m, 48), np.float32), device=dev)  # nothing, so nothing binds for it
dev.synchronize()
out = {}

def work():
    try:  # the same module's one-row and few-row kernels, first looked up in this thread
        ys = {m: X[m] @ W for m in xs}
        out["ok"] = {m: float(np.abs(y.numpy() - xs[m].astype(np.float64) @ w).max())
                     for m, y in ys.items()}
    except Exception as e:
        out["error"] = repr(e)

t = threading.Thread(target=work)
t.start()
t.join()
if "ok" in out:  # now every kernel is looked up and every block pooled: a fresh thread
    t = threading.Thread(target=work)  # only launches, copies and synchronizes
    t.start()
    t.join()
print(out)
"""


def test_a_worker_thread_looks_up_kernels_of_a_module_loaded_elsewhere():
    result = subprocess.run([sys.executable, "-c", _LOOKUP_SCRIPT], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert "error" not in out, out["error"]
    assert set(out["ok"]) == {1, 2, 5}
    assert max(out["ok"].values()) < 1e-4, out["ok"]
