"""NVRTC: compile kernel files to CUBINs for the device's arch, cached on disk.

A kernel file is compiled one dtype *shard* at a time (``-DNEEDLE_SHARD_<sfx>``: only the
kernels whose first dtype suffix is <sfx>; common.cuh's ``ONLY``), because NVRTC's time grows
with the instantiations and a model uses few dtypes: on a cold cache a bf16 model compiles
the bf16, f32, i32, i64 and b8 shards of the families it uses, not every op of every dtype.
``precompile_async`` compiles a list of shards on a pool of threads (NVRTC releases the GIL)
while the caller does something else, loading weights for instance.

``compile_source`` needs no driver (CI compiles every kernel file with it). The device
side (``CudaExecutableCache``) loads the CUBIN as a CUmodule and looks kernels up by name.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ...errors import DeviceError, KernelCompileError
from ...hal import DiskCache, Executable, ExecutableCache, Kernel
from .driver import bind, check, cu, nvrtc

KERNEL_DIR = Path(__file__).parent / "kernels"
# NEEDLE_CUDA_OPTIONS adds NVRTC options (tuning defines such as -DTC_STAGES=3); they are
# part of the disk-cache key, so changing them recompiles.
OPTIONS = ("-std=c++17", "-DNDEBUG", *os.environ.get("NEEDLE_CUDA_OPTIONS", "").split())
FUSED_OPTIONS = OPTIONS  # generated kernels (fused_executable): as the kernel files
_SHARED_DEFAULT = 48 * 1024  # dynamic shared memory a kernel gets without opting in
SHARDS = ("f16", "bf16", "f32", "f64", "i32", "i64", "b8", "u8", "i8")
_SHARD_OF = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64",
             "int32": "i32", "int64": "i64", "bool": "b8", "uint8": "u8", "int8": "i8"}


def shard_of(kernel: str) -> str:
    """The shard a kernel is compiled in: the first dtype suffix of its name
    (``cast_bf16_f32`` -> bf16, ``take_f32_i64`` -> f32)."""
    for part in kernel.split("_"):
        if part in SHARDS:
            return part
    raise KernelCompileError(f"kernel {kernel} names no dtype, so no shard holds it "
                             "(docs/kernels.md: kernels are named {op}_{dtype})")


def shard_options(shard: str | None) -> tuple[str, ...]:
    return OPTIONS if shard is None else (*OPTIONS, "-DNEEDLE_SHARD", f"-DNEEDLE_SHARD_{shard}")


def nvrtc_version() -> tuple[int, int]:
    """The NVRTC library's (major, minor); DeviceError when it cannot be loaded."""
    if nvrtc is None:
        raise DeviceError("cuda-bindings is not installed; pip install 'needle[cuda]'")
    try:
        ret = nvrtc.nvrtcVersion()
    except Exception as e:  # the library itself is missing
        raise DeviceError(f"NVRTC could not be loaded ({e}); install the CUDA 13 NVRTC wheel: "
                          "pip install 'needle[cuda]'") from None
    return int(ret[1]), int(ret[2])


def supported_archs() -> list[int]:
    """Compute capabilities NVRTC can build SASS for (80, 86, 89, 90, ...)."""
    ret = nvrtc.nvrtcGetSupportedArchs()
    return [int(a) for a in ret[1]]


def target_for(capability: int) -> tuple[str, bool]:
    """(arch option value, is_ptx): SASS for the device when NVRTC knows its arch, else
    PTX of the newest arch NVRTC knows below it, for the driver to finish."""
    archs = supported_archs()
    if capability == 90:  # Hopper: the arch-specific target enables wgmma (matmul.cu)
        return "sm_90a", False
    if capability in archs:
        return f"sm_{capability}", False
    older = [a for a in archs if a <= capability]
    if not older:
        raise DeviceError(f"this NVRTC ({nvrtc_version()}) cannot build for compute capability "
                          f"{capability}; it supports {archs}")
    return f"compute_{max(older)}", True


def _log(prog) -> str:
    size = nvrtc.nvrtcGetProgramLogSize(prog)[1]
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.rstrip(b"\x00 ").decode(errors="replace")


def headers() -> dict[str, str]:
    """The shared headers (``kernels/*.cuh``) every kernel file may include."""
    return {p.name: p.read_text() for p in sorted(KERNEL_DIR.glob("*.cuh"))}


def compile_source(source: str, family: str, arch: str, ptx: bool = False,
                   options: tuple[str, ...] = OPTIONS) -> bytes:
    """Compile kernel file ``family`` to a CUBIN (or PTX); KernelCompileError with the log."""
    nvrtc_version()
    hdrs = headers()
    ret = nvrtc.nvrtcCreateProgram(source.encode(), f"{family}.cu".encode(), len(hdrs),
                                   [h.encode() for h in hdrs.values()],
                                   [n.encode() for n in hdrs])
    if ret[0] != 0:
        raise KernelCompileError(f"nvrtcCreateProgram failed for {family}.cu: {ret[0]}")
    prog = ret[1]
    try:
        opts = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in options]
        result = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        if result != 0:
            raise KernelCompileError(
                f"NVRTC could not compile kernel file {family}.cu for {arch} "
                f"({nvrtc.nvrtcGetErrorString(result)[1].decode()}):\n{_log(prog)}")
        get_size, get = ((nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if ptx
                         else (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN))
        out = b" " * get_size(prog)[1]
        get(prog, out)
        return out
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


class CudaKernel(Kernel):
    """A CUfunction and its limits, from the driver's attribute and occupancy queries.
    The occupancy queries and cuFuncSetAttribute act on the calling thread's current context,
    so each binds the device's first (a kernel may be looked up or first sized in a thread
    other than the one that loaded its module)."""

    __slots__ = ("_context", "_sm_count", "_shared_reserved", "address", "cluster_width",
                 "cluster_height")

    def __init__(self, name: str, function, sm_count: int, context=None):
        self._context = context
        self._bind()
        attr = cu.CUfunction_attribute
        max_threads = int(check(cu.cuFuncGetAttribute(
            attr.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, function), "cuFuncGetAttribute"))
        _, block = check(cu.cuOccupancyMaxPotentialBlockSize(function, None, 0, 0),
                         f"cuOccupancyMaxPotentialBlockSize({name})")
        super().__init__(name, function, max_threads, max(32, int(block) // 32 * 32), 32)
        self._sm_count = sm_count
        self._shared_reserved = _SHARED_DEFAULT
        self.address = int(function)  # the CUfunction as an integer, for the native launch
        # groups a cluster in x and y where the kernel fixes it (__cluster_dims__): grids
        # must be multiples of them
        width = check(cu.cuFuncGetAttribute(
            attr.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH, function), "cuFuncGetAttribute")
        height = check(cu.cuFuncGetAttribute(
            attr.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT, function), "cuFuncGetAttribute")
        self.cluster_width, self.cluster_height = max(1, int(width)), max(1, int(height))

    def _bind(self) -> None:
        if self._context is not None:
            bind(self._context)

    def _occupancy(self, threads: int, shared_bytes: int) -> int:
        self._bind()  # once per (threads, shared bytes): the HAL keeps the answer
        per_sm = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            self.handle, threads, shared_bytes), f"occupancy of {self.name}")
        return int(per_sm) * self._sm_count

    def reserve_shared(self, shared_bytes: int) -> None:
        if shared_bytes > self._shared_reserved:
            self._bind()
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(cu.cuFuncSetAttribute(self.handle, attr, shared_bytes),
                  f"reserving {shared_bytes} bytes of shared memory for {self.name}")
            self._shared_reserved = shared_bytes


class CudaExecutable(Executable):
    """A CUmodule loaded from a CUBIN (or PTX)."""

    def __init__(self, name: str, image: bytes, sm_count: int, context):
        super().__init__(name)
        self._context = context
        if context is not None:
            bind(context)  # a kernel first used in another thread loads there
        self.module = check(cu.cuModuleLoadData(image), f"loading kernel module {name}",
                            KernelCompileError)
        self._sm_count = sm_count

    def _load_kernel(self, name: str) -> Kernel:
        ret = cu.cuModuleGetFunction(self.module, name.encode())
        if ret[0] != 0:
            raise KernelCompileError(f"kernel {name} is not in {self.name}.cu (the ABI in "
                                     "docs/kernels.md lists every kernel name)")
        return CudaKernel(name, ret[1], self._sm_count, self._context)


class CudaExecutableCache(ExecutableCache):
    """Kernel files of one CUDA device; CUBINs cached on disk by source, arch and options."""

    def __init__(self, device_name: str, capability: int, sm_count: int, context=None):
        super().__init__(KERNEL_DIR, ".cu", device_name)
        self.context = context  # the device's (None: whatever is current when modules load)
        self.arch, self.ptx = target_for(capability)
        self.sm_count = sm_count
        self.disk = DiskCache("cuda")
        self._pending: dict[str, Future] = {}  # units being compiled ahead of use
        self._pool: ThreadPoolExecutor | None = None

    def unit_of(self, family: str, name: str) -> str:
        return f"{family}:{shard_of(name)}"

    def _image(self, unit: str) -> bytes:
        family, _, shard = unit.partition(":")
        return cached_image(family, self.source(family), self.arch, self.ptx, self.disk,
                            shard or None)

    def _compile(self, unit: str, source: str) -> Executable:
        pending = self._pending.pop(unit, None)
        image = pending.result() if pending is not None else self._image(unit)
        return CudaExecutable(unit, image, self.sm_count, self.context)

    def precompile_async(self, dtypes, families=None) -> list[str]:
        """Start compiling every shard of ``dtypes`` of ``families`` (default: all) that is
        not compiled yet, on a pool of threads; a later kernel lookup waits for its own.
        Returns the units started."""
        started = []
        for family in families or self.families():
            for dtype in dtypes:
                unit = f"{family}:{_SHARD_OF[dtype]}"
                if unit in self._executables or unit in self._pending:
                    continue
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 4,
                                                    thread_name_prefix="needle-nvrtc")
                self._pending[unit] = self._pool.submit(self._image, unit)
                started.append(unit)
        return started

    def fused_executable(self, source: str) -> CudaExecutable:
        """A module of generated kernels (``needle.fusion``), compiled once per source and
        cached on disk; the same options as the kernel files, so each operation compiles as
        in its own kernel (codegen.py keeps the compiler from contracting across them)."""
        image = cached_image("fused", source, self.arch, self.ptx, self.disk, None,
                             FUSED_OPTIONS)
        return CudaExecutable("fused", image, self.sm_count, self.context)

    def wait_precompiled(self) -> None:
        """Wait for every compile started by ``precompile_async`` (raising its error)."""
        for future in list(self._pending.values()):
            future.result()


def cached_image(family: str, source: str, arch: str, ptx: bool, disk: DiskCache,
                 shard: str | None = None, options: tuple[str, ...] | None = None) -> bytes:
    """The CUBIN (or PTX) of a kernel file (one shard of it) from the disk cache, compiling
    it on a miss."""
    options = shard_options(shard) if options is None else options
    key = DiskCache.key(source, *headers().values(), arch, " ".join(options),
                        repr(nvrtc_version()))
    suffix = ".ptx" if ptx else ".cubin"
    image = disk.load(key, suffix)
    if image is None:
        image = compile_source(source, family, arch, ptx, options)
        disk.store(key, suffix, image)
    return image


def precompile(family: str, capability: int) -> str:
    """Fill the disk cache with every shard of one kernel file for a compute capability,
    without a driver (so several processes can compile before the first CUDA call)."""
    arch, ptx = target_for(capability)
    source = (KERNEL_DIR / f"{family}.cu").read_text()
    with ThreadPoolExecutor(max_workers=len(SHARDS)) as pool:
        list(pool.map(lambda shard: cached_image(family, source, arch, ptx, DiskCache("cuda"),
                                                 shard), SHARDS))
    return f"{family}.cu for {arch}"
