"""Compile MSL sources into CPU shared libraries and run their kernels (design §6).

A source goes through three steps:

1. ``expand``: clang's preprocessor expands the source's own macros (instantiation lists are
   usually macros). ``<metal_*>`` includes are dropped for this pass and linemarkers are kept,
   so diagnostics later point at the lines of the original source ("program_source", as Metal
   names it).
2. ``scan`` (msl_scan.py): the kernels, their bindings and static threadgroup memory, and
   whether each synchronises (then its threads run as fibers; otherwise as a plain loop).
3. ``translation_unit``: the text is rewritten in the few places C++ rejects MSL syntax (see
   include/metal_stdlib), wrapped in ``namespace msl`` and followed by one trampoline per kernel
   that turns a dispatch into calls of the kernel; clang++ builds it into a shared library,
   cached on disk by content hash, loaded with ctypes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from .msl_scan import (  # noqa: F401 -- MSLCompileError, Kernel, ... are harness's API too
    _HOST_NAME,
    MAX_BINDINGS,
    POSITIONS,
    SOURCE_NAME,
    Kernel,
    MSLCompileError,
    Param,
    _split_params,
    _tg_declarations,
    scan,
)

INCLUDE = Path(__file__).parent / "include"
# every load and store of kernel code calls the emulator's access hooks (emulator_checks.h)
CHECK_FLAGS = ["-fsanitize-coverage=func,trace-loads,trace-stores"]
FAST_MATH_FLAGS = ["-ffinite-math-only", "-fno-signed-zeros", "-freciprocal-math",
                   "-fassociative-math", "-fno-trapping-math", "-ffp-contract=fast"]


# ---- step 1: expand ------------------------------------------------------------------------

# clang 17 or later: the shim needs address spaces with _Float16 and __bf16 as arithmetic types
COMPILERS = ("clang++-19", "clang++-18", "clang++-17", "clang++")


def compiler() -> str:
    """``NEEDLE_METAL_EMULATOR_CXX``, else the newest versioned clang++ on PATH, else clang++
    (the shim stops with a message naming clang-19 if that is older than clang 17)."""
    env = os.environ.get("NEEDLE_METAL_EMULATOR_CXX")
    if env:
        return env
    return next((c for c in COMPILERS if shutil.which(c)), COMPILERS[-1])


# how clang prints the shim's address spaces (include/metal_stdlib), and their MSL names
ADDRESS_SPACES = {"1": "device", "2": "constant", "3": "threadgroup"}


def compile_error(log: str) -> MSLCompileError:
    """The compiler's log with address spaces called by their MSL names."""
    log = re.sub(r"__attribute__\(\(address_space\(([123])\)\)\)",
                 lambda m: ADDRESS_SPACES[m.group(1)], log)
    log = re.sub(r"address space '([123])'",
                 lambda m: f"address space '{ADDRESS_SPACES[m.group(1)]}'", log)
    return MSLCompileError(log)


def version_macros(msl: int) -> list[str]:
    """What an MSL version predefines: ``__METAL_VERSION__``, and bfloat from 3.1."""
    return [f"-D__METAL_VERSION__={msl}"] + (["-D__HAVE_BFLOAT__=1"] if msl >= 310 else [])


def expand(source: str, msl: int = 310) -> str:
    """The source with its own macros expanded and comments removed (linemarkers kept)."""
    lines = ["" if re.match(r"\s*#\s*include\s*<metal_\w+>", ln) else ln
             for ln in source.split("\n")]
    with tempfile.TemporaryDirectory(prefix="needle-msl-") as tmp:
        path = Path(tmp) / SOURCE_NAME
        path.write_text("\n".join(lines))
        proc = subprocess.run(
            [compiler(), "-E", "-x", "c++", "-std=c++14", "-nostdinc", "-nostdinc++",
             *version_macros(msl), SOURCE_NAME],
            cwd=tmp, capture_output=True, text=True)
    if proc.returncode:
        raise compile_error(proc.stderr)
    return proc.stdout


# ---- step 3: the translation unit ------------------------------------------------------------

def rewrite(expanded: str) -> str:
    """MSL spellings C++ rejects, replaced (see include/metal_stdlib)."""
    text = _HOST_NAME.sub("template", expanded)
    text = re.sub(r"\[\[\s*kernel\s*\]\]", "", text)
    text = re.sub(r"\[\[\s*threadgroup\s*\(", "[[threadgroup_index(", text)
    return _threadgroup_variables(text)


def _threadgroup_variables(text: str) -> str:
    """``threadgroup T a[N], b[M];`` in a function body, as references into the threadgroup
    arena of the emulator (emu::tg_static): shared by the threads of a threadgroup, bounds- and
    race-checked like dynamic threadgroup memory. Pointers and references into threadgroup memory
    are ordinary locals and keep the address-space qualifier; so do these references."""
    out, pos, site = [], 0, 0
    current, pieces = None, []

    def flush():
        end = text.index(";", current.end())
        out.append(text[pos:current.start()] + current.group(1) + "; ".join(pieces))
        return end

    for m, type_, name, dims in _tg_declarations(text):
        if current is not None and m.start() != current.start():
            pos = flush()
            pieces = []
        current = m
        full = f"{type_} {dims}" if dims else type_
        pieces.append(f"threadgroup {type_} (&{name}){dims} = *(threadgroup {type_} (*){dims})("
                      f"::emu::tg_static({site}, sizeof({full}), alignof({type_}), "
                      f"\"{name}\"))")
        site += 1
    if current is not None:
        pos = flush()
    out.append(text[pos:])
    return "".join(out)


def translation_unit(expanded: str, kernels: list[Kernel]) -> str:
    parts = ["#include <metal_stdlib>", "namespace msl {", rewrite(expanded),
             '# 1 "<emulator trampolines>"']
    for i, k in enumerate(kernels):
        names = {"buffer": ["nullptr"] * MAX_BINDINGS, "threadgroup": ["nullptr"] * MAX_BINDINGS}
        for p in k.params:
            if p.kind in names:
                names[p.kind][p.index] = f'"{p.name}"'
        args = []
        for p in k.params:
            if p.kind == "position":
                args.append(f"emu::pos({POSITIONS[p.position]})")
            elif p.kind == "threadgroup":
                args.append(f"emu::PtrArg{{tg[{p.index}]}}")
            else:
                cls = "RefArg" if p.by_ref else "PtrArg"
                args.append(f"emu::{cls}{{d->buffers[{p.index}]}}")
        parts.append(
            f"static const emu::Names needle_emu_names_{i} = {{{{{', '.join(names['buffer'])}}}, "
            f"{{{', '.join(names['threadgroup'])}}}}};")
        parts.append(
            f"static void needle_emu_body_{i}(const emu::Dispatch* d, void* const* tg, "
            f"const emu::ThreadIds& t) {{\n  (void)d; (void)tg; (void)t;\n"
            f"  [[clang::always_inline]] {k.call}({', '.join(args)});\n}}\n"
            f'extern "C" int needle_emu_kernel_{i}(emu::Dispatch* d) {{\n'
            f"  return emu::dispatch(d, needle_emu_body_{i}, {str(k.synchronises).lower()}, "
            f'"{k.name}", &needle_emu_names_{i});\n}}')
        args = k.call[k.call.index("<"):] if k.tparams else ""
        parts.append(
            (f"template <{k.tparams}> struct needle_emu_static_{i} {{ static constexpr "
             f"unsigned long bytes = {k.static_bytes}; }};\n" if k.tparams else "")
            + f'extern "C" unsigned long needle_emu_static_bytes_{i}() {{ return '
            + (f"needle_emu_static_{i}{args}::bytes" if k.tparams else k.static_bytes)
            + "; }")
    parts.append("}  // namespace msl")
    return "\n".join(parts) + "\n"


def base_flags() -> list[str]:
    return [compiler(), "-std=c++14", "-x", "c++", "-I", str(INCLUDE)]


def check(source: str, flags: list[str] | None = None, msl: int = 310) -> None:
    """Compile ``source`` as C++ against the shim without building anything (design §6, 1),
    as MSL version ``msl`` (300 or 310)."""
    expanded = expand(source, msl)
    kernels = scan(expanded)
    with tempfile.TemporaryDirectory(prefix="needle-msl-") as tmp:
        path = Path(tmp) / "tu.cpp"
        path.write_text(translation_unit(expanded, kernels))
        proc = subprocess.run(base_flags() + [f"-DNEEDLE_EMU_MSL={msl}", "-fsyntax-only"]
                              + (flags or []) + [str(path)],
                              capture_output=True, text=True)
    if proc.returncode:
        raise compile_error(proc.stderr)


# ---- the pipeline's thread limit, derived from the kernel ---------------------------------------

# Apple's compiler lowers a pipeline's maxTotalThreadsPerThreadgroup when its kernel needs many
# registers: a threadgroup's threads share one GPU core's register file. The model (docs/metal.md,
# "Pipeline thread limits"): a thread needs the bytes of the kernel's stack frame on x86-64 at -O2
# without the access hooks (what did not fit the 16 general and 16 vector registers, arrays
# included; the kernel and every `inline` helper are inlined into it, as a GPU compiler does)
# plus those registers themselves, counted as REGISTER_BASE bytes. The register file of an
# Apple7 core (M1) is 384 KiB; the limit is what fits it, a multiple of the execution width
# (32), at least 32, at most the device's 1024 and the kernel's
# [[max_total_threads_per_threadgroup(N)]].
REGISTER_FILE = 384 * 1024
REGISTER_BASE = 128
SIMD_WIDTH = 32
DEVICE_MAX_THREADS = 1024


def derived_thread_limit(frame_bytes: int, attribute: int = 0) -> int:
    """maxTotalThreadsPerThreadgroup for a kernel whose stack frame is ``frame_bytes``."""
    fits = REGISTER_FILE // (frame_bytes + REGISTER_BASE) // SIMD_WIDTH * SIMD_WIDTH
    limit = min(max(fits, SIMD_WIDTH), DEVICE_MAX_THREADS)
    return min(limit, attribute) if attribute else limit


_BODY_FRAME = re.compile(r"needle_emu_body_(\d+)E\S*\t(\d+)\t")


def frame_sizes(stack_usage: str) -> dict[int, int]:
    """Kernel index -> stack frame bytes of its trampoline body (the kernel inlined into it), from
    clang's -fstack-usage output."""
    return {int(m.group(1)): int(m.group(2)) for m in _BODY_FRAME.finditer(stack_usage)}


# ---- building and running ------------------------------------------------------------------

class _Dispatch(ctypes.Structure):
    _fields_ = [("buffers", ctypes.c_void_p * MAX_BINDINGS),
                ("lengths", ctypes.c_uint64 * MAX_BINDINGS),
                ("extent_lo", ctypes.c_uint64 * MAX_BINDINGS),
                ("extent_hi", ctypes.c_uint64 * MAX_BINDINGS),
                ("tg_lengths", ctypes.c_uint64 * MAX_BINDINGS),
                ("groups", ctypes.c_uint32 * 3),
                ("threads", ctypes.c_uint32 * 3),
                ("simd_width", ctypes.c_uint32),
                ("workers", ctypes.c_uint32),
                ("checks", ctypes.c_uint32),
                ("error", ctypes.c_char * 1024)]


def cache_dir() -> Path:
    env = os.environ.get("NEEDLE_METAL_EMULATOR_CACHE")
    default = Path(tempfile.gettempdir()) / f"needle-metal-emulator-{os.getuid()}"
    path = Path(env) if env else default
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_workers() -> int:
    env = os.environ.get("NEEDLE_METAL_EMULATOR_THREADS")
    if env:
        return max(1, int(env))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the test workers already use every core
        return 1
    return max(1, min(2, os.cpu_count() or 1))


CHECK_BOUNDS = 1
CHECK_RACES = 2
_CHECK_NAMES = {"bounds": CHECK_BOUNDS, "races": CHECK_RACES}


def default_checks() -> int:
    """The memory checks dispatches run with: ``NEEDLE_METAL_EMULATOR_CHECKS`` is a comma list
    of ``bounds`` and ``races`` (default both), or ``none``."""
    env = os.environ.get("NEEDLE_METAL_EMULATOR_CHECKS", "bounds,races").strip().lower()
    mask = 0
    for word in filter(None, (w.strip() for w in env.split(","))):
        if word == "none":
            continue
        if word not in _CHECK_NAMES:
            raise ValueError(f"NEEDLE_METAL_EMULATOR_CHECKS: unknown check {word!r}; use "
                             "'bounds', 'races', both comma-separated, or 'none'")
        mask |= _CHECK_NAMES[word]
    return mask


class Library:
    """A compiled MSL source: its kernels, runnable on host memory."""

    def __init__(self, path: Path, kernels: list[Kernel]):
        self._dll = ctypes.CDLL(str(path))
        self.kernels = {k.name: k for k in kernels}
        self._entry = {}
        self.static_bytes: dict[str, int] = {}  # per kernel, as Metal's pipelines report it
        # per kernel: maxTotalThreadsPerThreadgroup derived from its registers and attribute
        self.max_threads = {k.name: derived_thread_limit(k.frame_bytes, k.max_threads_attr)
                            for k in kernels}
        for i, k in enumerate(kernels):
            fn = getattr(self._dll, f"needle_emu_kernel_{i}")
            fn.argtypes = [ctypes.POINTER(_Dispatch)]
            fn.restype = ctypes.c_int
            self._entry[k.name] = fn
            size = getattr(self._dll, f"needle_emu_static_bytes_{i}")
            size.restype = ctypes.c_ulong
            self.static_bytes[k.name] = (int(size()) + 15) // 16 * 16
        self._lock = threading.Lock()

    def run(self, name: str, buffers: dict[int, int], tg_lengths: dict[int, int],
            groups: tuple[int, int, int], threads: tuple[int, int, int],
            simd_width: int = 32, workers: int | None = None,
            bounds: dict[int, tuple[int, int, int]] | None = None,
            checks: int | None = None) -> str | None:
        """Run one dispatch; the error message, or None when it succeeded.

        ``bounds[i]`` is (bytes the kernel may use from ``buffers[i]``, start, end of the
        allocation around it): what the bounds check knows of buffer ``i`` (unchecked without).
        ``checks`` is a mask of CHECK_BOUNDS and CHECK_RACES (default: ``default_checks()``).
        """
        kernel = self.kernels[name]
        missing = [i for i in kernel.buffers if not buffers.get(i)]
        if missing:
            return f"kernel {name}: buffer index {missing[0]} is used but nothing is bound to it"
        missing = [i for i in kernel.threadgroup_blocks if not tg_lengths.get(i)]
        if missing:
            return (f"kernel {name}: threadgroup memory index {missing[0]} is used but no length "
                    "was set for it")
        d = _Dispatch()
        for i, ptr in buffers.items():
            d.buffers[i] = ptr
        for i, (length, lo, hi) in (bounds or {}).items():
            d.lengths[i], d.extent_lo[i], d.extent_hi[i] = length, lo, hi
        d.checks = default_checks() if checks is None else checks
        for i, n in tg_lengths.items():
            d.tg_lengths[i] = n
        d.groups[:] = groups
        d.threads[:] = threads
        d.simd_width = simd_width
        d.workers = workers or default_workers()
        with self._lock:
            failed = self._entry[name](ctypes.byref(d))
        return d.error.decode(errors="replace") if failed else None


def build(source: str, fast_math: bool = False, msl: int = 310) -> Library:
    """Compile ``source`` as MSL version ``msl`` into a library (cached on disk by content),
    or MSLCompileError."""
    # without checks, kernels are built without the access hooks (as fast as before them)
    code = ["-O2", "-fPIC", "-pthread", "-w", f"-DNEEDLE_EMU_MSL={msl}"] + \
        (FAST_MATH_FLAGS if fast_math else [])
    if os.environ.get("NEEDLE_METAL_EMULATOR_UCONTEXT") == "1":
        code.append("-DNEEDLE_EMU_UCONTEXT")
    hooks = CHECK_FLAGS if default_checks() else []
    flags = code + ["-shared"] + hooks
    digest = hashlib.sha256()
    for part in (compiler(), " ".join(flags), source, Path(__file__).read_text(),
                 (Path(__file__).parent / "msl_scan.py").read_text(),
                 *(p.read_text() for p in sorted(INCLUDE.iterdir()))):
        digest.update(part.encode())
        digest.update(b"\0")
    key = digest.hexdigest()[:32]
    root = cache_dir()
    lib, meta = root / f"{key}.so", root / f"{key}.json"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test processes build a source once
        if not (lib.exists() and meta.exists()):
            expanded = expand(source, msl)
            kernels = scan(expanded)
            stem = root / f"{key}.{os.getpid()}"
            tu = stem.with_suffix(".cpp")
            tu.write_text(translation_unit(expanded, kernels))
            # thread limits come from the code without the hooks' calls: with hooks, a second
            # compile (at the same time) measures the kernels' stack frames
            jobs = [(flags + ([] if hooks else ["-fstack-usage"]), stem.with_suffix(".so"))]
            if hooks:
                jobs.append((code + ["-c", "-fstack-usage"], stem.with_suffix(".o")))
            try:
                _compile(jobs, tu)
                stem.with_suffix(".o").unlink(missing_ok=True)
                frames = frame_sizes(stem.with_suffix(".su").read_text())
            finally:
                tu.unlink()
                stem.with_suffix(".su").unlink(missing_ok=True)
            missing = [k.name for i, k in enumerate(kernels) if i not in frames]
            if missing:
                raise MSLCompileError(f"{compiler()} reported no stack frame for kernels "
                                      f"{missing} (-fstack-usage); the thread limits need it")
            kernels = [dataclasses.replace(k, frame_bytes=frames[i])
                       for i, k in enumerate(kernels)]
            meta.write_text(json.dumps([_to_json(k) for k in kernels]))
            os.replace(stem.with_suffix(".so"), lib)
    return Library(lib, [_from_json(k) for k in json.loads(meta.read_text())])


def _compile(jobs: list[tuple[list[str], Path]], tu: Path) -> None:
    """Compile ``tu`` once per (flags, output) job, the jobs running at the same time."""
    procs = [subprocess.Popen(base_flags() + flags + [str(tu), "-o", str(out)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for flags, out in jobs]
    logs = [(p.communicate()[1], p.returncode) for p in procs]
    for log, returncode in logs:
        if returncode:
            raise compile_error(log)


def _to_json(k: Kernel) -> dict:
    return {"name": k.name, "call": k.call, "synchronises": k.synchronises,
            "params": [[p.kind, p.index, p.by_ref, p.position, p.name] for p in k.params],
            "static_bytes": k.static_bytes, "tparams": k.tparams,
            "max_threads_attr": k.max_threads_attr, "frame_bytes": k.frame_bytes}


def _from_json(d: dict) -> Kernel:
    return Kernel(d["name"], d["call"], tuple(Param(*p) for p in d["params"]),
                  d["synchronises"], d["static_bytes"], d["tparams"], d["max_threads_attr"],
                  d["frame_bytes"])
