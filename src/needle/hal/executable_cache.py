"""ExecutableCache: compile each kernel file once per process, lazily; cache binaries on disk.

Kernel sources live next to the backend (``backends/<name>/kernels/<family>.<ext>``). The
first kernel asked of a family compiles that whole file; later requests reuse it. A
compiler that is slow to run (NVRTC) also keeps its output on disk, keyed by a hash of
everything that determines it, so a second process starts in milliseconds.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
from pathlib import Path

from ..errors import KernelCompileError
from . import trace
from .executable import Executable, Kernel


class ExecutableCache:
    """Kernel files of one device, compiled on first use. Backends implement ``_compile``."""

    def __init__(self, source_dir: Path, suffix: str, device_name: str):
        self.source_dir = Path(source_dir)
        self.suffix = suffix
        self.device_name = device_name
        self._executables: dict[str, Executable] = {}
        self._kernels: dict[tuple[str, str], Kernel] = {}
        self._lock = threading.Lock()

    def families(self) -> list[str]:
        """Names of the kernel files this backend ships (elementwise, layout, ...)."""
        return sorted(p.stem for p in self.source_dir.glob(f"*{self.suffix}"))

    def source(self, family: str) -> str:
        path = self.source_dir / f"{family}{self.suffix}"
        if not path.is_file():
            raise KernelCompileError(f"no kernel file {path.name} in {self.source_dir}")
        return path.read_text()

    def unit_of(self, family: str, name: str) -> str:
        """What one compile produces for kernel ``name``: the whole family here; a backend
        may compile a family in parts (CUDA: one dtype at a time, ``"family:shard"``)."""
        return family

    def get(self, unit: str) -> Executable:
        """The compiled executable of ``unit`` (a family, or ``family:part``), compiling it
        on first use."""
        exe = self._executables.get(unit)
        if exe is None:
            with self._lock:
                exe = self._executables.get(unit)
                if exe is None:
                    start = time.perf_counter()
                    exe = self._compile(unit, self.source(unit.partition(":")[0]))
                    if trace.enabled:
                        trace.emit("compile", f"{unit}{self.suffix} for {self.device_name}",
                                   time.perf_counter() - start)
                    self._executables[unit] = exe
        return exe

    def kernel(self, family: str, name: str) -> Kernel:
        """Entry point ``name`` of kernel file ``family`` (both cached)."""
        k = self._kernels.get((family, name))
        if k is None:
            k = self._kernels[(family, name)] = self.get(self.unit_of(family, name)).kernel(name)
        return k

    def _compile(self, unit: str, source: str) -> Executable:
        """Compile ``unit`` from its family's ``source``."""
        raise NotImplementedError


class DiskCache:
    """Compiled binaries under ``$NEEDLE_CACHE_DIR/<backend>`` (default ``~/.cache/needle``).

    Writes are atomic (write a temporary file, then rename), so processes sharing the
    directory never read half a binary. An unwritable directory only costs recompiles.
    """

    def __init__(self, backend: str):
        root = os.environ.get("NEEDLE_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "needle")
        self.directory = Path(root) / backend

    @staticmethod
    def key(*parts: str | bytes) -> str:
        h = hashlib.sha256()
        for part in parts:
            data = part.encode() if isinstance(part, str) else part
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()

    def path(self, key: str, suffix: str) -> Path:
        return self.directory / f"{key}{suffix}"

    def load(self, key: str, suffix: str) -> bytes | None:
        try:
            return self.path(key, suffix).read_bytes()
        except OSError:
            return None

    def store(self, key: str, suffix: str, data: bytes) -> None:
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path(key, suffix))
        except OSError:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
