"""Metal's run-time compiler: one MTLLibrary per kernel file, pipeline states per kernel.

A kernel file is ``kernels/<family>.metal`` preceded by the shared ``kernels/common.h``
(Metal compiles a source string, so there is no include path): ``#line`` directives keep
the compiler's messages pointing at the right file and line. Options: an explicit MSL version
and IEEE math (``compile_options``).
"""

from __future__ import annotations

from pathlib import Path

from ...errors import DTypeError, KernelCompileError
from ...hal import Executable, ExecutableCache, Kernel

KERNEL_DIR = Path(__file__).parent / "kernels"
COMMON = "common.h"

# Metal exposes no occupancy query and queues threadgroups beyond what fits at no cost, so a
# grid-stride launch covers up to this many threads and loops beyond.
_GRID_THREADS = 1 << 17


def library_source(family: str, directory: Path = KERNEL_DIR) -> str:
    """The source Metal compiles for kernel file ``family`` of ``directory``."""
    common = (directory / COMMON).read_text()
    body = (directory / f"{family}.metal").read_text()
    return f'#line 1 "{COMMON}"\n{common}\n#line 1 "{family}.metal"\n{body}'


def _macos_version(api) -> tuple[int, int]:
    """The running macOS release (NSProcessInfo; PyObjC's Metal module re-exports Foundation)."""
    info = getattr(api, "NSProcessInfo", None)
    if info is None:
        from Foundation import NSProcessInfo as info  # noqa: N813 -- Objective-C class name
    version = info.processInfo().operatingSystemVersion()
    return int(version.majorVersion), int(version.minorVersion)


def language_version(api) -> tuple[int, int]:
    """The MSL version kernels compile at: 3.1 on macOS 14 and later (bfloat), else 3.0.

    Set explicitly rather than left to the OS default, so that one macOS always builds the
    same kernels; tests compile every kernel file at both (docs/metal.md).
    """
    if _macos_version(api) >= (14, 0) and hasattr(api, "MTLLanguageVersion3_1"):
        return 3, 1
    return 3, 0


def compile_options(api):
    """MTLCompileOptions: the MSL version of ``language_version``, and IEEE math.

    Metal turns fast math on by default; needle wants NaN, infinities and signed zeros to
    behave as IEEE and as the reference backend says. ``mathMode`` (macOS 15) replaces the
    deprecated ``fastMathEnabled``, which older systems still need.
    """
    options = api.MTLCompileOptions.alloc().init()
    major, minor = language_version(api)
    options.setLanguageVersion_(getattr(api, f"MTLLanguageVersion{major}_{minor}"))
    if options.respondsToSelector_("setMathMode:"):
        options.setMathMode_(api.MTLMathModeSafe)
    else:
        options.setFastMathEnabled_(False)
    return options


def _description(error) -> str:
    if error is None:
        return "no error information"
    describe = getattr(error, "localizedDescription", None)
    return str(describe()) if describe else str(error)


class MetalKernel(Kernel):
    """A compute pipeline state and the limits Metal reports for it."""

    __slots__ = ()

    def __init__(self, name: str, pipeline):
        width = int(pipeline.threadExecutionWidth())
        max_threads = int(pipeline.maxTotalThreadsPerThreadgroup())
        super().__init__(name, pipeline, max_threads, max(width, max_threads // width * width),
                         width)
        self.static_shared = int(pipeline.staticThreadgroupMemoryLength())

    def _occupancy(self, threads: int, shared_bytes: int) -> int:
        return max(1, _GRID_THREADS // max(threads, 1))


class MetalExecutable(Executable):
    """An MTLLibrary; ``kernel(name)`` makes (and caches) the function's pipeline state."""

    def __init__(self, name: str, library, device):
        super().__init__(name)
        self.library = library
        self._device = device

    def _load_kernel(self, name: str) -> Kernel:
        function = self.library.newFunctionWithName_(name)
        if function is None:
            if name.endswith("_bf16") or "_bf16_" in name:
                raise DTypeError(f"bfloat16 kernel {name} is not available: this Metal version "
                                 "has no bfloat type (it needs Metal 3.1, macOS 14 or later); "
                                 "use float16 or float32")
            raise KernelCompileError(f"kernel {name} is not in {self.name}.metal (the ABI in "
                                     "docs/kernels.md lists every kernel name)")
        pipeline, error = self._device.newComputePipelineStateWithFunction_error_(function, None)
        if pipeline is None:
            raise KernelCompileError(f"Metal could not build a pipeline for kernel {name} of "
                                     f"{self.name}.metal: {_description(error)}")
        return MetalKernel(name, pipeline)


class MetalExecutableCache(ExecutableCache):
    """Kernel files of the Metal device, compiled by ``newLibraryWithSource`` on first use.

    Compiled libraries live for the process (Metal keeps its own shader cache on disk).
    """

    def __init__(self, device_name: str, mtl_device, api):
        super().__init__(KERNEL_DIR, ".metal", device_name)
        self._mtl = mtl_device
        self._api = api

    def source(self, family: str) -> str:
        if not (self.source_dir / f"{family}.metal").is_file():
            raise KernelCompileError(f"no kernel file {family}.metal in {self.source_dir}")
        return library_source(family, self.source_dir)

    def kernel(self, family: str, name: str) -> Kernel:
        try:
            return super().kernel(family, name)
        except KernelCompileError as e:
            if name in str(e):
                raise
            raise KernelCompileError(f"kernel {name}: {e}") from None

    def fused_executable(self, source: str) -> MetalExecutable:
        """A library of generated kernels (``needle.fusion``); ``source`` is complete MSL."""
        return MetalExecutable("fused", compile_library(self._mtl, self._api, source, "fused"),
                               self._mtl)

    def _compile(self, family: str, source: str) -> Executable:
        return MetalExecutable(family, compile_library(self._mtl, self._api, source, family),
                               self._mtl)


def compile_library(mtl_device, api, source: str, what: str):
    """An MTLLibrary for ``source``, or KernelCompileError with Metal's log naming ``what``."""
    library, error = mtl_device.newLibraryWithSource_options_error_(
        source, compile_options(api), None)
    if library is None:
        raise KernelCompileError(f"Metal could not compile kernel file {what}.metal:\n"
                                 f"{_description(error)}")
    return library
