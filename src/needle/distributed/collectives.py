"""Collectives on NDArrays: every rank calls the same one, in the same order, with arrays
of the same shape and dtype (as with NCCL and MPI themselves).

The backends see compact arrays only: a non-compact argument is worked on through a
compact copy and the result written back into it. ``all_reduce`` and ``broadcast`` change
their argument in place; ``all_gather`` and ``reduce_scatter`` return new arrays. Each
returns at once on the nccl backend (the work is queued on the device's stream).
"""

from __future__ import annotations

import operator
import zlib

import numpy as np

from ..backend_ndarray import NDArray, dtypes
from ..backend_ndarray import array as nd_array
from ..backend_ndarray import empty as nd_empty
from ..errors import ArgumentError, ArgumentTypeError, DistributedError, DTypeError, ShapeError
from .group import ProcessGroup, group

REDUCE_OPS = ("sum", "avg", "max", "min")


def _check_array(x, what: str) -> NDArray:
    if not isinstance(x, NDArray):
        raise ArgumentTypeError(f"{what}: expected an NDArray, got {type(x).__name__} (pass a "
                                "Tensor's .realize_cached_data())")
    return x


def _check_op(op: str, x: NDArray, what: str) -> str:
    if op not in REDUCE_OPS:
        raise ArgumentError(f"{what}: op must be one of {REDUCE_OPS}, got {op!r}")
    if x.dtype == "bool" and op not in ("max", "min"):
        raise DTypeError(f"{what}: bool arrays reduce with 'max' (any) or 'min' (all), not "
                         f"{op!r}")
    if op == "avg" and not x.dtype.startswith(("float", "bfloat")):
        raise DTypeError(f"{what}: 'avg' needs a floating dtype, not {x.dtype}; sum, then "
                         "divide")
    return op


def _agree(g: ProcessGroup, x: NDArray, *what) -> None:
    """With the group's ``check`` on: the ranks exchange a digest of the call they are about
    to make and all raise if any differs."""
    if not g.check:
        return
    call = " ".join(map(str, what + (tuple(x.shape), x.dtype)))
    digest = nd_array(np.array([zlib.crc32(call.encode())], np.int64), device=x.device)
    every = NDArray.make((g.world_size, 1), device=x.device, dtype="int64")
    g.backend.all_gather(digest, every)
    digests = every.numpy()[:, 0]
    others = [r for r in range(g.world_size) if digests[r] != digests[g.rank]]
    if others:
        raise DistributedError(f"rank {g.rank} calls {call}, but rank(s) "
                               f"{', '.join(map(str, others))} call a different collective, op, "
                               "shape or dtype; every rank must make the same calls in the "
                               "same order")


def _in_place(x: NDArray, run) -> NDArray:
    """Run ``run`` on x, or on a compact copy written back into x."""
    if x.is_compact():
        run(x)
    else:
        tmp = x.compact()
        run(tmp)
        x[...] = tmp
    return x


def all_reduce(x: NDArray, op: str = "sum", out: NDArray | None = None) -> NDArray:
    """Reduce ``x`` over the ranks with ``op`` (sum, avg, max, min); every rank's ``x``
    becomes the result, or, with ``out`` (a compact array of x's shape, dtype and device),
    ``out`` does and x keeps its values unless out is x's memory. Ranks may differ in
    whether they pass ``out``. Returns the result's array."""
    _check_op(op, _check_array(x, "all_reduce"), "all_reduce")
    apart = out is not None and out is not x
    if apart:
        _check_out(x, out)
    g = group()
    _agree(g, x, "all_reduce", op)
    if apart:
        g.backend.all_reduce(x.compact(), op, out)
        return out
    return _in_place(x, lambda a: g.backend.all_reduce(a, op))


def _check_out(x: NDArray, out: NDArray) -> None:
    _check_array(out, "all_reduce: out")
    if (out.shape, out.dtype, out.device) != (x.shape, x.dtype, x.device):
        raise ShapeError(f"all_reduce: out must have x's shape, dtype and device "
                         f"({x.shape}, {x.dtype}, {x.device.name}); got ({out.shape}, "
                         f"{out.dtype}, {out.device.name})")
    if not out.is_compact():
        raise ArgumentError("all_reduce: out must be compact (pass out.compact() and copy "
                            "back, or leave out None to reduce x in place)")


def symmetric_empty(shape: tuple[int, ...], dtype: str = "float32") -> NDArray:
    """An uninitialized array on the group's device for the buffers of small all-reduces
    that repeat (a tensor-parallel decoder's residual stream). With the nccl backend and
    NCCL >= 2.27 it lies in symmetric memory, at the same place on every rank, and an
    all-reduce whose input and output lie in such arrays takes NCCL's low-latency kernels;
    elsewhere it is an ordinary array. Collective: every rank calls it with the same shape
    and dtype, in the same order, outside any recording."""
    g = group()
    try:
        shape = (operator.index(shape),) if not hasattr(shape, "__iter__") else \
            tuple(operator.index(n) for n in shape)
    except TypeError:
        raise ArgumentTypeError(f"symmetric_empty: a shape is an int or a tuple of ints, got "
                                f"{shape!r}") from None
    if any(n < 0 for n in shape):
        raise ShapeError(f"symmetric_empty: negative dimension in {shape}")
    dtype = dtypes.canonical(dtype)
    _agree(g, NDArray.make((0,), dtype=dtype, device=g.device), "symmetric_empty", *shape)
    array = g.backend.symmetric_empty(shape, dtype)
    return array if array is not None else nd_empty(shape, dtype, g.device)


def all_gather(x: NDArray) -> NDArray:
    """The ranks' ``x`` stacked along a new first axis: shape (world_size, *x.shape), row
    r from rank r."""
    x = _check_array(x, "all_gather").compact()
    g = group()
    _agree(g, x, "all_gather")
    out = NDArray.make((g.world_size,) + x.shape, device=x.device, dtype=x.dtype)
    g.backend.all_gather(x, out)
    return out


def reduce_scatter(x: NDArray, op: str = "sum") -> NDArray:
    """Reduce ``x`` over the ranks and give rank r the r-th of world_size equal blocks of
    the result along the first axis: shape (x.shape[0] // world_size, *x.shape[1:])."""
    _check_op(op, _check_array(x, "reduce_scatter"), "reduce_scatter")
    g = group()
    if x.ndim == 0 or x.shape[0] % g.world_size:
        raise ShapeError(f"reduce_scatter: the first axis ({x.shape[0] if x.ndim else 'none'}"
                         f") must divide evenly among {g.world_size} ranks")
    _agree(g, x, "reduce_scatter", op)
    x = x.compact()
    out = NDArray.make((x.shape[0] // g.world_size,) + x.shape[1:], device=x.device,
                       dtype=x.dtype)
    g.backend.reduce_scatter(x, out, op)
    return out


def broadcast(x: NDArray, src: int = 0) -> NDArray:
    """Copy rank ``src``'s ``x`` into every rank's ``x``. Returns ``x``."""
    _check_array(x, "broadcast")
    g = group()
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < g.world_size:
        raise ArgumentError(f"broadcast: src must be a rank in 0..{g.world_size - 1}, got "
                            f"{src!r}")
    _agree(g, x, "broadcast", src)
    return _in_place(x, lambda a: g.backend.broadcast(a, src))


def broadcast_host(values: np.ndarray, src: int = 0, spin: float | None = None) -> np.ndarray:
    """Rank ``src``'s host array ``values`` on every rank (the other ranks pass an array of
    the same shape and dtype, whose contents are unused): one broadcast on the group's
    device. Rank ``src`` gets its own array back without waiting; the others wait with the
    group's deadline (``synchronize(spin)``)."""
    g = group()
    received = broadcast(nd_array(values, device=g.device), src=src)
    if g.rank == src:
        return values
    synchronize(spin)
    return received.numpy()


def barrier() -> None:
    """Return once every rank has called barrier (and, on nccl, the device work queued
    before it has finished); a DistributedError after the group's timeout otherwise."""
    group().backend.barrier()


def synchronize(spin: float | None = None) -> None:
    """Wait for this rank's queued collectives, at most the group's timeout (nccl); a
    no-op where collectives complete before they return (mpi). ``spin``: seconds to poll
    without sleeping first (default 2 ms; a sleeping poll can wake up to 1 ms late)."""
    group().backend.synchronize(spin)
