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
import numbers
import threading
import warnings
from dataclasses import dataclass, field

import numpy as np

from . import step_hooks
from .autograd import Tensor
from .backend_ndarray import NDArray
from .backends.api import has, required_functions
from .errors import ArgumentTypeError, NeedleError

__all__ = ["CompileFallbackWarning", "CompiledStep", "compile"]

_WORK = frozenset(required_functions()) - {"Array", "to_numpy", "synchronize", "from_numpy"}
_HOST_READS = {"to_numpy": ".item()/.numpy() or another read of device data",
               "to_numpy_later": "an asynchronous read of device data",
               "host_view": "a host view of device data (DLPack, numpy)",
               "to_dlpack": "a DLPack export", "synchronize": "a wait for the device"}
_SCALARS = (numbers.Number, str, bytes, type(None), np.generic)


class CompileFallbackWarning(UserWarning):
    """A step ``ndl.compile`` could not record: it runs eagerly (the message says why)."""


class _NotCapturableError(NeedleError):
    pass


def _is_scalar(x) -> bool:
    return isinstance(x, _SCALARS) or (isinstance(x, tuple) and all(map(_is_scalar, x)))


class _Proxy:
    """Stands in for a device's backend while a step is watched: forwards every call, notes
    work calls (name and scalar arguments), uploads, allocations and host reads."""

    def __init__(self, real, recorder: StepRecorder):
        self._real, self._rec = real, recorder
        self.name, self.capabilities = real.name, real.capabilities

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        rec = self._rec
        if name in _WORK:
            def work(*args, **kwargs):
                if threading.get_ident() != rec.thread:  # another thread's work: not ours
                    return attr(*args, **kwargs)
                return rec.work(name, attr, args, kwargs)
            setattr(self, name, work)
            return work
        if name in _HOST_READS:
            def read(*args, **kwargs):
                if threading.get_ident() != rec.thread:
                    return attr(*args, **kwargs)
                rec.not_capturable(f"the step does {_HOST_READS[name]} ({name}); return the "
                                   "value from the step and read it after the call")
                return attr(*args, **kwargs)
            return read
        return attr

    def Array(self, size, dtype="float32"):  # noqa: N802 -- the backend contract's name
        array = self._real.Array(size, dtype)
        if threading.get_ident() != self._rec.thread:
            return array
        return self._rec.allocated(array)

    def from_numpy(self, a, out):
        if threading.get_ident() != self._rec.thread:
            return self._real.from_numpy(a, out)
        return self._rec.upload(a, out)


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


class StepRecorder:
    """Watches (mode "probe"), records ("record", the CPUs) or captures ("capture", devices
    with graphs) one call of the step."""

    def __init__(self, mode: str, backend, previous: StepRecorder | None = None):
        self.mode, self.backend, self.previous = mode, backend, previous
        self.thread = threading.get_ident()  # only this thread's calls are the step's
        self.log: list[tuple] = []  # (name, scalar arguments) of every work call
        self.uploads: list[np.ndarray] = []
        self.allocations: list = []  # strong refs: ids stay unique while we compare
        self.reason: str | None = None
        self.calls: list[tuple] = []  # ("record") the backend calls, in order
        self.segments: list = []
        self.host_calls = 0
        self.params: list = []  # (parameter, buffer handle) of the optimizers stepped
        self.graph_calls = 0  # work calls inside graph segments ("capture")
        self._paused = False
        self._capture = None  # the open capture context ("capture")
        self._staged: list = []  # ("capture") device copies of the previous call's uploads
        self._stale = ({id(a) for a in previous.allocations} if previous is not None
                       else set())

    # --- what the proxy reports ----------------------------------------------------------
    def not_capturable(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        if self.mode == "capture":
            raise _NotCapturableError(reason)

    def allocated(self, array):
        if not self._paused and self.mode == "probe":
            self.allocations.append(array)
        return array

    def work(self, name, fn, args, kwargs):
        if self._paused:
            self.host_calls += 1
            return fn(*args, **kwargs)
        arrays = [a for a in args if not _is_scalar(a)]
        # repr: NaN arguments compare equal, and 1 and 1.0 do not
        self.log.append((name, repr(tuple(a for a in args if _is_scalar(a))),
                         repr(sorted((k, v) for k, v in kwargs.items() if _is_scalar(v)))))
        if self._stale and any(id(a) in self._stale for a in arrays):
            self.not_capturable(
                f"the step reads an array that its previous call made ({name}): state is "
                "carried from call to call by new arrays (BatchNorm running statistics, "
                "gradients accumulated without opt.zero_grad()), which a replay would not "
                "see; zero the gradients in the step, use module.eval() for BatchNorm")
        if self.mode == "record":
            self.calls.append((fn, args, kwargs))
        return fn(*args, **kwargs)

    def upload(self, a: np.ndarray, out) -> None:
        real = self.backend
        if self._paused:
            return real.from_numpy(a, out)
        k = len(self.uploads)
        self.uploads.append(np.array(a, copy=True))
        if self.mode != "probe":
            prev = self.previous.uploads if self.previous is not None else []
            if k >= len(prev) or prev[k].shape != a.shape or prev[k].dtype != a.dtype or \
                    not np.array_equal(prev[k], a, equal_nan=True):
                self.not_capturable(
                    "the step copies host data to the device that differs between calls "
                    "(random numbers drawn on the host, Python values): pass such data as an "
                    "input tensor of the step")
        if self.mode == "capture":
            staged = self._staged[k]
            real.compact(staged, out, (a.size,), (1,), 0)
            return None
        if self.mode == "record":
            self.calls.append((real.from_numpy, (self.uploads[k], out), {}))
        return real.from_numpy(a, out)

    # --- optimizer and scheduler steps ----------------------------------------------------
    def host_step(self, owner, run) -> bool:
        """Run ``owner``'s step now (probe, record) or at replay (capture); in the recording
        it becomes a host segment that restores the gradients it saw and calls ``run``."""
        if threading.get_ident() != self.thread:
            return False  # another thread's optimizer: it steps as usual
        grads = ([(p, p.grad) for p in owner.params] if hasattr(owner, "params") else [])
        if self.mode != "probe":
            self.params += [(p, p.realize_cached_data()._handle) for p, _ in grads]

        def replay_step():
            for p, g in grads:
                p.grad = g
            run()

        if self.mode == "capture":
            self._end_graph()
            self.segments.append(("host", replay_step))
            self._begin_graph()
            return True
        params = getattr(owner, "params", [])
        before = [id(p.realize_cached_data()._handle) for p in params]
        self._paused = True
        try:
            run()
        finally:
            self._paused = False
        if before != [id(p.realize_cached_data()._handle) for p in params]:
            self.not_capturable(f"{type(owner).__name__}.step() replaced the storage of a "
                                "parameter (shared or non-contiguous parameters): the "
                                "recorded forward pass would read the old one")
        if self.mode == "record":
            self.segments.append(("calls", self.calls))
            self.segments.append(("host", replay_step))
            self.calls = []
        return True

    # --- graph segments ("capture") -------------------------------------------------------
    def stage_uploads(self) -> list:
        """Device copies of the previous call's uploads, made before the capture begins."""
        for a in self.previous.uploads:
            buf = self.backend.Array(max(a.size, 1), str(a.dtype) if a.dtype != object
                                     else "float32")
            self.backend.from_numpy(a, buf)
            self._staged.append(buf)
        return self._staged

    def _begin_graph(self) -> None:
        self._capture = self.backend.capture()
        self._graph_start = len(self.log)
        self.segments.append(("graph", self._capture.__enter__()))

    def _end_graph(self, exc=None) -> None:
        cm, self._capture = self._capture, None
        if cm is None:
            return
        if exc is not None:
            cm.__exit__(type(exc), exc, exc.__traceback__)
            return
        cm.__exit__(None, None, None)
        calls = len(self.log) - self._graph_start
        if calls == 0:  # nothing after the optimizer: no graph to launch
            self.segments.pop()[1].close()
        else:
            self.graph_calls += calls

    def finish(self) -> list:
        if self.mode == "record" and self.calls:
            self.segments.append(("calls", self.calls))
        self.calls = []
        return self.segments


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

    def __init__(self, fn, warn: bool = True):
        if not callable(fn):
            raise ArgumentTypeError(f"ndl.compile: fn must be callable, got {type(fn).__name__}")
        self.fn, self.warn = fn, warn
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
        device._backend = _Proxy(real, rec)
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
        rec = StepRecorder("capture" if capture else "record", real, entry.last)
        entry.last = None
        try:
            if capture:
                entry.keep = rec.stage_uploads()
            device._backend = _Proxy(real, rec)
            step_hooks.recorder = rec
            try:
                if capture:
                    rec._begin_graph()
                out = self.fn(*call_args[0], **call_args[1])
                if capture:
                    rec._end_graph()
            except BaseException as e:
                if capture:
                    rec._end_graph(e)
                raise
            finally:
                step_hooks.recorder = None
                device._backend = real
            self._check_same(rec)
        except _NotCapturableError as e:
            return self._eager_after_failure(entry, str(e), args, kwargs)
        except NeedleError as e:
            if not capture:
                raise
            return self._eager_after_failure(entry, f"capture failed: {e}", args, kwargs)
        if rec.reason is not None:  # ("record") noted, not raised: the call itself ran
            self._give_up(entry, rec.reason)
            return out
        entry.segments = rec.finish()
        entry.params = rec.params
        entry.graph_kernels = sum(getattr(cb, "kernels", 0) for kind, cb in entry.segments
                                  if kind == "graph") or rec.graph_calls
        entry.outputs = _map(out, lambda t: t.realize_cached_data()
                             if isinstance(t, Tensor) else t)
        if capture:  # nothing ran yet: the capture only recorded
            self._run_segments(entry)
        return self._fresh_outputs(entry)  # later replays overwrite the recorded outputs

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
                for fn, a, k in item:
                    fn(*a, **k)
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


def compile(fn=None, *, warn: bool = True):  # noqa: A001 -- ndl.compile, as torch.compile
    """Record ``fn`` (a training step: forward, backward, optimizer update) and replay it on
    later calls (see ``needle.compiled``). Use as ``ndl.compile(step)`` or ``@ndl.compile``;
    ``warn=False`` silences the ``CompileFallbackWarning`` of a step that runs eagerly."""
    if fn is None:
        return lambda f: CompiledStep(f, warn)
    return CompiledStep(fn, warn)
