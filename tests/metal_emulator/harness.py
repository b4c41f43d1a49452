"""Compile MSL sources into CPU shared libraries and run their kernels (design §6).

A source goes through three steps:

1. ``expand``: clang's preprocessor expands the source's own macros (instantiation lists are
   usually macros). ``<metal_*>`` includes are dropped for this pass and linemarkers are kept,
   so diagnostics later point at the lines of the original source ("program_source", as Metal
   names it).
2. ``scan``: the expanded text is split into top-level declarations to find the kernels (plain
   ``kernel void f(...)`` and ``template [[host_name("x")]] ... f<...>`` instantiations), each
   parameter's binding (``[[buffer(i)]]``, ``[[threadgroup(i)]]``, a position attribute), and
   whether the kernel can reach a barrier or simd-group function (then its threads run as
   fibers; otherwise as a plain loop).
3. ``translation_unit``: the text is rewritten in the few places C++ rejects MSL syntax (see
   include/metal_stdlib), wrapped in ``namespace msl`` and followed by one trampoline per kernel
   that turns a dispatch into calls of the kernel; clang++ builds it into a shared library,
   cached on disk by content hash, loaded with ctypes.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import re
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

INCLUDE = Path(__file__).parent / "include"
SOURCE_NAME = "program_source"
MAX_BINDINGS = 31

POSITIONS = {
    "thread_position_in_grid": "t.grid",
    "thread_position_in_threadgroup": "t.local",
    "threadgroup_position_in_grid": "t.group",
    "threads_per_threadgroup": "t.tpg",
    "threadgroups_per_grid": "t.groups",
    "threads_per_grid": "t.grid_size",
    "thread_index_in_threadgroup": "t.index",
    "thread_index_in_simdgroup": "t.lane",
    "simdgroup_index_in_threadgroup": "t.simdgroup",
    "threads_per_simdgroup": "t.simd_width",
    "thread_execution_width": "t.simd_width",
    "simdgroups_per_threadgroup": "t.simdgroups",
}
_SYNC = re.compile(r"\b(threadgroup_barrier|simdgroup_barrier|simd_\w+|quad_\w+)\s*\(")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_HOST_NAME = re.compile(r'template\s*\[\[\s*host_name\s*\(\s*((?:"[^"]*"\s*)+)\)\s*\]\]')
# every load and store of kernel code calls the emulator's access hooks (emulator_checks.h)
CHECK_FLAGS = ["-fsanitize-coverage=func,trace-loads,trace-stores"]
FAST_MATH_FLAGS = ["-ffinite-math-only", "-fno-signed-zeros", "-freciprocal-math",
                   "-fassociative-math", "-fno-trapping-math", "-ffp-contract=fast"]


class MSLCompileError(Exception):
    """The source did not compile; ``log`` holds the compiler's (or the scanner's) messages."""

    def __init__(self, log: str):
        super().__init__(log)
        self.log = log


@dataclass(frozen=True)
class Param:
    kind: str  # "buffer", "threadgroup" or "position"
    index: int  # binding index (-1 for positions)
    by_ref: bool  # a buffer bound to a reference parameter
    position: str = ""  # the position attribute
    name: str = ""  # the parameter's name (error messages)


@dataclass(frozen=True)
class Kernel:
    name: str  # the host name Metal looks it up by
    call: str  # the C++ function to call, e.g. "binary<float, Add>"
    params: tuple[Param, ...]
    synchronises: bool
    # static threadgroup memory: a C++ constant expression, inside `template <tparams>` for
    # template kernels (the kernel's own `threadgroup` variables; MSL allows them nowhere else)
    static_bytes: str = "0"
    tparams: str = ""

    @property
    def buffers(self) -> list[int]:
        return [p.index for p in self.params if p.kind == "buffer"]

    @property
    def threadgroup_blocks(self) -> list[int]:
        return [p.index for p in self.params if p.kind == "threadgroup"]


# ---- step 1: expand ------------------------------------------------------------------------

def compiler() -> str:
    return os.environ.get("NEEDLE_METAL_EMULATOR_CXX", "clang++")


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
        raise MSLCompileError(proc.stderr)
    return proc.stdout


# ---- step 2: scan --------------------------------------------------------------------------

def _blank_markers(text: str) -> str:
    """Linemarkers replaced by spaces of the same length, so offsets stay valid."""
    return re.sub(r"(?m)^#[^\n]*", lambda m: " " * len(m.group(0)), text)


def _match(text: str, start: int, open_: str, close: str) -> int:
    """Index just past the bracket matching text[start] (== open_)."""
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c in "\"'":
            i = _skip_literal(text, i)
            continue
        if c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise MSLCompileError(f"{SOURCE_NAME}: unbalanced '{open_}' at offset {start}")


def _skip_literal(text: str, i: int) -> int:
    quote = text[i]
    i += 1
    while i < len(text) and text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _top_level(text: str):
    """Yield (header, body) for each top-level declaration; body is None without braces."""
    start = i = 0
    while i < len(text):
        c = text[i]
        if c in "\"'":
            i = _skip_literal(text, i)
        elif c in "([":
            i = _match(text, i, c, ")" if c == "(" else "]")
        elif c == ";":
            header = text[start:i].strip()
            if header:
                yield header, None
            start = i = i + 1
        elif c == "{":
            end = _match(text, i, "{", "}")
            header = text[start:i].strip()
            if header.endswith("="):
                i = end  # an initializer: the declaration goes on to its ';'
                continue
            yield header, text[i + 1:end - 1]
            start = i = end
        else:
            i += 1


def _angle_end(text: str, lt: int) -> int:
    """Index just past the '>' closing the template argument list opened at text[lt]."""
    depth = 0
    for i in range(lt, len(text)):
        if text[i] in "<([":
            depth += 1
        elif text[i] in ">)]":
            depth -= 1
            if depth == 0:
                return i + 1
    raise MSLCompileError(f"{SOURCE_NAME}: unbalanced '<' in {text.strip()[:80]!r}")


def _instantiated(statement: str) -> tuple[str, str] | None:
    """(template name, argument text) of an explicit instantiation's declarator."""
    stmt = re.sub(r"\[\[.*?\]\]", " ", statement, flags=re.S)
    while (m := re.search(r"\bdecltype\s*\(", stmt)) is not None:
        stmt = stmt[:m.start()] + stmt[_match(stmt, m.end() - 1, "(", ")"):]
    m = re.search(r"([A-Za-z_]\w*)\s*<", stmt)
    if m is None:
        return None
    return m.group(1), stmt[m.end():_angle_end(stmt, m.end() - 1) - 1].strip()


def _split_params(params: str) -> list[str]:
    out, depth, cur = [], 0, []
    for c in params:
        if c in "([<":
            depth += 1
        elif c in ")]>":
            depth -= 1
        if c == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _parse_param(text: str, kernel: str) -> Param:
    attrs = re.findall(r"\[\[\s*(\w+)\s*(?:\(\s*(\d+)\s*\))?\s*\]\]", text)
    declarator = re.sub(r"\[\[.*?\]\]", "", text)
    if len(attrs) != 1:
        raise MSLCompileError(f"{SOURCE_NAME}: kernel {kernel}: parameter '{text}' needs exactly "
                              "one attribute ([[buffer(i)]], [[threadgroup(i)]] or a position)")
    name, index = attrs[0]
    idents = re.findall(r"[A-Za-z_]\w*", declarator)
    pname = idents[-1] if idents else ""
    if name in ("buffer", "threadgroup"):
        idx = int(index)
        if not 0 <= idx < MAX_BINDINGS:
            raise MSLCompileError(f"{SOURCE_NAME}: kernel {kernel}: index {idx} out of range")
        by_ref = "&" in declarator
        if not by_ref and "*" not in declarator:
            raise MSLCompileError(f"{SOURCE_NAME}: kernel {kernel}: buffer parameter '{text}' "
                                  "must be a pointer or a reference")
        return Param(name, idx, by_ref and name == "buffer", "", pname)
    if name in POSITIONS:
        return Param("position", -1, False, name, pname)
    raise MSLCompileError(f"{SOURCE_NAME}: kernel {kernel}: attribute [[{name}]] is not "
                          "supported by the emulator")


def _signature(header: str) -> tuple[str, str] | None:
    """(function name, parameter text) of a function header, or None."""
    plain = re.sub(r"\[\[.*?\]\]", lambda m: " " * len(m.group(0)), header, flags=re.S)
    if plain.lstrip().startswith("template"):
        gt = _angle_end(plain, plain.index("<"))
        plain = " " * gt + plain[gt:]
    m = re.search(r"([A-Za-z_]\w*)\s*\(", plain)
    if m is None or m.group(1) in ("decltype", "operator"):
        return None
    open_ = m.end() - 1
    close = _match(header, open_, "(", ")")
    return m.group(1), header[open_ + 1:close - 1]


def scan(expanded: str) -> list[Kernel]:
    """The kernels of an expanded source, with their bindings and synchronisation needs."""
    text = _blank_markers(expanded)
    definitions: dict[str, list[str]] = {}
    templates: dict[str, tuple[str, str]] = {}  # name -> (params, body) of kernel templates
    kernels: list[Kernel] = []
    instantiations: list[tuple[str, str]] = []  # (host name, statement)
    for header, body in _top_level(text):
        if body is None:
            m = _HOST_NAME.match(header)
            if m:  # adjacent string literals, as macros often build names, concatenate
                name = "".join(re.findall(r'"([^"]*)"', m.group(1)))
                instantiations.append((name, header[m.end():]))
            continue
        is_kernel = re.search(r"\bkernel\b|\[\[\s*kernel\s*\]\]", header) is not None
        if re.match(r"(template\s*<.*?>\s*)?(struct|class|union|enum)\b", header, re.S):
            name = re.search(r"\b(?:struct|class|union|enum)\s+(?:class\s+)?(\w+)", header)
            if name:
                definitions.setdefault(name.group(1), []).append(header + body)
            continue
        sig = _signature(header)
        if sig is None:
            continue
        name, params = sig
        definitions.setdefault(name, []).append(body)
        if is_kernel and header.lstrip().startswith("template"):
            lt = header.index("<")
            tparams = header[lt + 1:_angle_end(header, lt) - 1]
            templates[name] = (params, body, tparams)
        elif is_kernel:
            kernels.append(_kernel(name, name, params, body + params, definitions, body))
    for host_name, statement in instantiations:
        target = _instantiated(statement)
        if target is None or target[0] not in templates:
            raise MSLCompileError(f"{SOURCE_NAME}: cannot tell which kernel template "
                                  f"host_name(\"{host_name}\") instantiates")
        name, args = target
        params, body, tparams = templates[name]
        kernels.append(_kernel(host_name, f"{name}<{args}>", params, body + args, definitions,
                               body, tparams))
    names = [k.name for k in kernels]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise MSLCompileError(f"{SOURCE_NAME}: kernel names defined twice: {sorted(dupes)}")
    return kernels


def _kernel(name: str, call: str, params: str, reach: str, definitions, body: str,
            tparams: str = "") -> Kernel:
    parsed = tuple(_parse_param(p, name) for p in _split_params(params))
    sizes = [f"sizeof({type_} {dims})" for _, type_, _, dims in _tg_declarations("{" + body)]
    return Kernel(name, call, parsed, _reaches_sync(reach, definitions),
                  " + ".join(["0"] + sizes), tparams)


def _reaches_sync(text: str, definitions: dict[str, list[str]]) -> bool:
    """Whether ``text`` or any function or type it names (transitively) synchronises."""
    seen: set[str] = set()
    todo = [text]
    while todo:
        chunk = todo.pop()
        if _SYNC.search(chunk):
            return True
        for ident in set(_IDENT.findall(chunk)) - seen:
            seen.add(ident)
            todo.extend(definitions.get(ident, ()))
    return False


# ---- step 3: the translation unit ------------------------------------------------------------

def rewrite(expanded: str) -> str:
    """MSL spellings C++ rejects, replaced (see include/metal_stdlib)."""
    text = _HOST_NAME.sub("template", expanded)
    text = re.sub(r"\[\[\s*kernel\s*\]\]", "", text)
    text = re.sub(r"\[\[\s*threadgroup\s*\(", "[[threadgroup_index(", text)
    return _threadgroup_variables(text)


_TG_STATEMENT = re.compile(r"([;{}](?:\s|\n#[^\n]*)*)threadgroup\b")


def _tg_declarations(text: str):
    """(match, type, name, array dimensions) of each ``threadgroup`` variable declared at
    statement level in ``text`` (pointers and references into threadgroup memory excluded)."""
    for m in _TG_STATEMENT.finditer(text):
        end = text.index(";", m.end())
        declaration = text[m.end():end]
        head = declaration.split("[", 1)[0]  # array sizes may multiply
        if "*" in head or "&" in head or "=" in declaration:
            continue
        declarators = _split_params(declaration)
        first = re.match(r"(.*?)([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)$", declarators[0], re.S)
        if first is None:
            raise MSLCompileError(f"{SOURCE_NAME}: cannot read threadgroup declaration "
                                  f"'{declaration.strip()}'")
        type_ = first.group(1).strip()
        for d in declarators:
            dm = re.match(r"\s*(?:.*?\s)?([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)$", d, re.S)
            yield m, type_, dm.group(1), dm.group(2).strip()


def _threadgroup_variables(text: str) -> str:
    """``threadgroup T a[N], b[M];`` in a function body, as references into the threadgroup
    arena of the emulator (emu::tg_static): shared by the threads of a threadgroup, bounds- and
    race-checked like dynamic threadgroup memory. Pointers and references into threadgroup memory
    are ordinary locals and keep the address-space qualifier."""
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
        pieces.append(f"{type_} (&{name}){dims} = *reinterpret_cast<{type_} (*){dims}>("
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
            f"  {k.call}({', '.join(args)});\n}}\n"
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
        raise MSLCompileError(proc.stderr)


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
    flags = ["-O2", "-fPIC", "-shared", "-pthread", "-w", f"-DNEEDLE_EMU_MSL={msl}"] + \
        (CHECK_FLAGS if default_checks() else []) + (FAST_MATH_FLAGS if fast_math else [])
    if os.environ.get("NEEDLE_METAL_EMULATOR_UCONTEXT") == "1":
        flags.append("-DNEEDLE_EMU_UCONTEXT")
    digest = hashlib.sha256()
    for part in (compiler(), " ".join(flags), source, Path(__file__).read_text(),
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
            tu = root / f"{key}.{os.getpid()}.cpp"
            tu.write_text(translation_unit(expanded, kernels))
            tmp_lib = root / f"{key}.{os.getpid()}.so"
            proc = subprocess.run(base_flags() + flags + [str(tu), "-o", str(tmp_lib)],
                                  capture_output=True, text=True)
            tu.unlink()
            if proc.returncode:
                raise MSLCompileError(proc.stderr)
            meta.write_text(json.dumps([_to_json(k) for k in kernels]))
            os.replace(tmp_lib, lib)
    return Library(lib, [_from_json(k) for k in json.loads(meta.read_text())])


def _to_json(k: Kernel) -> dict:
    return {"name": k.name, "call": k.call, "synchronises": k.synchronises,
            "params": [[p.kind, p.index, p.by_ref, p.position, p.name] for p in k.params],
            "static_bytes": k.static_bytes, "tparams": k.tparams}


def _from_json(d: dict) -> Kernel:
    return Kernel(d["name"], d["call"], tuple(Param(*p) for p in d["params"]),
                  d["synchronises"], d["static_bytes"], d["tparams"])
