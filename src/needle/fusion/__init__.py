"""Elementwise fusion inside a recorded step (``ndl.compile``; issue 13).

``compiled.py`` records a step's backend calls without running them (mode "defer" of
``recording.StepRecorder``), then ``fuse`` plans groups of elementwise calls
(``plan.py``) and turns each segment's calls into a list of thunks, which the recording then
captures into a CUDA graph or Metal command buffer:

* cuda and metal: one generated kernel per group (``codegen.py``), all of a step's kernels in
  one source compiled once (NVRTC, cached on disk; Metal's run-time compiler);
* the CPUs (only when asked: ``ndl.compile(fn, fuse=True)`` or ``NEEDLE_FUSION=1``): each
  group's calls run one after the other at the group's place, their intermediates in scratch
  arrays. No kernel is generated, so nothing gets faster; it runs the same plan as the GPUs,
  which is how the plan is tested without a GPU.

``NEEDLE_FUSION=0`` turns fusion off (A/B comparisons); by default it is on for cuda and
metal and off for the CPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..backends.gpu.array import N_PARAMS, cdiv
from .call import Call, is_array
from .codegen import module
from .plan import Group, dead_arrays, plan

__all__ = ["Call", "Fused", "enabled", "fuse"]

GPU_BACKENDS = ("cuda", "metal")


def enabled(backend, override: bool | None = None) -> bool:
    """Whether a step recorded on ``backend`` is fused: ``override`` (``ndl.compile``'s
    ``fuse``) if given, else ``NEEDLE_FUSION`` (0 off, 1 on for every device), else on for
    cuda and metal."""
    if override is not None:
        return bool(override)
    env = os.environ.get("NEEDLE_FUSION", "").strip()
    if env in ("0", "1"):
        return env == "1"
    return backend.name in GPU_BACKENDS


@dataclass
class Fused:
    """The thunks of each segment, and what fusion did."""

    segments: list  # per input segment: a list of callables, in order
    groups: int = 0  # fused groups (one kernel each)
    calls_fused: int = 0  # backend calls those groups replace
    sizes: list = field(default_factory=list)  # calls per group
    sources: int = 0  # distinct generated kernels (groups computing alike share one)


def fuse(backend, segments: list[list[Call]], dead: set[int] | None = None) -> Fused:
    """Plan and build the fused form of ``segments`` (lists of ``Call``; run after the step
    returned, so that ``dead_arrays`` sees which arrays are still used)."""
    if dead is None:
        dead = dead_arrays([c for seg in segments for c in seg])
    planned = plan(segments, dead)
    flat = [g for groups in planned for g in groups]
    if not flat:
        return Fused([list(seg) for seg in segments])
    if backend.name in GPU_BACKENDS:
        kernels, sources = _gpu_kernels(backend, flat)
    else:
        kernels, sources = [_cpu_kernel(backend, g) for g in flat], 0
    thunk = {id(g): k for g, k in zip(flat, kernels)}
    out = []
    for seg, groups in zip(segments, planned):
        at = {g.pos: g for g in groups}
        absorbed = {id(m.call) for g in groups for m in g.nodes}
        items = []
        for c in seg:
            g = at.get(c.pos)
            if g is not None:
                items.append(thunk[id(g)])
            elif id(c) not in absorbed:
                items.append(c)
        out.append(items)
    for seg in segments:  # the plan's references to arrays go (intermediates are freed)
        for c in seg:
            c.reads = c.writes = []
            c.node = None
    return Fused(out, len(flat), sum(len(g.nodes) for g in flat),
                 [len(g.nodes) for g in flat], sources)


def _cpu_kernel(backend, group: Group):
    """The group's calls in order, intermediates in scratch arrays made once."""
    scratch = {}
    for m in group.nodes:
        if id(m.out) in group.internal:
            scratch[id(m.out)] = backend.Array(m.out.size, m.out.dtype)
    steps = [(m.call.fn, tuple(scratch.get(id(a), a) if is_array(a) else a
                               for a in m.call.args)) for m in group.nodes]

    def run():
        for fn, args in steps:
            fn(*args)
    run.fused_calls = len(steps)
    return run


def _gpu_kernels(backend, groups: list[Group]) -> tuple[list, int]:
    """One launch per group, from one generated module; and its number of kernels."""
    cache = backend.device.executables
    source, names = module(backend.name, cache.source("elementwise"), groups)
    exe = cache.fused_executable(source)
    return ([_launcher(backend, exe.kernel(name), g) for name, g in zip(names, groups)],
            len(set(names)))


def _launcher(backend, kernel, group: Group):
    buffers = [x.buffer for x in group.leaves] + [x.buffer for _, x in group.outputs]
    t = kernel.preferred_threads
    grid = (min(cdiv(group.n, t), kernel.resident_groups(t)) or 1, 1, 1)
    params = N_PARAMS.pack(group.n)
    queue = backend.queue

    def run():
        queue.dispatch(kernel, grid, (t, 1, 1), buffers, params)
    run.fused_calls = len(group.nodes)
    return run
