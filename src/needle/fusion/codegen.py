"""Kernel source for fused groups (``plan.Group``): CUDA C++ for NVRTC and MSL for Metal.

A group's kernel is a grid-stride loop over its n elements: it loads each leaf once, runs
the nodes in the step's order on values of each node's storage type, and stores the
outputs. Each node is written with the operation functors, ``load``/``store`` and casts of
the backend's own ``elementwise`` kernel file, which the generated source is appended to
(its instantiations cut off): a fused node computes exactly what its unfused kernel does,
rounding to the storage type after each node as that kernel does when it writes memory.
A multiply of one node and an add of the next must not become one fused multiply-add (one
rounding instead of two): CUDA passes each float value through an empty ``asm`` statement,
which the compiler cannot see through, and compiles with the kernel files' own options, so
each operation compiles as in its own kernel and a fused group gives the unfused step's
bits. MSL has no such barrier: Metal compiles with IEEE math (no fast math); the emulator's
clang contracts only within one expression, so there too the bits are the unfused ones.

Scalars and shapes are constants of the source: a recording freezes them anyway.
"""

from __future__ import annotations

import numpy as np

from ..backends.gpu.array import scalar, simplify
from .plan import Group

CUDA_TYPES = {"float16": "half_t", "bfloat16": "bf16_t", "float32": "float", "float64": "double",
              "int32": "int", "int64": "i64", "bool": "b8", "uint8": "u8_t", "int8": "i8_t"}
METAL_TYPES = {"float16": "half", "bfloat16": "bfloat", "float32": "float", "int32": "int",
               "int64": "long", "bool": "bool", "uint8": "uchar", "int8": "char"}
_FLOAT_PARAM = ("float16", "bfloat16", "float32")  # scalar params packed as float32
INSTANTIATION_MARK = "// ---- instantiation"


def _functor(op: str) -> str:
    return "SiluMul" if op == "silu_mul" else op.capitalize()


class _Dialect:
    types: dict
    bool_type: str

    def barrier(self, t: str, name: str) -> str:
        """A statement after value ``name`` of type ``t`` that stops the compiler from
        contracting it with what follows ('' where none is needed or possible)."""
        return ""

    def literal(self, dtype: str, value) -> str:
        """The scalar param ``value`` of a ``dtype`` kernel, as its kernels receive it."""
        v = scalar(dtype, value)
        if dtype in _FLOAT_PARAM:
            return self.float_bits(int(np.float32(v).view(np.uint32)))
        if dtype == "float64":
            return self.double_bits(int(np.float64(v).view(np.uint64)))
        if dtype == "int64":
            return self.long_bits(int(v) & (2**64 - 1))
        return self.int_bits(int(v) & (2**32 - 1))

    def cast(self, src: str, dst: str, x: str) -> str:
        raise NotImplementedError

    def compare(self, op: str, a: str, b: str) -> str:
        raise NotImplementedError


class _Cuda(_Dialect):
    types, bool_type = CUDA_TYPES, "b8"

    def barrier(self, t, name):
        code = {"float": "f", "double": "d"}.get(t)
        return f' asm("" : "+{code}"({name}));' if code else ""

    def float_bits(self, u):
        return f"__int_as_float((int)0x{u:08x}u)"

    def double_bits(self, u):
        return f"__longlong_as_double((i64)0x{u:016x}ull)"

    def long_bits(self, u):
        return f"((i64)0x{u:016x}ull)"

    def int_bits(self, u):
        return f"((int)0x{u:08x}u)"

    def cast(self, src, dst, x):
        return f"Cast<{self.types[src]}, {self.types[dst]}>()({x})"

    def compare(self, op, a, b):
        return f"(b8){_functor(op)}()({a}, {b})"


class _Metal(_Dialect):
    types, bool_type = METAL_TYPES, "bool"

    def float_bits(self, u):
        return f"as_type<float>(0x{u:08x}u)"

    def double_bits(self, u):  # Metal has no float64 arrays
        raise ValueError("Metal has no float64")

    def long_bits(self, u):
        return f"as_type<long>(0x{u:016x}ul)"

    def int_bits(self, u):
        return f"as_type<int>(0x{u:08x}u)"

    def cast(self, src, dst, x):
        if dst == "bool":
            return f"(load({x}) != 0)"
        return f"convert<{self.types[dst]}>(load({x}))"

    def compare(self, op, a, b):
        return f"{_functor(op)}()({a}, {b})"


CUDA, METAL = _Cuda(), _Metal()


def _index(view: tuple, idx: str = "i") -> str:
    """The element of a gathered input that element ``idx`` of the gather's output reads."""
    shape, strides, offset = view
    shape, strides = simplify(shape, strides)
    at = "i" if idx == "i" else f"({idx})"
    terms = [str(offset)] if offset else []
    inner = 1
    for d, s in reversed(list(zip(shape, strides))):
        if s != 0 and d != 1:
            part = f"({at} / {inner})" if inner != 1 else at
            terms.append(f"({part} % {d}) * {s}")
        inner *= d
    return " + ".join(terms) or "0"


class _Body:
    """The statements computing a group's outputs at element ``i``: each node's value is
    made (once per index it is needed at) from its inputs' values at that index, or, for a
    gather, at the index its view maps it to; arrays the group does not compute before are
    loaded from memory."""

    def __init__(self, group: Group, d: _Dialect):
        self.group, self.d = group, d
        self.producer = {id(m.out): m for m in group.nodes}
        self.leaf = {id(x): k for k, x in enumerate(group.leaves)}
        self.memo: dict[tuple, str] = {}
        self.lines: list[str] = []

    def read(self, reader, x, idx: str) -> str:
        """The value of array ``x`` at ``idx`` as node ``reader`` sees it."""
        m = self.producer.get(id(x))
        if m is not None and m.pos < reader.pos and (
                reader.kind != "gather" or id(x) in self.group.internal):
            return self.value(m, idx)
        key = ("leaf", id(x), idx)
        name = self.memo.get(key)
        if name is None:
            k = self.leaf[id(x)]
            name = self.memo[key] = f"l{k}_{len(self.memo)}"
            self.lines.append(f"const {self.d.types[x.dtype]} {name} = in{k}[{idx}];")
        return name

    def value(self, m, idx: str) -> str:
        key = (id(m), idx)
        name = self.memo.get(key)
        if name is not None:
            return name
        d, t = self.d, self.d.types[m.out.dtype]
        kind = m.kind
        if kind == "gather":
            expr = self.read(m, m.inputs[0], _index(m.view, idx))
        elif kind == "fill":
            expr = f"store<{t}>(scalar_value<{t}>({d.literal(m.out.dtype, m.value)}))"
        else:
            args = [self.read(m, x, idx) for x in m.inputs]
            src = m.inputs[0].dtype
            if kind == "binary" or kind == "silu_mul":
                expr = f"store<{t}>({_functor(m.op or kind)}()(load({args[0]}), load({args[1]})))"
            elif kind == "compare":
                expr = d.compare(m.op, f"load({args[0]})", f"load({args[1]})")
            elif kind == "scalar":
                s = f"scalar_value<{t}>({d.literal(src, m.value)})"
                expr = f"store<{t}>({_functor(m.op)}()(load({args[0]}), {s}))"
            elif kind == "scalar_compare":
                s = f"scalar_value<{d.types[src]}>({d.literal(src, m.value)})"
                expr = d.compare(m.op, f"load({args[0]})", s)
            elif kind == "unary":
                expr = f"store<{t}>({_functor(m.op)}()(load({args[0]})))"
            elif kind == "cast":
                expr = args[0] if src == m.out.dtype else d.cast(src, m.out.dtype, args[0])
            elif kind == "where":
                expr = f"({args[0]} ? {args[1]} : {args[2]})"
            else:  # pragma: no cover -- node_of makes no other kinds
                raise ValueError(kind)
        name = self.memo[key] = f"v{len(self.memo)}"
        barrier = d.barrier(t, name) if kind not in ("gather", "where") else ""
        self.lines.append(f"{'' if barrier else 'const '}{t} {name} = {expr};{barrier}")
        return name


def body(group: Group, d: _Dialect) -> tuple[list[str], list[str]]:
    """(statements of one element i, the kernel's pointer parameters without qualifiers:
    leaves then outputs)."""
    b = _Body(group, d)
    stores = [f"out{k}[i] = {b.value(m, 'i')};" for k, (m, _) in enumerate(group.outputs)]
    params = [f"{d.types[x.dtype]}* in{k}" for k, x in enumerate(group.leaves)]
    params += [f"{d.types[x.dtype]}* out{k}" for k, (_, x) in enumerate(group.outputs)]
    return b.lines + stores, params


def cuda_kernel(name: str, group: Group) -> str:
    lines, params = body(group, CUDA)
    leaves = len(group.leaves)
    args = [("const " if k < leaves else "") + p for k, p in enumerate(params)]
    inner = "\n".join("    " + s for s in lines)
    return (f'extern "C" __global__ void {name}({", ".join(args + ["NParams p"])}) {{\n'
            "  pdl_entry();\n"
            "  const i64 step = grid_threads();\n"
            "#pragma unroll 4\n"  # several elements' loads in flight per thread
            "  for (i64 i = global_thread(); i < p.n; i += step) {\n"
            f"{inner}\n  }}\n}}\n")


def metal_kernel(name: str, group: Group) -> str:
    lines, params = body(group, METAL)
    leaves = len(group.leaves)
    args = [("device const " if k < leaves else "device ") + p + f" [[buffer({k})]]"
            for k, p in enumerate(params)]
    args.append(f"constant NParams& p [[buffer({len(params)})]]")
    inner = "\n".join("    " + s for s in lines)
    return (f"kernel void {name}({', '.join(args)}, GRID_ARGS) {{\n"
            f"  GRID_STRIDE(i, p.n) {{\n{inner}\n  }}\n}}\n")


def prelude(elementwise_source: str) -> str:
    """The elementwise kernel file up to its instantiations: the functors and helpers."""
    cut = elementwise_source.rfind(INSTANTIATION_MARK)  # (Metal's source has common.h's too)
    if cut < 0:
        raise ValueError("the elementwise kernel file has no instantiation section")
    return elementwise_source[:cut]


def module(dialect: str, elementwise_source: str, groups: list[Group]) -> tuple[str, list]:
    """One source holding a kernel per distinct group, and each group's kernel name.
    Groups that compute the same thing on other arrays (the layers of a model) share one."""
    make = cuda_kernel if dialect == "cuda" else metal_kernel
    kernels: dict[str, str] = {}  # kernel text (named "@") -> its name
    names = []
    for g in groups:
        text = make("@", g)
        name = kernels.get(text)
        if name is None:
            name = kernels[text] = f"fused_{len(kernels)}"
        names.append(name)
    parts = [prelude(elementwise_source), '#line 1 "fused"']
    parts += [text.replace("@", name, 1) for text, name in kernels.items()]
    return "\n".join(parts), names
