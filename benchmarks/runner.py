"""The runner: what a case is, how cases are found, and how one is timed.

Every framework runs a case in this one process on the same data (the same random numpy input
sets, copied to each framework's device). A time is the median of ``repeat`` samples taken after
a warm-up; each sample is bracketed by the framework's synchronize so it covers the work and not
just the enqueue. Calls shorter than ``Settings.min_sample_s`` are run ``inner`` times per sample
(one sync at the end) and divided, so that a sample is not all timer and sync overhead; this is
also how the dispatch or launch overhead of tiny ops is measured. Before timing, needle's result
on the first input set is compared with a peer's, so a fast wrong kernel shows up as wrong
rather than fast.
"""

from __future__ import annotations

import gc
import importlib
import math
import pkgutil
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import numpy as np

from needle.backend_ndarray import Device

from .frameworks import Framework

ROTATE_BELOW_BYTES = 64 << 20  # input sets smaller than this (last-level cache sized) rotate
MAX_INPUT_SETS = 8
MAX_INNER = 10_000
MIN_SAMPLES = 3  # kept even when a sample overruns the time budget


class Skip(Exception):  # noqa: N818 - it is a signal, not an error
    """Raised by a case's ``build`` when the case cannot run here; the message says why."""


@dataclass
class Impl:
    """One framework's version of a case: ``fn(*inputs[i])`` for input set ``i``."""

    fn: Callable[..., Any]
    inputs: list[tuple]

    def call(self, i: int):
        return self.fn(*self.inputs[i % len(self.inputs)])


@dataclass
class Bench:
    """What a case's ``build`` returns: its implementations and the work one call does.

    The work sets the rate column. ``bytes`` (read + written per call) makes the case
    memory-bound, rated in GB/s against the measured copy bandwidth; ``flops`` rates it in
    FLOP/s against ``ceiling``, the peer's matmul rate of one dtype (``"matmul_float32"``);
    ``count`` of ``count_unit`` (e.g. 1 "tok") rates it in those per second, with no ceiling.
    ``rtol`` bounds needle's normwise error against the first peer,
    max|needle - peer| / max|peer|; None skips the check (e.g. training, where the frameworks
    start from different weights).
    """

    impls: dict[str, Impl]
    bytes: int | None = None
    flops: float | None = None
    count: float | None = None
    count_unit: str = ""
    ceiling: str | None = None
    rtol: float | None = 1e-4
    notes: list[str] = field(default_factory=list)  # printed under the table (e.g. set-up times)
    # more notes, made after timing (e.g. a compiled step's launch counts)
    later_notes: Callable[[], list[str]] | None = None

    def __post_init__(self):
        if self.ceiling is None and self.bytes is not None:
            self.ceiling = "copy"

    @property
    def work(self) -> tuple[float, str] | None:
        """(amount, unit) of work per call: unit "B", "FLOP" or ``count_unit``."""
        if self.bytes is not None:
            return float(self.bytes), "B"
        if self.flops is not None:
            return float(self.flops), "FLOP"
        if self.count is not None:
            return float(self.count), self.count_unit or "op"
        return None


@dataclass
class Context:
    """What a case module sees: the device, the frameworks present, and whether to go small."""

    device: Device
    frameworks: dict[str, Framework]
    quick: bool = False
    seed: int = 0

    @property
    def kind(self) -> str:
        return self.device.kind

    @property
    def gpu(self) -> bool:
        return self.kind in ("cuda", "metal")

    def input_sets(self, make: Callable[[np.random.Generator], tuple[np.ndarray, ...]]
                   ) -> list[tuple[np.ndarray, ...]]:
        """Random input sets from ``make(rng)``: several when one set fits in cache.

        Rotating among sets keeps a small case from timing the very same arrays, hot in the
        nearest cache, call after call; a large set is read from memory anyway, so it stays
        single (and memory on a GPU is not spent on copies).
        """
        rng = np.random.default_rng(self.seed)
        first = make(rng)
        size = max(1, sum(a.nbytes for a in first))
        count = min(MAX_INPUT_SETS, max(1, ROTATE_BELOW_BYTES // size))
        return [first] + [make(rng) for _ in range(count - 1)]

    def bind(self, ops: dict[str, Callable], sets: list[tuple[np.ndarray, ...]],
             dtype: str = "float32") -> dict[str, Impl]:
        """An Impl per framework present among ``ops``, each over its copy of ``sets``."""
        return {name: Impl(ops[name], [tuple(fw.put(a, dtype) for a in s) for s in sets])
                for name, fw in self.frameworks.items() if name in ops}


@dataclass(frozen=True)
class Case:
    """A named benchmark; ``build(ctx)`` makes its inputs and implementations (or raises Skip)."""

    name: str
    group: str
    build: Callable[[Context], Bench]


# --- finding and choosing cases --------------------------------------------------------------

def discover(ctx: Context) -> tuple[list[Case], dict[str, str]]:
    """Cases from every ``benchmarks/cases_*.py``, and the modules that failed to import.

    A module exposes ``cases(ctx) -> list[Case]`` (sizes may depend on the device) or a plain
    ``CASES`` list.
    """
    cases: list[Case] = []
    broken: dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
        if not info.name.startswith("cases_"):
            continue
        try:
            module = importlib.import_module(f"{__package__}.{info.name}")
            if hasattr(module, "cases"):
                found = module.cases(ctx)
            elif hasattr(module, "CASES"):
                found = module.CASES
            else:
                raise TypeError("it defines neither cases(ctx) nor CASES")
        except Exception as e:  # one broken plug-in must not stop the others
            broken[info.name] = f"{type(e).__name__}: {e}"
            continue
        cases.extend(found)
    return cases, broken


def select(cases: list[Case], patterns: Iterable[str] | None) -> list[Case]:
    """Cases whose name or group matches one of ``patterns`` (globs: ``sum``, ``matmul_f32_*``)."""
    pats = [p.strip() for p in patterns or () if p.strip()]
    if not pats:
        return list(cases)
    return [c for c in cases if any(fnmatchcase(c.name, p) or fnmatchcase(c.group, p)
                                    for p in pats)]


# --- timing -----------------------------------------------------------------------------------

@dataclass
class Settings:
    repeat: int = 10
    min_sample_s: float = 5e-3  # shorter calls are batched to at least this per sample
    budget_s: float = 30.0  # per case; sampling stops early past it (after MIN_SAMPLES rounds)
    settle_s: float = 0.0  # idle time before each sample, see time_impls


@dataclass
class Timing:
    samples: list[float]  # seconds per call, one entry per sample
    inner: int  # calls per sample

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def _warm_up(impl: Impl, sync: Callable[[], None], settings: Settings) -> int:
    """Run once per input set (compiles kernels, faults pages in, fills pools); return ``inner``."""
    for i in range(len(impl.inputs)):
        impl.call(i)
    sync()
    start = time.perf_counter()
    impl.call(0)
    sync()
    once = time.perf_counter() - start
    if once >= settings.min_sample_s:
        return 1
    return min(MAX_INNER, math.ceil(settings.min_sample_s / max(once, 1e-9)))


def _sample(impl: Impl, sync: Callable[[], None], inner: int, first_call: int) -> float:
    sync()
    start = time.perf_counter()
    for k in range(first_call, first_call + inner):
        impl.call(k)
    sync()
    return (time.perf_counter() - start) / inner


def time_impls(impls: dict[str, Impl], syncs: dict[str, Callable[[], None]],
               settings: Settings) -> tuple[dict[str, Timing], dict[str, str]]:
    """Time implementations of one computation, their samples interleaved round by round.

    Interleaving makes the comparison fair on a machine whose speed drifts (a shared VM, a
    GPU warming up): every framework gets samples from the same stretch of time. The order
    rotates from round to round, because the first sample of a round is not like the others:
    it follows the host's work between rounds, and an H100 runs its first milliseconds of
    GEMMs after such a pause at a higher clock (the same kernel measured 5% faster in the
    first place than in the third: docs/cuda_notes.md v28). Before each
    sample the runner idles ``settle_s``, so that the thread pools of the framework sampled
    before (OpenBLAS, OpenMP) stop busy-waiting; on a CPU with few cores those spinning
    threads would otherwise steal the cores. Returns the timings and, for implementations
    that raised, the error.
    """
    errors: dict[str, str] = {}
    inner: dict[str, int] = {}
    for name, impl in impls.items():
        try:
            time.sleep(settings.settle_s)
            inner[name] = _warm_up(impl, syncs[name], settings)
        except Exception as e:  # e.g. a dtype this device lacks: report it, time the others
            errors[name] = _error_text(e)
    samples: dict[str, list[float]] = {name: [] for name in inner}
    start = time.perf_counter()
    for rnd in range(settings.repeat):
        names = [n for n in samples if n not in errors]
        turn = rnd % len(names) if names else 0
        for name in names[turn:] + names[:turn]:
            time.sleep(settings.settle_s)
            try:
                samples[name].append(_sample(impls[name], syncs[name], inner[name],
                                             rnd * inner[name]))
            except Exception as e:
                errors[name] = _error_text(e)
        if rnd + 1 >= MIN_SAMPLES and time.perf_counter() - start > settings.budget_s:
            break
    timings = {n: Timing(s, inner[n]) for n, s in samples.items() if n not in errors}
    return timings, errors


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def normwise_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max|actual - expected| / max|expected| in float64 over the finite expected values.

    inf when the shapes differ or the non-finite values (nan, ±inf) disagree. Copies are made
    only where the data has non-finite values, since a GPU case's output can be gigabytes.
    """
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return math.inf
    fin = np.isfinite(e)
    if not fin.all():
        if not np.array_equal(a[~fin], e[~fin], equal_nan=True):
            return math.inf
        a, e = a[fin], e[fin]
    if a.size == 0:
        return 0.0
    if not np.isfinite(a).all():
        return math.inf
    scale = max(float(np.abs(e).max()), np.finfo(np.float64).tiny)
    return float(np.abs(a - e).max()) / scale


# --- running ----------------------------------------------------------------------------------

@dataclass
class ImplResult:
    timing: Timing | None = None
    error: str | None = None  # why this framework could not run the case


@dataclass
class CaseResult:
    name: str
    group: str
    impls: dict[str, ImplResult] = field(default_factory=dict)
    work: tuple[float, str] | None = None  # per call: (amount, unit), see Bench.work
    ceiling: str | None = None
    rtol: float | None = None
    check_peer: str | None = None  # the peer needle's result was compared with
    check_error: float | None = None  # needle's normwise error against it
    peer_errors: dict[str, float] = field(default_factory=dict)  # ... against every peer
    skipped: str | None = None  # why the case did not run at all
    notes: list[str] = field(default_factory=list)  # the case's own remarks (Bench.notes)

    @property
    def wrong(self) -> bool:
        return (self.check_error is not None and self.rtol is not None
                and not self.check_error <= self.rtol)

    def median(self, fw: str) -> float | None:
        r = self.impls.get(fw)
        return r.timing.median if r and r.timing else None

    def rate(self, fw: str) -> float | None:
        """Work units per second at ``fw``'s median time (None for time-only cases)."""
        t = self.median(fw)
        return self.work[0] / t if t and self.work else None

    def ratio(self, peer: str) -> float | None:
        """needle's median over ``peer``'s: below 1 means needle is faster."""
        mine, theirs = self.median("needle"), self.median(peer)
        return mine / theirs if mine and theirs else None


def _framework(ctx: Context, impl: str) -> Framework:
    """The framework an implementation runs on: its name, or the part before a colon
    ("needle:greedy" is needle, run another way, timed beside the case's needle)."""
    return ctx.frameworks[impl.partition(":")[0]]


def run_case(case: Case, ctx: Context, settings: Settings) -> CaseResult:
    result = CaseResult(case.name, case.group)
    try:
        bench = case.build(ctx)
    except Skip as e:
        result.skipped = str(e)
        return result
    except Exception as e:  # a case that cannot even build its inputs is reported, not fatal
        result.skipped = f"could not build: {_error_text(e)}"
        return result
    result.work, result.ceiling, result.rtol = bench.work, bench.ceiling, bench.rtol
    result.notes = list(bench.notes)
    outputs: dict[str, np.ndarray] = {}
    errors: dict[str, str] = {}
    if bench.rtol is not None:
        for name, impl in bench.impls.items():
            try:
                outputs[name] = _framework(ctx, name).to_numpy(impl.call(0))
            except Exception as e:  # e.g. a dtype this device lacks: report it, keep going
                errors[name] = _error_text(e)
    timed = {n: impl for n, impl in bench.impls.items() if n not in errors}
    timings, timing_errors = time_impls(timed, {n: _framework(ctx, n).sync for n in timed},
                                        settings)
    errors.update(timing_errors)
    result.impls = {n: ImplResult(timings.get(n), errors.get(n)) for n in bench.impls}
    if bench.later_notes is not None:
        try:
            result.notes += list(bench.later_notes())
        except Exception as e:  # notes are extra: their failure is reported, not fatal
            result.notes.append(f"notes failed: {_error_text(e)}")
    peers = [n for n in outputs if n != "needle"]
    if "needle" in outputs and peers:
        result.peer_errors = {p: normwise_error(outputs["needle"], outputs[p]) for p in peers}
        result.check_peer = peers[0]
        result.check_error = result.peer_errors[peers[0]]
    del bench, outputs
    gc.collect()
    for fw in ctx.frameworks.values():
        fw.release()
    return result


def run_all(cases: list[Case], ctx: Context, settings: Settings,
            on_done: Callable[[int, int, CaseResult, float], None]) -> list[CaseResult]:
    """Run ``cases`` in order; ``on_done(i, n, result, seconds)`` after each (for progress)."""
    results = []
    for i, case in enumerate(cases, 1):
        start = time.perf_counter()
        results.append(run_case(case, ctx, settings))
        on_done(i, len(cases), results[-1], time.perf_counter() - start)
    return results
