"""Which backend calls of a recorded step become one fused elementwise kernel.

A recorded step is a list of backend calls per segment (the stretches between optimizer
steps). Elementwise calls (``ewise_*``, ``scalar_*``, casts, ``where``, ``silu_mul``), the
gathers that feed them (``compact`` of a broadcast or strided view) and ``fill`` are *nodes*;
an array written by one node and read only by nodes (flat, element i for element i), never
used after the step, is an *intermediate*: it need not exist at all. Nodes joined through
intermediates form a *group*, computed by one kernel placed where its last node was; the
group's other results (its *outputs*) are written as before.

Moving a node to the group's place is safe only if nothing in between reads an output the
group writes earlier, or writes an input the group reads earlier: a group where that happens
is split there (each part is checked again), and arrays that cross the split are written
after all. Whether an array is used after the step is read from Python's reference counts
once the step has returned: an array that only the recording holds is dead.

Arrays are compared by identity: while a step is recorded, the recording holds every array
it touched, so no buffer is recycled between two calls of one recording.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

from ..backends.api import BINARY_OPS, UNARY_OPS
from .call import Call, is_array

_COMPARE = frozenset(("eq", "ne", "lt", "le", "gt", "ge"))
# a unit inlined into a gather is computed again for every element that reads it (a
# broadcast reads one many times): only short ones, such as a reduction's tail
MAX_INLINED = 8
# buffers one generated kernel takes (Metal binds at most 31 with its params; CUDA's launch
# block has 64 slots): a group with more is split in two
MAX_BUFFERS = 24


@dataclass(eq=False)
class Node:
    """An elementwise call: ``out[i] = op(inputs[0][i], ...)`` for i < n (``gather``: the
    compact of a strided view, whose one input is read at its own index)."""

    call: Call
    kind: str  # binary, compare, scalar, scalar_compare, unary, cast, where, silu_mul,
    #            gather, fill
    op: str  # add, exp, ... ('' where the kind says it all)
    inputs: tuple
    out: object
    n: int
    value: object = None  # the scalar of scalar_* and fill
    view: tuple = ()  # gather: (shape, strides, offset)

    @property
    def pos(self) -> int:
        return self.call.pos


def node_of(call: Call) -> Node | None:
    """The call as a fusable node, or None."""
    name, a = call.name, call.args
    if call.kwargs:
        return None
    kind, op, inputs, value, view = None, "", (), None, ()
    if name.startswith("ewise_") and name[6:] in BINARY_OPS and len(a) == 3:
        op = name[6:]
        kind, inputs = ("compare" if op in _COMPARE else "binary"), a[:2]
    elif name.startswith("scalar_") and name[7:] in BINARY_OPS and len(a) == 3:
        op = name[7:]
        kind, inputs, value = ("scalar_compare" if op in _COMPARE else "scalar"), a[:1], a[1]
    elif name.startswith("ewise_") and name[6:] in UNARY_OPS and len(a) == 2:
        kind, op, inputs = "unary", name[6:], a[:1]
    elif name == "ewise_cast" and len(a) == 2:
        kind, inputs = "cast", a[:1]
    elif name == "where" and len(a) == 4:
        kind, inputs = "where", a[:3]
    elif name == "silu_mul" and len(a) == 3:
        kind, inputs = "silu_mul", a[:2]
    elif name == "compact" and len(a) == 5:
        shape, strides, offset = a[2], a[3], a[4]
        if len(shape) != len(strides) or math.prod(shape) != a[1].size:
            return None
        kind, inputs = "gather", a[:1]
        view = (tuple(int(d) for d in shape), tuple(int(s) for s in strides), int(offset))
    elif name == "fill" and len(a) == 2:
        kind, value = "fill", a[1]
    if kind is None:
        return None
    out = a[-1] if kind != "gather" and kind != "fill" else (a[1] if kind == "gather" else a[0])
    if not all(is_array(x) for x in (*inputs, out)):
        return None
    n = out.size
    if n == 0 or any(x.size != n for x in inputs if kind != "gather"):
        return None
    return Node(call, kind, op, tuple(inputs), out, n, value, view)


@dataclass(eq=False)
class Group:
    """Nodes computed by one kernel at the place of the last one."""

    nodes: list  # in the step's order
    internal: set  # ids of the intermediates (never written)
    leaves: list = field(default_factory=list)  # arrays read (each once)
    outputs: list = field(default_factory=list)  # (node, array) written, in order
    n: int = 0

    @property
    def pos(self) -> int:
        return self.nodes[-1].pos


def dead_arrays(calls: list[Call], held_elsewhere: int = 0) -> set[int]:
    """ids of the arrays that nothing but ``calls`` refers to (and ``held_elsewhere`` more
    references per array that the caller knows of). Call it after the step has returned."""
    counts: dict[int, int] = {}
    objs: dict[int, object] = {}
    for c in calls:
        for x in list(c.args) + list(c.kwargs.values()):
            if is_array(x):
                counts[id(x)] = counts.get(id(x), 0) + 1
                objs[id(x)] = x
    # the references this loop itself makes (objs, the loop's variables, getrefcount's
    # argument) differ between Python versions: measured on a sentinel held by one tuple
    holder = (object(),)
    mark = id(holder[0])
    objs[mark], counts[mark] = holder[0], 1
    refs = {}
    for key, x in objs.items():
        refs[key] = sys.getrefcount(x) - counts[key]
    base = refs.pop(mark)
    return {key for key, r in refs.items() if r - held_elsewhere <= base}


def plan(segments: list[list[Call]], dead: set[int]) -> list[list[Group]]:
    """The groups of two or more nodes in each segment (lists of calls, in the step's
    order); ``dead``: ids of arrays unused after the step (``dead_arrays`` of them all)."""
    pos = 0
    for seg in segments:
        for c in seg:
            c.pos, pos = pos, pos + 1
            c.analyse()
    writers: dict[int, list] = {}
    readers: dict[int, list] = {}
    for seg in segments:
        for c in seg:
            for x in c.writes:
                writers.setdefault(id(x), []).append(c)
            for x in c.reads:
                readers.setdefault(id(x), []).append(c)
    return [_plan_segment(seg, dead, writers, readers) for seg in segments]


def _plan_segment(calls: list[Call], dead: set[int], writers: dict,
                  readers: dict) -> list[Group]:
    nodes = []
    for c in calls:
        c.node = node_of(c)
        if c.node is not None:
            nodes.append(c.node)
    if not nodes:
        return []
    first, last = calls[0].pos, calls[-1].pos
    elidable = set()
    for nd in nodes:
        key = id(nd.out)
        if key not in dead or len(writers[key]) != 1:
            continue
        rs = [c for c in readers.get(key, []) if c is not nd.call]
        if rs and all(c.node is not None and nd.pos < c.pos <= last and first <= c.pos
                      and all(x is not nd.out for x in c.writes) for c in rs):
            elidable.add(key)
    # components joined through elidable arrays
    root_of = {id(nd): id(nd) for nd in nodes}

    def find(k):
        while root_of[k] != k:
            root_of[k] = root_of[root_of[k]]
            k = root_of[k]
        return k

    by_out = {id(nd.out): nd for nd in nodes}
    for nd in nodes:
        for x in nd.inputs:
            if id(x) in elidable and nd.kind != "gather":
                root_of[find(id(nd))] = find(id(by_out[id(x)]))
    comps: dict[int, list] = {}
    for nd in nodes:
        comps.setdefault(find(id(nd)), []).append(nd)
    units: list[Group] = []
    for members in comps.values():
        units += _split(sorted(members, key=lambda m: m.pos), calls, elidable, readers)
    units = _inline_gathered(units, calls, elidable, readers)
    return sorted((g for g in units if len(g.nodes) > 1), key=lambda g: g.pos)


def _inline_gathered(units: list[Group], calls: list, elidable: set,
                     readers: dict) -> list[Group]:
    """Merge a unit whose results are only gathered (broadcast, strided) by one other unit
    into that one: the gathering kernel computes them at the index it reads (the tail of a
    reduction, a constant). Repeated until nothing merges."""
    unit_of = {id(m.call): u for u in units for m in u.nodes}
    changed = True
    while changed:
        changed = False
        for h in sorted(units, key=lambda u: -u.pos):
            targets = set()
            for _, x in h.outputs:
                rs = readers.get(id(x), [])
                if id(x) not in elidable or not all(
                        c.node is not None and c.node.kind == "gather" for c in rs
                        if c is not _writer(h, x)):
                    targets = None
                    break
                targets |= {id(unit_of.get(id(c))) for c in rs if c is not _writer(h, x)}
            if not targets or len(targets) != 1 or len(h.nodes) > MAX_INLINED:
                continue
            g = next((u for u in units if id(u) == next(iter(targets))), None)
            if g is None or g is h or g.pos < h.pos:
                continue
            merged = _make(sorted(h.nodes + g.nodes, key=lambda m: m.pos), elidable, readers)
            if merged.outputs and _conflict(merged, calls) is None and \
                    len({m.n for m, _ in merged.outputs}) == 1 and \
                    len(merged.leaves) + len(merged.outputs) <= MAX_BUFFERS:
                units = [u for u in units if u is not h and u is not g] + [merged]
                for m in merged.nodes:
                    unit_of[id(m.call)] = merged
                changed = True
                break
    return units


def _writer(group: Group, x):
    return next(m.call for m in group.nodes if m.out is x)


def _make(members: list, elidable: set, readers: dict) -> Group:
    """A group of ``members`` with its intermediates, leaves and outputs."""
    ids = {id(m.call) for m in members}
    internal = {id(m.out) for m in members if id(m.out) in elidable
                and all(id(c) in ids for c in readers.get(id(m.out), []) if c is not m.call)}
    made, leaves, seen, outputs = set(), [], set(), []
    for m in members:
        for x in m.inputs:  # read from memory unless the group computed it before
            if (id(x) not in made or (m.kind == "gather" and id(x) not in internal)) \
                    and id(x) not in seen:
                seen.add(id(x))
                leaves.append(x)
        made.add(id(m.out))
        if id(m.out) not in internal:
            outputs.append((m, m.out))
    n = outputs[0][0].n if outputs else members[-1].n
    return Group(members, internal, leaves, outputs, n)


def _split(members: list, calls: list, elidable: set, readers: dict) -> list[Group]:
    """``members`` as one group, or split where moving them to the last one is unsafe."""
    group = _make(members, elidable, readers)
    at = _conflict(group, calls)
    if at is None and len(group.leaves) + len(group.outputs) > MAX_BUFFERS:
        at = members[len(members) // 2].pos
    if at is None:
        return [group]
    before = [m for m in members if m.pos < at]
    after = [m for m in members if m.pos >= at]
    out = []
    for part in (before, after):
        if part:
            out += _split(part, calls, elidable, readers)
    return out


def _conflict(group: Group, calls: list) -> int | None:
    """The first position where the group cannot be moved past, or None."""
    ids = {id(m.call) for m in group.nodes}
    first, last = group.nodes[0].pos, group.nodes[-1].pos
    read_leaves: set[int] = set()  # leaves read so far by the group (by flat nodes too)
    written: set[int] = set()  # outputs and intermediates written so far
    member = {m.pos: m for m in group.nodes}
    base = calls[0].pos
    for c in calls[first - base:last - base + 1]:
        m = member.get(c.pos)
        if m is not None and id(m.call) in ids:
            for x in m.inputs:
                if m.kind == "gather" and id(x) in written and id(x) not in group.internal:
                    return c.pos  # a gather reads memory the group has not written yet
                if id(x) not in written:
                    read_leaves.add(id(x))
            written.add(id(m.out))
            continue
        if any(id(x) in read_leaves for x in c.writes):
            return c.pos
        if any(id(x) in written for x in c.reads + c.writes):
            return c.pos
    # a group's output must not be gathered by the group itself at another index
    gathered = {id(x) for m in group.nodes if m.kind == "gather" for x in m.inputs}
    for m, x in group.outputs:
        if id(x) in gathered:
            return m.pos  # (a gather before the write: that is where they part)
    return None
