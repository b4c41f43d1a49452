"""What ``ndl.compile`` uses to watch and record one call of a step (``compiled.py``).

``BackendProxy`` stands in for a device's backend during the call: every array-API call, upload,
allocation and host read goes through it to a ``StepRecorder``, which notes them ("probe"),
keeps the calls for a Python replay ("record", the CPUs), lets the device capture them into
command buffers ("capture", backends with ``graphs``) or keeps them without running them, to
be fused and then captured ("defer", ``needle.fusion``), and turns optimizer and scheduler
steps into host segments (``step_hooks``).
"""

from __future__ import annotations

import numbers
import threading
import weakref

import numpy as np

from .backends.api import capability_functions, required_functions
from .errors import NeedleError
from .fusion.call import Call

# a backend's public functions that are neither device work nor host reads (tests/
# test_compile.py checks every backend's functions against these lists)
SERVICES = frozenset(("capture", "dlpack_device", "empty_cache", "from_dlpack",
                      "memory_available", "memory_stats", "precompile", "profile", "tuned",
                      "wait_precompiled", "cached_bytes", "kernels", "num_threads", "wrap",
                      "load", "attention_backward_supported"))
_HOST_READS = {"to_numpy": ".item()/.numpy() or another read of device data",
               "to_numpy_later": "an asynchronous read of device data",
               "host_view": "a host view of device data (DLPack, numpy)",
               "to_dlpack": "a DLPack export", "synchronize": "a wait for the device"}
# device work: every function of the array API and of the capabilities' protocols (a
# replay, a capture and fusion's deferral must see each in its place; a new capability's
# functions are work without a list to update here)
_WORK = ((frozenset(required_functions()) | frozenset(capability_functions())) - SERVICES
         - set(_HOST_READS) - {"Array", "from_numpy"})
_SCALARS = (numbers.Number, str, bytes, type(None), np.generic)


class NotCapturableError(NeedleError):
    """Raised inside a capture to abandon it (the message is the fallback reason)."""


def _is_scalar(x) -> bool:
    return isinstance(x, _SCALARS) or (isinstance(x, tuple) and all(map(_is_scalar, x)))


class BackendProxy:
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


class StepRecorder:
    """Watches (mode "probe"), records ("record", the CPUs), captures ("capture", devices
    with graphs) or defers ("defer": kept, not run, for fusion) one call of the step."""

    def __init__(self, mode: str, backend, previous: StepRecorder | None = None):
        self.mode, self.backend, self.previous = mode, backend, previous
        self.thread = threading.get_ident()  # only this thread's calls are the step's
        self.log: list[tuple] = []  # (name, scalar arguments) of every work call
        self.uploads: list[np.ndarray] = []
        # ("probe") the arrays it made, by weak reference (its temporaries and what the
        # caller drops are freed as they would be eagerly); when the next call is compared
        # with it, ``keep_survivors`` holds those still alive, so that their ids stay unique
        # meanwhile (an array that died cannot be read by a later call)
        self.allocations: list = []
        self._survivors_held = False
        self.reason: str | None = None
        self.calls: list[Call] = []  # ("record", "defer") the backend calls, in order
        self.segments: list = []
        self.host_calls = 0
        self.params: list = []  # (parameter, buffer handle) of the optimizers stepped
        self.graph_calls = 0  # work calls inside graph segments ("capture")
        self.returned: str | None = None  # ("probe") a work call that returned a value
        self._paused = False
        self._capture = None  # the open capture context ("capture")
        self._staged: list = []  # ("capture") device copies of the previous call's uploads
        if previous is not None:
            previous.keep_survivors()
        self._stale = ({id(a) for a in previous.allocations} if previous is not None
                       else set())

    # --- what the proxy reports ----------------------------------------------------------
    def not_capturable(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        if self.mode in ("capture", "defer"):  # nothing has run: the step runs eagerly
            raise NotCapturableError(reason)

    def allocated(self, array):
        if not self._paused and self.mode == "probe":
            try:
                self.allocations.append(weakref.ref(array))
            except TypeError:  # a backend array without weak references: held
                self.allocations.append(lambda a=array: a)
        return array

    def keep_survivors(self) -> None:
        """The arrays the probed call made that are still alive, held (once)."""
        if not self._survivors_held:
            self.allocations = [a for a in (ref() for ref in self.allocations)
                                if a is not None]
            self._survivors_held = True

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
        if self.mode == "defer":
            self.calls.append(Call(name, fn, args, kwargs))
            return None
        if self.mode == "record":
            self.calls.append(Call(name, fn, args, kwargs))
        result = fn(*args, **kwargs)
        if result is not None and self.returned is None:
            self.returned = name  # a value the step reads: such calls cannot be deferred
        return result

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
        if self.mode == "defer":
            self.calls.append(Call("compact", real.compact,
                                   (self._staged[k], out, (a.size,), (1,), 0), {}))
            return None
        if self.mode == "record":
            self.calls.append(Call("from_numpy", real.from_numpy, (self.uploads[k], out), {}))
        return real.from_numpy(a, out)

    def defer(self, run, arrays) -> bool:
        """Keep ``run`` (device work outside the backend) back in "defer" mode, as a call that
        may read and write each of ``arrays`` (step_hooks.deferred)."""
        if self.mode != "defer" or self._paused or threading.get_ident() != self.thread:
            return False
        handles = tuple(a.realize_cached_data()._handle if hasattr(a, "realize_cached_data")
                        else a._handle for a in arrays)
        self.calls.append(Call("outside_backend", lambda *_: run(), handles, {}))
        return True

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
        if self.mode == "defer":  # runs at replay, after the calls made so far
            self.segments.append(("calls", self.calls))
            self.segments.append(("host", replay_step))
            self.calls = []
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
        if self.mode in ("record", "defer") and self.calls:
            self.segments.append(("calls", self.calls))
        self.calls = []
        return self.segments
