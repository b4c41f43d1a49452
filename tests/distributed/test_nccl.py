"""The nccl backend on one GPU (world size 1; the 2-GPU machines run the multi-rank jobs):
the binding loads the wheel's library, collectives run on cuda arrays in stream order and
are recorded into a CUDA graph; a tensor-parallel model with world size 1 decodes through
a captured step whose all-reduces are NCCL calls. Skips without a GPU or NCCL."""

from __future__ import annotations

import socket

import numpy as np
import pytest

import needle.backend_ndarray as nd
from needle import distributed as dist
from needle.errors import DeviceError, DistributedError

DEV = nd.cuda(0)


def _nccl_missing() -> str | None:
    if not DEV.enabled():
        return f"no CUDA device: {DEV.reason}"
    from needle.distributed import nccl

    try:
        nccl.library()
    except DistributedError as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(_nccl_missing() is not None, reason=_nccl_missing() or "")


def _join(monkeypatch):
    """A process group of one rank on DEV."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    return dist.init_process_group(backend="nccl", timeout=30)


@pytest.fixture
def nccl_group(monkeypatch):
    yield _join(monkeypatch)
    dist.destroy_process_group()


def test_binding_reports_a_version():
    from needle.distributed import nccl

    major, minor, _ = nccl.version()
    assert (major, minor) >= (2, 19)


def test_collectives_on_cuda_arrays(nccl_group):
    assert nccl_group.device == DEV and nccl_group.backend.name == "nccl"
    rng = np.random.default_rng(0)
    for dtype in ("float32", "bfloat16", "float16", "int32", "int64"):
        host = (rng.standard_normal((33, 5)) * 10).astype(nd.dtypes.to_numpy_dtype(dtype))
        for op in ("sum", "max", "min") + (("avg",) if dtype.startswith(("f", "b")) else ()):
            x = nd.array(host, device=DEV)
            assert dist.all_reduce(x, op) is x
            np.testing.assert_array_equal(x.numpy(), host)  # one rank: the identity
        np.testing.assert_array_equal(dist.all_gather(nd.array(host, device=DEV)).numpy(),
                                      host[None])
        np.testing.assert_array_equal(dist.reduce_scatter(nd.array(host, device=DEV)).numpy(),
                                      host)
        b = nd.array(host, device=DEV)
        np.testing.assert_array_equal(dist.broadcast(b, 0).numpy(), host)
    view = nd.array(np.arange(12, dtype=np.float32).reshape(3, 4), device=DEV)[:, ::2]
    dist.all_reduce(view)
    np.testing.assert_array_equal(view.numpy(), np.arange(12).reshape(3, 4)[:, ::2])
    dist.barrier()
    dist.synchronize()


def test_collectives_are_recorded_in_a_cuda_graph(nccl_group):
    be = DEV.backend
    x = nd.array(np.ones((64, 64), np.float32), device=DEV)
    with be.capture() as graph:
        y = x * 2.0
        dist.all_reduce(y, "sum")
        gathered = dist.all_gather(y + 1.0)
        dist.broadcast(gathered, 0)
    graph.replay()
    np.testing.assert_array_equal(gathered.numpy(), np.full((1, 64, 64), 3.0))
    x[...] = 5.0  # a new input in the same buffer; the replay reads it
    graph.replay()
    np.testing.assert_array_equal(gathered.numpy(), np.full((1, 64, 64), 11.0))
    graph.close()


def test_leaving_the_group_closes_the_graphs_that_recorded_its_collectives(monkeypatch):
    """NCCL's destroy waits until every graph holding the communicator is gone, so the
    backend closes those graphs first; replaying one afterwards says why it cannot."""
    _join(monkeypatch)
    be = DEV.backend
    x = nd.array(np.ones((8,), np.float32), device=DEV)
    with be.capture() as with_collective:
        dist.all_reduce(x, "sum")
    with be.capture() as without:
        y = x * 2.0
    with_collective.replay()
    without.replay()
    dist.destroy_process_group()
    assert with_collective.closed and not without.closed
    with pytest.raises(DeviceError, match="destroy_process_group"):
        with_collective.replay()
    without.replay()  # graphs without collectives are the caller's, untouched
    np.testing.assert_array_equal(y.numpy(), np.full(8, 2.0))
    without.close()


def test_symmetric_arrays_are_registered_memory_that_outlives_the_group(monkeypatch):
    """With NCCL >= 2.27 an array of ``symmetric_empty`` lies in ncclMemAlloc memory that a
    window registers; an all-reduce of it records into a graph; leaving the group
    deregisters the window but keeps the memory while an array uses it."""
    from needle.distributed import nccl
    from needle.distributed.nccl_backend import _SymmetricMemory

    g = _join(monkeypatch)
    x = dist.symmetric_empty((2048,), "bfloat16")
    x[...] = nd.array(np.arange(2048) % 5, dtype="bfloat16", device=DEV)
    assert x.device == DEV
    if nccl.has_windows():
        assert isinstance(x.handle.buffer.owner, _SymmetricMemory)
        assert len(g.backend._windows) == 1
    with DEV.backend.queue.capture() as graph:
        dist.all_reduce(x, "sum")
    graph.replay()
    dist.synchronize()
    dist.destroy_process_group()
    assert g.backend._windows == []
    np.testing.assert_array_equal(x.numpy().astype(np.float32), np.arange(2048) % 5)


def test_two_gpus_leave_the_group_with_captured_collectives_alive():
    """2 ranks on 2 GPUs record an all-reduce, replay it, and leave the group while the
    graph is alive: with NCCL's wait for graphs holding the communicator, the ranks exit
    only because leaving closes them (the job would otherwise time out)."""
    if not nd.cuda(1).enabled():
        pytest.skip("needs two CUDA devices")
    from .jobs import run_job

    job = run_job("graph_exit.py", backend="nccl", timeout=180,
                  env={"NCCL_NVLS_ENABLE": "0"})
    assert job.returncode == 0, job.stderr[-3000:]
    assert {"ok 0", "ok 1"} <= set(job.stdout.split("\n"))


def test_tensor_parallel_decode_is_captured(nccl_group, tmp_path):
    from needle.models import load_pretrained

    from ..models.hf_models import build

    build("llama", tmp_path)
    prompt = [1, 17, 92, 5, 201, 33, 8]
    tp = dist.load_tensor_parallel(tmp_path, dtype="float32", max_seq_len=32)
    one = load_pretrained(tmp_path, device=DEV, dtype="float32", max_seq_len=32)
    np.testing.assert_allclose(tp.forward([prompt]).numpy(), one.forward([prompt]).numpy(),
                               rtol=1e-4, atol=1e-4)
    assert tp.generate(prompt, 8, temperature=0) == one.generate(prompt, 8, temperature=0)
    steps = tp.decoder(), one.decoder()
    token = int(steps[1].prefill(prompt).numpy().argmax())
    steps[0].prefill(prompt)
    for _ in range(4):
        mine, theirs = (s.step(token).numpy() for s in steps)
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-4)
        token = int(theirs.argmax())
    assert steps[0].captured  # the step with its NCCL all-reduces replays as a graph


@pytest.mark.parametrize("limit", [0, 1 << 15])
def test_a_small_tensor_parallel_residual_lies_in_symmetric_memory(nccl_group, tmp_path,
                                                                    monkeypatch, limit):
    """The decode residual is symmetric (NCCL >= 2.27) up to SYMMETRIC_MAX_BYTES, above
    which NCCL's symmetric all-reduce is the slower one; either way the step decodes."""
    from needle.distributed import nccl, tensor_parallel
    from needle.distributed.nccl_backend import _SymmetricMemory
    from needle.models import load_pretrained

    from ..models.hf_models import build

    monkeypatch.setattr(tensor_parallel, "SYMMETRIC_MAX_BYTES", limit)
    build("llama", tmp_path)
    tp = dist.load_tensor_parallel(tmp_path, dtype="float32", max_seq_len=32)
    owner = tp.transformer.decode_residual.handle.buffer.owner
    assert isinstance(owner, _SymmetricMemory) == (limit > 0 and nccl.has_windows())
    one = load_pretrained(tmp_path, device=DEV, dtype="float32", max_seq_len=32)
    prompt = [1, 17, 92, 5, 201, 33, 8]
    assert tp.generate(prompt, 6, temperature=0) == one.generate(prompt, 6, temperature=0)
