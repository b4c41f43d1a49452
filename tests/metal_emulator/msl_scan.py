"""Step 2 of the harness (harness.py): scan an expanded MSL source for its kernels.

The expanded text is split into top-level declarations to find the kernels (plain
``kernel void f(...)`` and ``template [[host_name("x")]] ... f<...>`` instantiations), each
parameter's binding and name (``[[buffer(i)]]``, ``[[threadgroup(i)]]``, a position attribute),
the kernel's own ``threadgroup`` variables (its static threadgroup memory), and whether it can
reach a barrier or simd-group function (then its threads run as fibers; otherwise as a loop).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
_SYNC = re.compile(r"\b(threadgroup_barrier|simdgroup_barrier|simdgroup_multiply\w*|simd_\w+|"
                   r"quad_\w+)\s*\(")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_HOST_NAME = re.compile(r'template\s*\[\[\s*host_name\s*\(\s*((?:"[^"]*"\s*)+)\)\s*\]\]')

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
    # [[max_total_threads_per_threadgroup(N)]] on the kernel (0: none)
    max_threads_attr: int = 0
    # stack frame of the compiled kernel (harness.build; the thread limit is derived from it)
    frame_bytes: int = 0

    @property
    def buffers(self) -> list[int]:
        return [p.index for p in self.params if p.kind == "buffer"]

    @property
    def threadgroup_blocks(self) -> list[int]:
        return [p.index for p in self.params if p.kind == "threadgroup"]


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


# the address spaces a kernel argument bound by each attribute may be declared in
_PARAM_SPACES = {"buffer": ("device", "constant"), "threadgroup": ("threadgroup",)}


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
        spaces = _PARAM_SPACES[name]
        if not any(re.search(rf"\b{space}\b", declarator) for space in spaces):
            raise MSLCompileError(f"{SOURCE_NAME}: kernel {kernel}: parameter '{text}' must be "
                                  f"declared in the {' or '.join(spaces)} address space (MSL "
                                  "requires an address space on kernel pointer and reference "
                                  "arguments)")
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
            templates[name] = (params, body, tparams, _max_threads_attr(header, name))
        elif is_kernel:
            kernels.append(_kernel(name, name, params, body + params, definitions, body,
                                   max_threads=_max_threads_attr(header, name)))
    for host_name, statement in instantiations:
        target = _instantiated(statement)
        if target is None or target[0] not in templates:
            raise MSLCompileError(f"{SOURCE_NAME}: cannot tell which kernel template "
                                  f"host_name(\"{host_name}\") instantiates")
        name, args = target
        params, body, tparams, max_threads = templates[name]
        kernels.append(_kernel(host_name, f"{name}<{args}>", params, body + args, definitions,
                               body, tparams, max_threads))
    names = [k.name for k in kernels]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise MSLCompileError(f"{SOURCE_NAME}: kernel names defined twice: {sorted(dupes)}")
    return kernels


_MAX_THREADS_ATTR = re.compile(r"\[\[[^\]]*\bmax_total_threads_per_threadgroup\s*\(\s*([^)]*)\)")


def _max_threads_attr(header: str, kernel: str) -> int:
    """N of ``[[max_total_threads_per_threadgroup(N)]]`` in a kernel's header, 0 without it."""
    m = _MAX_THREADS_ATTR.search(header)
    if m is None:
        return 0
    if not m.group(1).strip().isdigit() or not 1 <= int(m.group(1)) <= 1024:
        raise MSLCompileError(f"{SOURCE_NAME}: kernel {kernel}: "
                              f"max_total_threads_per_threadgroup({m.group(1).strip()}) needs an "
                              "integer literal from 1 to 1024 (the emulator reads it from the "
                              "expanded source)")
    return int(m.group(1))


def _kernel(name: str, call: str, params: str, reach: str, definitions, body: str,
            tparams: str = "", max_threads: int = 0) -> Kernel:
    parsed = tuple(_parse_param(p, name) for p in _split_params(params))
    sizes = [f"sizeof({type_} {dims})" for _, type_, _, dims in _tg_declarations("{" + body)]
    return Kernel(name, call, parsed, _reaches_sync(reach, definitions),
                  " + ".join(["0"] + sizes), tparams, max_threads)


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
