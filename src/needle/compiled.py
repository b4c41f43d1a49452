"""``ndl.compile``: record a training step once, replay it without Python dispatch.

``step = ndl.compile(fn)`` returns a callable with ``fn``'s signature. For each set of input
shapes, dtypes and non-tensor arguments (its *signature*) the first calls run ``fn`` and
watch what it does at the backend level; from then on a call copies the input tensors into
buffers the recording reads, replays the recorded device work and returns copies of the
outputs:

* call 1 runs eagerly (lazily created state settles: optimizer moments, cached tables);
* call 2 runs eagerly and notes every backend call, upload and allocation;
* call 3 records: on a device with the ``graphs`` capability (cuda, metal) the device work is
  captured into command buffers (CUDA graphs), then replayed once; on the CPUs the backend
  calls run and are kept in a list;
* later calls replay: one graph launch per segment, or the list of backend calls with no
  Tensor, op, autograd or NDArray code in between.

``Optimizer.step`` and ``LRScheduler.step`` inside ``fn`` are not frozen: their learning
rate and step count change every call, so they run on the host at every replay, in their
place between graph segments (a fused update launch per parameter, on the device, in place).

What cannot be replayed is detected while recording and the signature then runs eagerly for
good, with a ``CompileFallbackWarning`` saying why (``step.fallback_reason(*args)``):

* host reads inside the step (``.item()``, ``.numpy()``, printing a tensor, a GradScaler);
* host data that changes between calls (random masks drawn on the host, Python values);
* arrays that a step makes and the next one reads (BatchNorm running statistics rebound
  every step, gradients accumulated without ``zero_grad``): replay would read stale ones;
* a different sequence of backend calls or scalars on two calls (data-dependent control flow).

The outputs of a replayed call are fresh tensors; parameters, their ``.grad`` and optimizer
state are updated in place. One recording per signature: a new shape records anew.
"""

from __future__ import annotations

import functools
import gc
import warnings
from dataclasses import dataclass, field

from . import fusion, step_hooks
from .autograd import Tensor
from .backend_ndarray import NDArray
from .backends.api import has
from .errors import ArgumentTypeError, NeedleError
from .recording import BackendProxy, NotCapturableError, StepRecorder

__all__ = ["CompileFallbackWarning", "CompiledStep", "compile"]


class CompileFallbackWarning(UserWarning):
    """A step ``ndl.compile`` could not record: it runs eagerly (the message says why)."""


@dataclass
class _Entry:
    """Everything known about one signature of the step."""

    calls: int = 0  # calls made so far
    reason: str | None = None  # why it runs eagerly, once known
    inputs: list = field(default_factory=list)  # static NDArrays the recording reads
    segments: list = field(default_factory=list)  # ("graph", cb) / ("calls", list) / ("host", f)
    outputs: object = None  # fn's result with NDArrays in place of tensors
    eager_calls: int = 0  # backend calls per eager step (work and optimizer)
    host_calls: int = 0  # backend calls per step made by host steps (optimizer)
    graph_kernels: int = 0
    keep: list = field(default_factory=list)  # staged uploads and other buffers to hold
    device: object = None
    last: object = None  # the recorder of the previous watched call
    params: list = field(default_factory=list)  # (parameter, its buffer) the optimizer saw
    deferrable: bool = True  # no backend call of the step returns a value (fusion may defer)
    fused_groups: int = 0  # generated kernels (needle.fusion)
    fused_calls: int = 0  # backend calls they replace
    fused_sources: int = 0  # distinct generated kernels among them
    replay_calls: int = 0  # ("record", the CPUs) calls and fused groups run by a replay


def _device_of(args, kwargs):
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, Tensor):
            return x.device
    return None


def _key(args, kwargs) -> tuple:
    def one(x):
        if isinstance(x, Tensor):
            return ("T", tuple(x.shape), x.dtype, x.device.name)
        try:
            hash(x)
        except TypeError:
            raise ArgumentTypeError(f"ndl.compile: argument {x!r:.60} is neither a Tensor nor "
                                    "hashable; pass tensors, numbers or strings") from None
        return ("V", type(x).__name__, x)
    return (tuple(map(one, args)), tuple((k, one(v)) for k, v in sorted(kwargs.items())))


def _map(obj, f):
    """``obj`` with ``f`` applied to every Tensor/NDArray in nested tuples, lists, dicts."""
    if isinstance(obj, (Tensor, NDArray)):
        return f(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map(x, f) for x in obj)
    if isinstance(obj, dict):
        return {k: _map(v, f) for k, v in obj.items()}
    return obj


class CompiledStep:
    """What ``ndl.compile(fn)`` returns (see the module's docstring)."""

    def __init__(self, fn, warn: bool = True, fuse: bool | None = None):
        if not callable(fn):
            raise ArgumentTypeError(f"ndl.compile: fn must be callable, got {type(fn).__name__}")
        if fuse is not None and not isinstance(fuse, bool):
            raise ArgumentTypeError(f"ndl.compile: fuse must be True, False or None (the "
                                    f"default: NEEDLE_FUSION, else on for cuda and metal), "
                                    f"got {fuse!r}")
        self.fn, self.warn, self.fuse = fn, warn, fuse
        self._entries: dict[tuple, _Entry] = {}
        functools.update_wrapper(self, fn)

    # --- public -------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        key = _key(args, kwargs)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
            device = _device_of(args, kwargs)
            if device is None:
                self._give_up(entry, "the step has no tensor arguments: pass the batch as "
                                     "arguments so that it can be copied into the recording")
            elif any(isinstance(x, Tensor) and x.requires_grad
                     for x in list(args) + list(kwargs.values())):
                self._give_up(entry, "an input tensor requires grad: the recording treats "
                                     "inputs as data (pass requires_grad=False)")
            entry.device = device
        if entry.reason is not None or step_hooks.recorder is not None:
            # inside another recording (part of its work), or while another thread records
            # (one recording at a time: the proxy stands in for the device's backend)
            return self.fn(*args, **kwargs)
        entry.calls += 1
        if entry.calls > 3:
            if all(p.cached_data is not None and p.cached_data._handle is h
                   for p, h in entry.params):
                return self._replay(entry, args, kwargs)
            # a parameter got new storage (load_state_dict, .data = ...): record anew
            self._close(entry)
            del self._entries[key]
            return self(*args, **kwargs)
        try:
            if entry.calls < 3:
                out, rec = self._watch(entry, args, kwargs)
                entry.last = rec if entry.reason is None else None  # (it holds arrays)
                return out
            return self._record(entry, args, kwargs)
        except BaseException:
            entry.calls -= 1  # the step raised: this stage again on the next call
            raise

    def fallback_reason(self, *args, **kwargs) -> str | None:
        """Why the step runs eagerly for these arguments' signature (None: it replays, or
        has not been tried yet)."""
        entry = self._entries.get(_key(args, kwargs))
        return None if entry is None else entry.reason

    def stats(self, *args, **kwargs) -> dict:
        """Backend calls per step: eagerly, and launches per replayed step (``graph`` kernels
        count once: a graph launch), for this signature."""
        e = self._entries.get(_key(args, kwargs))
        if e is None:
            return {}
        graphs = sum(1 for kind, _ in e.segments if kind == "graph")
        return {"recorded": e.reason is None and e.calls >= 3, "reason": e.reason,
                "eager_calls": e.eager_calls, "optimizer_calls": e.host_calls,
                "graphs": graphs, "graph_kernels": e.graph_kernels,
                "fused_kernels": e.fused_groups, "fused_calls": e.fused_calls,
                "generated_kernels": e.fused_sources,
                "replay_calls": e.replay_calls,
                "replay_launches": (len(e.inputs) + graphs + e.host_calls
                                    + len(_flat(e.outputs)) if graphs else e.eager_calls)}

    # --- passes ----------------------------------------------------------------------------
    def _close(self, entry: _Entry) -> None:
        for kind, item in entry.segments:
            if kind == "graph":
                item.close()
        entry.segments, entry.inputs, entry.keep, entry.last = [], [], [], None

    def _give_up(self, entry: _Entry, reason: str) -> None:
        entry.reason = reason
        self._close(entry)
        if self.warn:
            warnings.warn(f"ndl.compile({getattr(self.fn, '__name__', 'fn')}): running eagerly: "
                          f"{reason}", CompileFallbackWarning, stacklevel=3)

    def _watch(self, entry, args, kwargs):
        """Run the step eagerly, noting what it does (calls 1 and 2)."""
        device = entry.device
        real = device.backend
        rec = StepRecorder("probe", real)
        device._backend = BackendProxy(real, rec)
        step_hooks.recorder = rec
        try:
            out = self.fn(*args, **kwargs)
        finally:
            step_hooks.recorder = None
            device._backend = real
        if rec.reason is not None and entry.reason is None:
            self._give_up(entry, rec.reason)
        entry.eager_calls = len(rec.log) + rec.host_calls
        entry.host_calls = rec.host_calls
        entry.deferrable = entry.deferrable and rec.returned is None
        return out, rec

    def _static_inputs(self, entry, args, kwargs):
        """Buffers for the tensor arguments (made once), filled from this call's."""
        flat = [x for x in list(args) + [kwargs[k] for k in sorted(kwargs)]
                if isinstance(x, Tensor)]
        if not entry.inputs:
            entry.inputs = [NDArray.make(x.shape, device=x.device, dtype=x.dtype) for x in flat]
        for static, x in zip(entry.inputs, flat):
            src = x.realize_cached_data()
            src._be.compact(src._handle, static._handle, src.shape, src.strides, src._offset)

        it = iter(entry.inputs)

        def swap(x):
            return Tensor.make_const(next(it)) if isinstance(x, Tensor) else x
        return (tuple(swap(x) for x in args),
                {k: (swap(kwargs[k])) for k in sorted(kwargs)})

    def _record(self, entry, args, kwargs):
        device = entry.device
        real = device.backend
        call_args = self._static_inputs(entry, args, kwargs)
        capture = has(real, "graphs")
        fuse = fusion.enabled(real, self.fuse) and entry.deferrable
        mode = "record" if not capture else "defer" if fuse else "capture"
        rec = StepRecorder(mode, real, entry.last)
        entry.last = None
        try:
            if capture:
                entry.keep = rec.stage_uploads()
            device._backend = BackendProxy(real, rec)
            step_hooks.recorder = rec
            try:
                if mode == "capture":
                    rec._begin_graph()
                out = self.fn(*call_args[0], **call_args[1])
                if mode == "capture":
                    rec._end_graph()
            except BaseException as e:
                if mode == "capture":
                    rec._end_graph(e)
                raise
            finally:
                step_hooks.recorder = None
                device._backend = real
            self._check_same(rec)
        except NotCapturableError as e:
            return self._eager_after_failure(entry, str(e), args, kwargs)
        except NeedleError as e:
            if not capture:
                raise
            return self._eager_after_failure(entry, f"capture failed: {e}", args, kwargs)
        if rec.reason is not None:  # ("record") noted, not raised: the call itself ran
            self._give_up(entry, rec.reason)
            return out
        segments = rec.finish()
        entry.params = rec.params
        entry.outputs = _map(out, lambda t: t.realize_cached_data()
                             if isinstance(t, Tensor) else t)
        del out, rec  # (the step's tensors go: fusion sees which arrays are still used)
        if fuse:
            try:
                segments = self._fused(entry, real, segments, capture)
            except NeedleError as e:  # nothing of the step has run yet: run it eagerly
                return self._eager_after_failure(entry, f"capture failed: {e}", args, kwargs)
        entry.segments = segments
        entry.graph_kernels = sum(getattr(cb, "kernels", 0) for kind, cb in segments
                                  if kind == "graph")
        entry.replay_calls = sum(len(item) for kind, item in segments if kind == "calls")
        if capture:  # nothing ran yet: the capture only recorded
            self._run_segments(entry)
        return self._fresh_outputs(entry)  # later replays overwrite the recorded outputs

    def _fused(self, entry, real, segments: list, capture: bool) -> list:
        """The recorded call lists with elementwise groups fused (``needle.fusion``); on a
        device with graphs, each list then captured into a graph. Where fusion fails (a
        generated kernel that does not build or launch), the lists unfused, with a warning."""
        gc.collect()  # tensors in reference cycles hold arrays too
        lists = [item for kind, item in segments if kind == "calls"]
        try:
            fused = fusion.fuse(real, lists)
            out = self._as_segments(real, segments, fused.segments, capture)
        except Exception as e:
            warnings.warn(f"ndl.compile({getattr(self.fn, '__name__', 'fn')}): elementwise "
                          f"fusion failed, recording without it: {type(e).__name__}: {e}",
                          CompileFallbackWarning, stacklevel=4)
            for seg in lists:
                for c in seg:
                    c.reads = c.writes = []
                    c.node = None
            return self._as_segments(real, segments, lists, capture)
        entry.fused_groups, entry.fused_calls = fused.groups, fused.calls_fused
        entry.fused_sources = fused.sources
        return out

    @staticmethod
    def _as_segments(real, segments: list, lists: list, capture: bool) -> list:
        """``segments`` with its call lists replaced by ``lists`` (each captured into a graph
        on a device with graphs; those made are closed if one fails)."""
        thunks = iter(lists)
        out = []
        try:
            for kind, item in segments:
                if kind != "calls":
                    out.append((kind, item))
                    continue
                items = next(thunks)
                if not capture:
                    out.append(("calls", items))
                elif items:
                    with real.capture() as cb:
                        for run in items:
                            run()
                    out.append(("graph", cb))
        except BaseException:
            for kind, item in out:
                if kind == "graph":
                    item.close()
            raise
        return out

    def _check_same(self, rec: StepRecorder) -> None:
        prev = rec.previous
        if prev is None:
            return
        if len(rec.log) != len(prev.log):
            rec.not_capturable(f"the step made {len(prev.log)} backend calls on one call and "
                               f"{len(rec.log)} on the next (data-dependent control flow)")
        for i, (a, b) in enumerate(zip(prev.log, rec.log)):
            if a != b:
                rec.not_capturable(f"call {i} of the step differs between two calls ({a[0]} "
                                   f"with {a[1:]!r:.80} then {b[0]} with {b[1:]!r:.80}): "
                                   "Python values inside the step change from call to call")
                break
        if len(rec.uploads) != len(prev.uploads):
            rec.not_capturable("the step copies a different number of host arrays to the "
                               "device on two calls")

    def _eager_after_failure(self, entry, reason, args, kwargs):
        self._give_up(entry, reason)
        return self.fn(*args, **kwargs)

    # --- replay ----------------------------------------------------------------------------
    def _run_segments(self, entry) -> None:
        for kind, item in entry.segments:
            if kind == "graph":
                item.replay()
            elif kind == "calls":
                for run in item:
                    run()
            else:
                item()

    def _fresh_outputs(self, entry):
        return _map(entry.outputs, lambda a: Tensor.make_const(a.copy()))

    def _replay(self, entry, args, kwargs):
        self._static_inputs(entry, args, kwargs)
        self._run_segments(entry)
        return self._fresh_outputs(entry)


def _flat(obj) -> list:
    found: list = []
    _map(obj, found.append)
    return found


def compile(fn=None, *, warn: bool = True, fuse: bool | None = None):  # noqa: A001 -- as torch
    """Record ``fn`` (a training step: forward, backward, optimizer update) and replay it on
    later calls (see ``needle.compiled``). Use as ``ndl.compile(step)`` or ``@ndl.compile``;
    ``warn=False`` silences the ``CompileFallbackWarning`` of a step that runs eagerly.
    ``fuse``: fuse chains of elementwise calls into generated kernels (``needle.fusion``);
    None follows ``NEEDLE_FUSION`` (0 or 1), else fuses on cuda and metal only."""
    if fn is None:
        return lambda f: CompiledStep(f, warn, fuse)
    return CompiledStep(fn, warn, fuse)
