"""DLPack capsules for device buffers, built with ctypes (no compiled helper needed).

``export`` wraps a device address in a ``dltensor`` capsule whose deleter releases the
needle buffer once the consumer is done; ``consume`` takes a producer's capsule, renames
it ``used_dltensor`` (the protocol's hand-over) and returns the tensor's description plus
an owner object that calls the producer's deleter when dropped.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ..errors import DTypeError

KDL_CUDA = 2

# (type code, bits) <-> needle dtype; bool is kDLBool (DLPack 0.8+)
_CODES = {
    "float16": (2, 16), "bfloat16": (4, 16), "float32": (2, 32), "float64": (2, 64),
    "int32": (0, 32), "int64": (0, 64), "bool": (6, 8), "uint8": (1, 8), "int8": (0, 8),
}
_DTYPES = {v: k for k, v in _CODES.items()}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
        ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", _Deleter)]

# Our own handles on the C API, not ctypes.pythonapi: its function objects are shared by every
# module, and a library that sets their argtypes to its liking (one of lm-evaluation-harness's
# dependencies does) would have the capsule destructor's calls read our pointers as objects
_api = ctypes.PyDLL(None)
_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_py_api = ctypes.PyDLL(None)  # the same functions, taking Python objects
_py_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_py_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_py_api.PyCapsule_SetName.restype = ctypes.c_int
_py_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]

_NAME = b"dltensor"
_USED = b"used_dltensor"
_live: dict[int, tuple] = {}  # address of a DLManagedTensor -> what it keeps alive


@_Deleter
def _delete(managed) -> None:
    _live.pop(ctypes.cast(managed, ctypes.c_void_p).value, None)


@_CapsuleDestructor
def _destroy_capsule(capsule) -> None:
    # an unconsumed capsule still owns its tensor; a consumed one was renamed
    if _api.PyCapsule_IsValid(capsule, _NAME):
        ptr = _api.PyCapsule_GetPointer(capsule, _NAME)
        _live.pop(ptr, None)


def dtype_code(dtype: str) -> tuple[int, int]:
    return _CODES[dtype]


def export(address: int, shape, strides, dtype: str, device_type: int, device_id: int,
           keepalive) -> object:
    """A ``dltensor`` capsule for ``shape``/``strides`` (elements) at device ``address``;
    ``keepalive`` (the array holding the memory) lives until the consumer deletes it."""
    code, bits = _CODES[dtype]
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides_arr = (ctypes.c_int64 * max(ndim, 1))(*strides)
    managed = DLManagedTensor()
    t = managed.dl_tensor
    t.data = address
    t.device = DLDevice(device_type, device_id)
    t.ndim = ndim
    t.dtype = DLDataType(code, bits, 1)
    t.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(strides_arr, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    managed.deleter = _delete
    ptr = ctypes.addressof(managed)
    _live[ptr] = (managed, shape_arr, strides_arr, keepalive)
    return _api.PyCapsule_New(ptr, _NAME, _destroy_capsule)


class _Owner:
    """Calls the producer's deleter once needle no longer uses the imported memory."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __del__(self):
        managed = ctypes.cast(self.ptr, ctypes.POINTER(DLManagedTensor))
        if managed.contents.deleter:
            managed.contents.deleter(managed)


@dataclass
class Imported:
    address: int  # data + byte_offset
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None  # elements; None when compact
    dtype: str
    device_type: int
    device_id: int
    owner: _Owner


def consume(capsule) -> Imported:
    """Take over a producer's ``dltensor`` capsule (the capsule is marked used)."""
    ptr = _py_api.PyCapsule_GetPointer(capsule, _NAME)
    t = ctypes.cast(ptr, ctypes.POINTER(DLManagedTensor)).contents.dl_tensor
    key = (t.dtype.code, t.dtype.bits)
    if t.dtype.lanes != 1 or key not in _DTYPES:
        raise DTypeError(f"DLPack tensor of type code {t.dtype.code}, {t.dtype.bits} bits, "
                         f"{t.dtype.lanes} lanes has no needle dtype")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None
    _py_api.PyCapsule_SetName(capsule, _USED)
    return Imported((t.data or 0) + t.byte_offset, shape, strides, _DTYPES[key],
                    t.device.device_type, t.device.device_id, _Owner(ptr))
