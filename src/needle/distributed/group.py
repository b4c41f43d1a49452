"""The process group: this process's place in the job, its store and its backend.

``init_process_group()`` reads the launch variables (``launch_env.py``), lets rank 0 serve
the store, waits until every rank has joined (naming any that did not within the
timeout), and starts the backend: "nccl" for CUDA arrays, "mpi" for CPU arrays.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .. import checks
from ..backend_ndarray import Device, device_from_name
from ..errors import DistributedError
from .launch_env import LaunchEnv, read_launch_env
from .store import Store

BACKENDS = ("nccl", "mpi")
BACKEND_VAR = "NEEDLE_DIST_BACKEND"
TIMEOUT_VAR = "NEEDLE_DIST_TIMEOUT"
CHECK_VAR = "NEEDLE_DIST_CHECK"
DEFAULT_TIMEOUT = 300.0


@dataclass
class ProcessGroup:
    env: LaunchEnv
    backend: object  # MpiBackend or NcclBackend
    device: Device
    store: Store | None
    timeout: float
    check: bool = False  # before each collective, make sure every rank calls the same one

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size


_group: ProcessGroup | None = None


def _timeout(timeout: float | None) -> float:
    if timeout is None:
        value = os.environ.get(TIMEOUT_VAR, str(DEFAULT_TIMEOUT))
        try:
            timeout = float(value)
        except ValueError:
            raise DistributedError(f"{TIMEOUT_VAR}={value!r} is not a number of seconds") from None
    return checks.number(timeout, "timeout", "init_process_group", 0.0, low_open=True)


def _choose_backend(backend: str | None, device: Device | None) -> str:
    backend = backend or os.environ.get(BACKEND_VAR)
    if backend is None:
        backend = "nccl" if device is not None and device.kind == "cuda" else "mpi"
    if backend not in BACKENDS:
        raise DistributedError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    return backend


def _device(backend: str, device, env: LaunchEnv) -> Device:
    if isinstance(device, str):
        device = device_from_name(device)
    if backend == "nccl":
        from ..backend_ndarray import cuda

        device = device or cuda(env.local_rank)
        if device.kind != "cuda":
            raise DistributedError(f"the nccl backend works on cuda devices, not {device.name}; "
                                   "use backend='mpi' for CPU arrays")
    else:
        from ..backend_ndarray import cpu

        device = device or cpu()
        if device.kind not in ("cpu", "cpu_numpy"):
            raise DistributedError(f"the mpi backend works on CPU arrays, not {device.name}; "
                                   "use backend='nccl' for cuda devices")
    device.backend  # noqa: B018 -- raises DeviceError saying why a disabled device is unusable
    return device


def init_process_group(backend: str | None = None, device: Device | str | None = None,
                       timeout: float | None = None, check: bool | None = None
                       ) -> ProcessGroup:
    """Join the job this process was launched into and return its group.

    ``backend``: "nccl" (cuda devices) or "mpi" (CPU arrays; processes started by mpiexec);
    default ``NEEDLE_DIST_BACKEND``, else nccl for a cuda ``device``, else mpi.
    ``device``: where this rank's arrays live (default cuda(LOCAL_RANK) for nccl, cpu() for
    mpi). ``timeout``: seconds any rank waits for the others (joining, a store key, a
    collective's completion in barrier/synchronize); default ``NEEDLE_DIST_TIMEOUT`` or 300.
    ``check`` (default ``NEEDLE_DIST_CHECK=1``): before each collective the ranks compare
    what they are about to call (collective, op, shape, dtype) and raise DistributedError
    when they differ, instead of hanging or mixing unrelated data. It costs one small
    all-gather and a host sync per collective: a debugging aid.
    """
    global _group
    if _group is not None:
        raise DistributedError("the process group is already initialized; call "
                               "destroy_process_group() first")
    env = read_launch_env()
    if isinstance(device, str):
        device = device_from_name(device)
    name = _choose_backend(backend, device)
    device = _device(name, device, env)
    timeout = _timeout(timeout)
    if name == "mpi":
        from .mpi_backend import MpiBackend

        impl, store = MpiBackend(env.rank, env.world_size, timeout), None
    else:
        from .nccl_backend import NcclBackend

        store = _join(env, timeout)
        impl = NcclBackend(env.rank, env.world_size, device, store, timeout)
    if check is None:
        check = os.environ.get(CHECK_VAR) == "1"
    _group = ProcessGroup(env, impl, device, store, timeout, bool(check))
    return _group


def _join(env: LaunchEnv, timeout: float) -> Store:
    """Rank 0 serves the store; every rank connects, says it has joined, and waits for all."""
    addr, port = env.master_addr, env.master_port
    store = (Store.serve(addr, port, timeout) if env.rank == 0
             else Store.connect(addr, port, timeout))
    store.set(f"joined/{env.rank}", b"1")
    store.wait_all("joined/", env.world_size, what="joined the process group")
    return store


def group() -> ProcessGroup:
    """The current process group, or a DistributedError saying to initialize one."""
    if _group is None:
        raise DistributedError("no process group: call needle.distributed.init_process_group() "
                               "first (in a script started by `needle run -n N`)")
    return _group


def is_initialized() -> bool:
    return _group is not None


def get_rank() -> int:
    """This process's rank (0 without a process group)."""
    return _group.rank if _group is not None else 0


def get_world_size() -> int:
    """The number of processes of the job (1 without a process group)."""
    return _group.world_size if _group is not None else 1


def destroy_process_group() -> None:
    """Leave the group: wait for every rank to leave too (so that rank 0's store outlives
    their last read), then release the backend and the store."""
    global _group
    g = group()
    try:
        if g.store is not None:
            g.store.set(f"left/{g.rank}", b"1")
            if g.rank == 0:
                g.store.wait_all("left/", g.world_size, what="left the process group")
        g.backend.close()
    finally:
        if g.store is not None:
            g.store.close()
        _group = None
