"""The CUDA driver API through cuda-bindings, with needle's error handling.

cuda-bindings returns ``(CUresult, value...)`` tuples; ``check`` turns a failure into a
``DeviceError`` (or the subclass the caller names) carrying the driver's own error name
and text, and unwraps the value.
"""

from __future__ import annotations

from ...errors import DeviceError

try:
    from cuda.bindings import driver as cu
    from cuda.bindings import nvrtc
except ImportError as e:  # reported by needle.backends.cuda.load()
    cu = nvrtc = None
    IMPORT_ERROR: str | None = (f"cuda-bindings is not installed ({e}); "
                                "install it with: pip install 'needle[cuda]'")
else:
    IMPORT_ERROR = None

SUCCESS = 0


def error_text(result) -> str:
    """'CUDA_ERROR_OUT_OF_MEMORY: out of memory' for a CUresult."""
    try:
        _, name = cu.cuGetErrorName(result)
        _, text = cu.cuGetErrorString(result)
        return f"{name.decode()}: {text.decode()}"
    except Exception:  # the driver itself may be unusable
        return str(result)


def check(ret, what: str, error: type[Exception] = DeviceError):
    """Unwrap ``(CUresult, *values)``: the value(s), or raise ``error`` describing ``what``."""
    result = ret[0]
    if result != SUCCESS:
        raise error(f"{what} failed: {error_text(result)}")
    if len(ret) == 1:
        return None
    return ret[1] if len(ret) == 2 else ret[1:]


def bind(context) -> None:
    """Make ``context`` the calling thread's current context. The driver calls that name no
    handle to take it from (allocating device or page-locked memory, creating an event,
    loading a module, instantiating a graph) act on the thread's current context, and a
    thread other than the one that opened the device has none (CUDA_ERROR_INVALID_CONTEXT).
    One cuCtxGetCurrent where it is already current (another library may have changed it)."""
    current = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(current) != int(context):
        check(cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")


_initialized: str | None = None


def init() -> None:
    """cuInit once; raise DeviceError saying why CUDA cannot be used."""
    global _initialized
    if IMPORT_ERROR:
        raise DeviceError(IMPORT_ERROR)
    if _initialized == "ok":
        return
    if _initialized is not None:
        raise DeviceError(_initialized)
    try:
        ret = cu.cuInit(0)
    except Exception as e:  # libcuda.so missing: cuda-bindings raises while loading it
        _initialized = f"no NVIDIA driver: libcuda could not be loaded ({e})"
        raise DeviceError(_initialized) from None
    if ret[0] != SUCCESS:
        _initialized = f"the NVIDIA driver did not initialize: {error_text(ret[0])}"
        raise DeviceError(_initialized)
    _initialized = "ok"


def device_count() -> int:
    """Number of CUDA devices, 0 when CUDA is unusable for any reason."""
    try:
        init()
        return int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
    except DeviceError:
        return 0
