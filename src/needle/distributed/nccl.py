"""A ctypes binding of the NCCL C API (the library of the ``nvidia-nccl-cu13`` wheel).

Only what the "nccl" backend calls: unique ids, communicators, the four collectives,
symmetric memory windows (NCCL >= 2.27) and error reporting. Every call's result is
checked; a failure raises ``DistributedError`` with NCCL's own text and its last error
message.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
from pathlib import Path

from ..errors import DistributedError

UNIQUE_ID_BYTES = 128
DTYPES = {"int32": 2, "int64": 4, "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
          "bool": 1, "int8": 0, "uint8": 1}  # bool travels as uint8
OPS = {"sum": 0, "max": 2, "min": 3, "avg": 4}
_IN_PROGRESS = 7
WIN_COLL_SYMMETRIC = 0x01  # every rank passes buffers at the same offset into the window


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


def _candidates() -> list[str]:
    """Where libnccl may be: NEEDLE_NCCL_LIBRARY, the nvidia-nccl wheel, the system."""
    found = []
    if os.environ.get("NEEDLE_NCCL_LIBRARY"):
        found.append(os.environ["NEEDLE_NCCL_LIBRARY"])
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found.append(str(Path(folder) / "lib" / "libnccl.so.2"))
    found.append(ctypes.util.find_library("nccl") or "libnccl.so.2")
    return found


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, size, i32, comm = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
    signatures = {
        "ncclGetVersion": [ctypes.POINTER(i32)],
        "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
        "ncclCommInitRank": [ctypes.POINTER(comm), i32, UniqueId, i32],
        "ncclCommDestroy": [comm],
        "ncclCommAbort": [comm],
        "ncclCommGetAsyncError": [comm, ctypes.POINTER(i32)],
        "ncclAllReduce": [vp, vp, size, i32, i32, comm, vp],
        "ncclAllGather": [vp, vp, size, i32, comm, vp],
        "ncclReduceScatter": [vp, vp, size, i32, i32, comm, vp],
        "ncclBroadcast": [vp, vp, size, i32, i32, comm, vp],
    }
    windows = {  # NCCL >= 2.27 only: bound where the library has them
        "ncclMemAlloc": [ctypes.POINTER(vp), size],
        "ncclMemFree": [vp],
        "ncclCommWindowRegister": [comm, vp, size, ctypes.POINTER(vp), i32],
        "ncclCommWindowDeregister": [comm, vp],
    }
    for name, args in {**signatures, **{k: v for k, v in windows.items()
                                        if hasattr(lib, k)}}.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i32
    lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [i32], ctypes.c_char_p
    lib.ncclGetLastError.argtypes, lib.ncclGetLastError.restype = [comm], ctypes.c_char_p
    return lib


_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The loaded NCCL library (once per process), or a DistributedError naming where it
    was looked for."""
    global _lib
    if _lib is None:
        errors = []
        for path in _candidates():
            try:
                _lib = _bind(ctypes.CDLL(path))
                break
            except OSError as e:
                errors.append(f"{path}: {e}")
        else:
            raise DistributedError("the nccl backend needs the NCCL library: pip install "
                                   "nvidia-nccl-cu13 (or set NEEDLE_NCCL_LIBRARY); tried "
                                   + "; ".join(errors))
    return _lib


def check(result: int, what: str, comm=None) -> None:
    if result in (0, _IN_PROGRESS):
        return
    lib = library()
    text = lib.ncclGetErrorString(result).decode(errors="replace")
    detail = lib.ncclGetLastError(comm).decode(errors="replace") if comm else ""
    raise DistributedError(f"{what} failed: NCCL error {result} ({text})"
                           + (f": {detail}" if detail else ""))


def version() -> tuple[int, int, int]:
    code = ctypes.c_int()
    check(library().ncclGetVersion(ctypes.byref(code)), "ncclGetVersion")
    v = code.value  # NCCL >= 2.9: major * 10000 + minor * 100 + patch
    return v // 10000, v // 100 % 100, v % 100


def unique_id() -> bytes:
    uid = UniqueId()
    check(library().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return ctypes.string_at(ctypes.byref(uid), UNIQUE_ID_BYTES)


def comm_init_rank(world_size: int, uid: bytes, rank: int) -> ctypes.c_void_p:
    comm = ctypes.c_void_p()
    ident = UniqueId.from_buffer_copy(uid)
    check(library().ncclCommInitRank(ctypes.byref(comm), world_size, ident, rank),
          f"ncclCommInitRank (rank {rank} of {world_size})")
    return comm


def async_error(comm) -> int:
    """0, or the error an earlier collective of ``comm`` ran into on the device."""
    code = ctypes.c_int()
    check(library().ncclCommGetAsyncError(comm, ctypes.byref(code)), "ncclCommGetAsyncError",
          comm)
    return code.value


def has_windows() -> bool:
    """Whether the library registers symmetric memory windows (NCCL >= 2.27)."""
    return hasattr(library(), "ncclCommWindowRegister") and version() >= (2, 27, 0)


def symmetric_alloc(comm, nbytes: int) -> tuple[int, ctypes.c_void_p]:
    """``nbytes`` of device memory from ``ncclMemAlloc`` (CUDA virtual memory), registered
    as a symmetric window of ``comm``; returns (address, window). Collective: every rank
    calls it with the same size, in the same order."""
    lib, pointer, window = library(), ctypes.c_void_p(), ctypes.c_void_p()
    check(lib.ncclMemAlloc(ctypes.byref(pointer), nbytes), f"ncclMemAlloc({nbytes})", comm)
    try:
        check(lib.ncclCommWindowRegister(comm, pointer, nbytes, ctypes.byref(window),
                                         WIN_COLL_SYMMETRIC), "ncclCommWindowRegister", comm)
    except DistributedError:
        lib.ncclMemFree(pointer)
        raise
    return pointer.value, window


def window_deregister(comm, window: ctypes.c_void_p) -> None:
    check(library().ncclCommWindowDeregister(comm, window), "ncclCommWindowDeregister", comm)


def mem_free(address: int) -> None:
    check(library().ncclMemFree(ctypes.c_void_p(address)), "ncclMemFree")
