"""The "mpi" backend: collectives on CPU arrays through mpi4py (Open MPI, MPICH).

MPI does the communication; this module only moves NDArrays to and from numpy buffers.
Half-precision sums are reduced in float32 (MPI has no bfloat16 type) and rounded once.
The processes must be started by ``mpiexec`` (``needle run --backend mpi`` does it).

Every collective is started non-blocking and waited for with a deadline, so a rank that
hangs makes the others raise instead of waiting forever; a rank that dies makes mpiexec
end the job.
"""

from __future__ import annotations

import time

import numpy as np

from ..backend_ndarray import NDArray, dtypes
from ..backend_ndarray import array as nd_array
from ..errors import DistributedError

_HALF = ("float16", "bfloat16")


def load_mpi():
    """mpi4py's MPI module, or a DistributedError saying how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise DistributedError(f"the mpi backend needs mpi4py and an MPI library ({e}); "
                               "pip install 'needle[distributed]'") from None
    return MPI


class MpiBackend:
    name = "mpi"

    def __init__(self, rank: int, world_size: int, timeout: float):
        self.timeout = timeout
        self.MPI = load_mpi()
        self.comm = self.MPI.COMM_WORLD
        if (self.comm.Get_rank(), self.comm.Get_size()) != (rank, world_size):
            raise DistributedError(
                f"MPI sees rank {self.comm.Get_rank()} of {self.comm.Get_size()} but the "
                f"environment says rank {rank} of {world_size}: start mpi jobs with mpiexec "
                "(`needle run --backend mpi`), not with plain processes")
        self._ops = {"sum": self.MPI.SUM, "avg": self.MPI.SUM, "max": self.MPI.MAX,
                     "min": self.MPI.MIN}

    def symmetric_empty(self, shape: tuple[int, ...], dtype: str) -> NDArray | None:
        """MPI has no symmetric memory: None (the caller makes an ordinary array)."""
        return None

    @staticmethod
    def _host(x: NDArray, reduce: bool) -> np.ndarray:
        host = np.ascontiguousarray(x.numpy())
        if host.dtype == np.bool_:
            return host.view(np.uint8)
        if x.dtype in _HALF:
            return host.astype(np.float32) if reduce else host.view(np.uint16)
        return host

    @staticmethod
    def _store(out: NDArray, host: np.ndarray) -> None:
        if out.dtype == "bool":
            host = host.view(np.bool_)
        elif out.dtype in _HALF and host.dtype == np.uint16:
            host = host.view(dtypes.to_numpy_dtype(out.dtype))
        out[...] = nd_array(host.reshape(out.shape), dtype=out.dtype, device=out.device)

    def all_reduce(self, x: NDArray, op: str, out: NDArray | None = None) -> None:
        buf = self._host(x, reduce=True)
        self._wait(self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self._ops[op]),
                   "all_reduce")
        self._store(x if out is None else out,
                    buf / self.comm.Get_size() if op == "avg" else buf)

    def all_gather(self, x: NDArray, out: NDArray) -> None:
        send = self._host(x, reduce=False)
        recv = np.empty((self.comm.Get_size(),) + send.shape, send.dtype)
        self._wait(self.comm.Iallgather(send, recv), "all_gather")
        self._store(out, recv)

    def reduce_scatter(self, x: NDArray, out: NDArray, op: str) -> None:
        send = self._host(x, reduce=True)
        recv = np.empty(send.size // self.comm.Get_size(), send.dtype)
        self._wait(self.comm.Ireduce_scatter_block(send, recv, op=self._ops[op]),
                   "reduce_scatter")
        self._store(out, recv / self.comm.Get_size() if op == "avg" else recv)

    def broadcast(self, x: NDArray, src: int) -> None:
        buf = self._host(x, reduce=False)
        self._wait(self.comm.Ibcast(buf, root=src), "broadcast")
        self._store(x, buf)

    def barrier(self) -> None:
        self._wait(self.comm.Ibarrier(), "barrier")

    def _wait(self, request, what: str) -> None:
        """Poll ``request`` until it completes or the timeout passes (then raise)."""
        deadline = time.monotonic() + self.timeout
        pause = 0.0
        while not request.Test():
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"{what} timed out after {self.timeout:.0f} s: another rank has not "
                    "reached it (hung, died, or called a different collective)")
            time.sleep(pause)
            pause = min(pause * 2 or 1e-5, 1e-3)

    def synchronize(self, spin: float | None = None) -> None:
        pass  # every collective has completed when it returns

    def close(self) -> None:
        pass  # MPI finalizes at exit (mpi4py registers it)
