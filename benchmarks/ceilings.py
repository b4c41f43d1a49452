"""Hardware ceilings, measured rather than taken from a datasheet.

``copy``: the bandwidth of a large device-to-same-device copy (bytes read + written per
second) by the peers (numpy's ``copyto`` is single-threaded, PyTorch's ``copy_`` is not, so the
faster one is the ceiling). A memory-bound case's "% of ceiling" is its rate over this.

``matmul_<dtype>``: the best peer's rate on a large square matmul of that dtype (numpy's BLAS
or PyTorch's, cuBLAS on CUDA) — what the hardware delivers in practice for dense math.

Where no peer runs on the device the copy is measured with needle itself (labelled so) and no
matmul ceiling is given: needle cannot be its own yardstick for compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .frameworks import Framework
from .runner import Context, Impl, Settings, Timing, time_impls


@dataclass
class Ceiling:
    key: str
    rate: float  # bytes/s for copy, FLOP/s for matmul
    source: str  # what was measured, for the table and the JSON
    timing: Timing


def _copy_bytes(ctx: Context) -> int:
    if ctx.quick:
        return 16 << 20
    return (1 << 30) if ctx.gpu else (256 << 20)


def _matmul_size(ctx: Context) -> int:
    if ctx.quick:
        return 256
    return 8192 if ctx.gpu else 2048


def _copy_impl(fw: Framework, src: np.ndarray) -> Impl:
    a = fw.put(src)
    if fw.name == "numpy":
        return Impl(np.copyto, [(fw.put(src), a)])
    if fw.name == "torch":
        return Impl(lambda dst, s: dst.copy_(s), [(fw.put(src), a)])
    return Impl(lambda s: s.copy(), [(a,)])


def _best(ctx: Context, key: str, impls: dict[str, Impl], work: float, what: str,
          settings: Settings) -> Ceiling | None:
    """The fastest of ``impls`` (the ones that ran: a peer lacking a dtype is no yardstick)."""
    timings, _ = time_impls(impls, {n: ctx.frameworks[n].sync for n in impls}, settings)
    for fw in ctx.frameworks.values():
        fw.release()
    if not timings:
        return None
    name, timing = min(timings.items(), key=lambda kv: kv[1].median)
    return Ceiling(key, work / timing.median, f"{name} {what}", timing)


def _measure_copy(ctx: Context, settings: Settings) -> Ceiling | None:
    src = np.random.default_rng(ctx.seed).random(_copy_bytes(ctx) // 4, dtype=np.float32) + 1.0
    peers = [fw for name, fw in ctx.frameworks.items() if name != "needle"]
    impls = {fw.name: _copy_impl(fw, src) for fw in peers or [ctx.frameworks["needle"]]}
    return _best(ctx, "copy", impls, 2 * src.nbytes, f"copy of {src.nbytes >> 20} MiB", settings)


def _measure_matmul(ctx: Context, dtype: str, settings: Settings) -> Ceiling | None:
    n = _matmul_size(ctx)
    rng = np.random.default_rng(ctx.seed)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    impls = {name: Impl(lambda x, y: x @ y, [(fw.put(a, dtype), fw.put(b, dtype))])
             for name, fw in ctx.frameworks.items()
             # numpy has no fast low-precision matmul: not the yardstick there
             if name != "needle" and (name != "numpy" or dtype == "float32")}
    return _best(ctx, f"matmul_{dtype}", impls, 2.0 * n**3, f"{dtype} matmul {n}x{n}x{n}",
                 settings)


def measure(ctx: Context, keys: set[str], settings: Settings
            ) -> tuple[dict[str, Ceiling], dict[str, str]]:
    """The ceilings named in ``keys`` ("copy", "matmul_float32", ...), and why any is missing."""
    found: dict[str, Ceiling] = {}
    missing: dict[str, str] = {}
    for key in sorted(keys):
        try:
            if key == "copy":
                ceiling = _measure_copy(ctx, settings)
            elif key.startswith("matmul_"):
                ceiling = _measure_matmul(ctx, key.removeprefix("matmul_"), settings)
            else:
                raise ValueError(f"unknown ceiling {key!r}; cases may use copy or matmul_<dtype>")
        except Exception as e:  # e.g. out of memory for the large copy: say so, keep the table
            missing[key] = f"{type(e).__name__}: {e}".splitlines()[0]
            continue
        if ceiling is None:
            missing[key] = "no peer could measure it on this device"
        else:
            found[key] = ceiling
    return found, missing
