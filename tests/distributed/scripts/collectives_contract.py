"""Run by test_collectives.py under `needle run -n 2 --backend mpi`: every collective's
contract on every CPU device and the dtypes that matter, checked against numpy on every
rank. Prints "ok <rank>" at the end; any failed check exits non-zero. Under
`needle run -n 2 --backend nccl` (a machine of 2 GPUs) it checks each rank's cuda device."""

import numpy as np

from needle import backend_ndarray as nd
from needle import distributed as dist
from needle.errors import ArgumentError, ArgumentTypeError, DTypeError, ShapeError

g = dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
assert (rank, world) == (g.rank, 2), (rank, world)


def data(r: int, dtype: str, shape=(4, 3)) -> np.ndarray:
    """Rank r's input: different on every rank, exact in every dtype."""
    base = np.arange(np.prod(shape)).reshape(shape) % 7
    return (base * (r + 1) - 3 * r).astype(nd.dtypes.to_numpy_dtype(dtype))


def host(dtype, a):
    return np.asarray(a, dtype=np.float64) if dtype != "bool" else a


devices = (g.device,) if g.backend.name == "nccl" else (nd.cpu(), nd.cpu_numpy())
for device in devices:
    for dtype in ("float32", "float64", "bfloat16", "float16", "int32", "int64"):
        inputs = [data(r, dtype) for r in range(world)]
        mine = inputs[rank]
        stack = np.stack([host(dtype, a) for a in inputs])
        for op, want in (("sum", stack.sum(0)), ("max", stack.max(0)), ("min", stack.min(0)),
                         ("avg", stack.mean(0))):
            if op == "avg" and dtype.startswith("int"):
                continue
            x = nd.array(mine, dtype=dtype, device=device)
            out = dist.all_reduce(x, op)
            assert out is x
            np.testing.assert_allclose(host(dtype, x.numpy()), want, rtol=1e-2, atol=1e-2,
                                       err_msg=f"all_reduce {op} {dtype} {device.name}")
            scattered = dist.reduce_scatter(nd.array(mine, dtype=dtype, device=device), op)
            assert scattered.shape == (2, 3) and scattered.dtype == dtype
            np.testing.assert_allclose(host(dtype, scattered.numpy()),
                                       want[2 * rank:2 * rank + 2], rtol=1e-2, atol=1e-2)
        gathered = dist.all_gather(nd.array(mine, dtype=dtype, device=device))
        assert gathered.shape == (2, 4, 3) and gathered.dtype == dtype
        np.testing.assert_array_equal(host(dtype, gathered.numpy()), stack)
        b = nd.array(mine, dtype=dtype, device=device)
        dist.broadcast(b, src=1)
        np.testing.assert_array_equal(host(dtype, b.numpy()), host(dtype, inputs[1]))

    # a non-compact argument: the result lands in the view, the rest of its base untouched
    base = nd.array(np.full((4, 6), 100.0, np.float32) + rank, device=device)
    view = base[:, ::2]
    dist.all_reduce(view, "sum")
    got = base.numpy()
    np.testing.assert_array_equal(got[:, ::2], np.full((4, 3), 201.0))
    np.testing.assert_array_equal(got[:, 1::2], np.full((4, 3), 100.0 + rank))

    # out: the result lands in another array and x keeps its values; ranks may differ in
    # whether they pass one (a tensor-parallel layer's rank 0 reduces into its residual)
    x = nd.array(np.full((4, 3), rank + 1.0, np.float32), device=device)
    target = nd.array(np.zeros((4, 3), np.float32), device=device)
    got = dist.all_reduce(x, "sum", out=target if rank == 1 else None)
    np.testing.assert_array_equal(got.numpy(), np.full((4, 3), 3.0))
    if rank == 1:
        assert got is target
        np.testing.assert_array_equal(x.numpy(), np.full((4, 3), 2.0))
    else:
        assert got is x

    # bool: max is any, min is all
    flags = nd.array(np.array([True, False, rank == 0, rank == 1]), device=device)
    dist.all_reduce(flags, "max")
    np.testing.assert_array_equal(flags.numpy(), [True, False, True, True])

# arrays for repeated small all-reduces (NCCL symmetric memory on GPUs, where NCCL has
# it): reduced in place and apart like any array
for dtype in ("float32", "bfloat16"):
    a, b = dist.symmetric_empty((4, 3), dtype), dist.symmetric_empty((4, 3), dtype)
    assert (a.shape, a.dtype, a.device) == ((4, 3), dtype, g.device)
    assert dist.symmetric_empty(5, dtype).shape == (5,)  # an int is a 1-D shape
    a[...] = nd.array(data(rank, dtype), dtype=dtype, device=g.device)
    want = sum(host(dtype, data(r, dtype)) for r in range(world))
    assert dist.all_reduce(a, "sum", out=b) is b and dist.all_reduce(a, "sum") is a
    for got in (a, b):
        np.testing.assert_array_equal(host(dtype, got.numpy()), want)

# bad input fails the same way on every rank, before any communication
for call, error in ((lambda: dist.all_reduce(nd.array([1, 2]), "avg"), DTypeError),
                    (lambda: dist.all_reduce(nd.array([1.0]), "prod"), ArgumentError),
                    (lambda: dist.all_reduce(np.ones(3)), ArgumentTypeError),
                    (lambda: dist.reduce_scatter(nd.array(np.ones(3, np.float32))), ShapeError),
                    (lambda: dist.broadcast(nd.array([1.0]), src=2), ArgumentError),
                    (lambda: dist.all_reduce(nd.array([True]), "sum"), DTypeError),
                    (lambda: dist.symmetric_empty((2, -1)), ShapeError),
                    (lambda: dist.symmetric_empty((2, 1.5)), ArgumentTypeError),
                    (lambda: dist.symmetric_empty((2,), "float31"), DTypeError),
                    (lambda: dist.all_reduce(nd.array([1.0, 2.0]), out=nd.array([1.0])),
                     ShapeError),
                    (lambda: dist.all_reduce(nd.array([1.0, 2.0]),
                                             out=nd.array(np.ones((2, 2), np.float32))[:, 0]),
                     ArgumentError)):
    try:
        call()
    except error:
        pass
    else:
        raise AssertionError("bad input was accepted")

dist.barrier()
dist.destroy_process_group()
assert not dist.is_initialized()
print(f"ok {rank}", flush=True)
