"""What the runner prints and writes: the machine, the table, the JSON, the progress lines."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from .ceilings import Ceiling
from .frameworks import Framework
from .runner import CaseResult, Settings


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # not Linux: platform knows less, but something
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def machine(frameworks: dict[str, Framework]) -> dict:
    """The hardware and software a run measured, so that numbers can be compared later."""
    threads_env = {k: v for k, v in os.environ.items()
                   if k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                            "NEEDLE_DEVICE", "CUDA_VISIBLE_DEVICES")}
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": _memory_bytes(),
        # taken before the run: other work on the machine makes every time here slower
        "load_average_before": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "env": threads_env,
        "frameworks": {name: fw.describe() for name, fw in frameworks.items()},
    }


# --- units ------------------------------------------------------------------------------------

def format_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def format_rate(rate: float, unit: str) -> str:
    """``rate`` units per second: GB/s for bytes, G/TFLOP/s for FLOPs, else as counted."""
    if unit == "B":
        return f"{rate / 1e9:.1f} GB/s"
    if unit == "FLOP":
        return f"{rate / 1e12:.2f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"
    return f"{rate:.4g} {unit}/s"


def describe_ceiling(c: Ceiling) -> str:
    what = "copy bandwidth" if c.key == "copy" else c.key.replace("_", " ")
    return f"{what} {format_rate(c.rate, 'B' if c.key == 'copy' else 'FLOP')} ({c.source})"


def progress_line(i: int, n: int, res: CaseResult, seconds: float) -> str:
    if res.skipped:
        summary = f"skipped: {res.skipped}"
    else:
        summary = "  ".join(f"{fw} {format_time(r.timing.median) if r.timing else 'failed'}"
                            for fw, r in res.impls.items())
        summary += "  WRONG RESULT" if res.wrong else ""
    return f"[{i:>{len(str(n))}}/{n}] {res.name}: {summary} ({seconds:.1f} s)"


# --- the table --------------------------------------------------------------------------------

def _check_text(res: CaseResult, fw: str) -> str:
    """needle's row: its error against the checked peer; another peer's row: how far that
    peer's result is from needle's (information only: the first peer decides WRONG)."""
    if res.check_error is None:
        return ""
    if fw == "needle":
        verdict = "WRONG" if res.wrong else "ok"
        return f"{verdict} ({res.check_error:.0e} vs {res.check_peer})"
    err = res.peer_errors.get(fw)
    if fw == res.check_peer or err is None:
        return ""
    agrees = res.rtol is None or err <= res.rtol
    return f"{'agrees' if agrees else 'DIFFERS'} ({err:.0e} vs needle)"


def table(results: list[CaseResult], ceilings: dict[str, Ceiling], device_name: str,
          settings: Settings, info: dict) -> str:
    """The results as text: one block of rows per case, one row per framework."""
    gpu = info["frameworks"].get("torch", {}).get("gpu")
    lines = [f"needle benchmarks on {device_name}: {info['cpu']}, {info['cpus_usable']} cpus"
             + (f", {gpu}" if gpu else ""),
             f"median of {settings.repeat} device-synchronized samples after warm-up; "
             f"needle÷peer < 1 means needle is faster"]
    load, cpus = info.get("load_average_before"), info["cpus_usable"] or info["cpu_count"]
    if load and cpus and load[0] > cpus / 2:
        lines.append(f"warning: the machine was busy before the run (load average {load[0]:.1f} "
                     f"on {cpus} cpus); times are likely slow and noisy")
    for c in ceilings.values():
        lines.append(f"ceiling: {describe_ceiling(c)}")
    for key, why in info.get("missing_ceilings", {}).items():
        lines.append(f"ceiling: {key} not measured: {why}")
    header = ("case", "impl", "median", "rate", "% ceil", "needle÷impl", "check")
    rows: list[tuple[str, ...]] = []
    for res in results:
        if res.skipped:
            rows.append((res.name, "—", "skipped", res.skipped, "", "", ""))
            continue
        ceiling = ceilings.get(res.ceiling or "")
        for j, (fw, r) in enumerate(res.impls.items()):
            name = res.name if j == 0 else ""
            if r.timing is None:
                rows.append((name, fw, "failed", r.error or "", "", "", ""))
                continue
            rate = res.rate(fw)
            rows.append((
                name, fw, format_time(r.timing.median),
                format_rate(rate, res.work[1]) if rate and res.work else "",
                f"{100 * rate / ceiling.rate:.0f}%" if rate and ceiling else "",
                f"{res.ratio(fw):.3g}" if fw != "needle" and res.ratio(fw) else "",
                _check_text(res, fw),
            ))
    regular = [r for r in rows if r[2] not in ("skipped", "failed")]
    widths = [max([len(h)] + [len(r[i]) for r in (rows if i < 3 else regular)])
              for i, h in enumerate(header)]
    lines.append("")
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    for r in rows:
        if r[2] in ("skipped", "failed"):  # the reason runs on past the narrow columns
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
        else:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    noted: dict[str, list[str]] = {}  # a note shared by several cases is printed once
    for res in results:
        for note in res.notes:
            names = noted.setdefault(note, [])
            if res.name not in names:
                names.append(res.name)
    notes = [f"note ({', '.join(names)}): {note}" for note, names in noted.items()]
    return "\n".join(lines + ([""] + notes if notes else []))


# --- JSON -------------------------------------------------------------------------------------

def to_json(results: list[CaseResult], ceilings: dict[str, Ceiling], device_name: str,
            settings: Settings, info: dict, quick: bool, broken: dict[str, str]) -> dict:
    """Everything measured, raw samples included, for later comparison or plotting."""
    out_cases = []
    for res in results:
        entry = {"name": res.name, "group": res.group, "skipped": res.skipped,
                 "work_per_call": res.work[0] if res.work else None,
                 "work_unit": res.work[1] if res.work else None, "ceiling": res.ceiling,
                 "notes": res.notes,
                 "check": {"peer": res.check_peer, "normwise_error": res.check_error,
                           "rtol": res.rtol, "ok": not res.wrong,
                           "peers": res.peer_errors},
                 "impls": {}}
        for fw, r in res.impls.items():
            entry["impls"][fw] = {
                "error": r.error,
                "samples_s": r.timing.samples if r.timing else None,
                "calls_per_sample": r.timing.inner if r.timing else None,
                "median_s": r.timing.median if r.timing else None,
                "rate": res.rate(fw),
                "needle_over_this": res.ratio(fw) if fw != "needle" else None,
            }
        out_cases.append(entry)
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device_name,
        "settings": {"repeat": settings.repeat, "min_sample_s": settings.min_sample_s,
                     "budget_s": settings.budget_s, "settle_s": settings.settle_s,
                     "quick": quick},
        "machine": info,
        "ceilings": {k: {"rate": c.rate, "unit": "B/s" if k == "copy" else "FLOP/s",
                         "source": c.source, "samples_s": c.timing.samples,
                         "median_s": c.timing.median} for k, c in ceilings.items()},
        "cases": out_cases,
        "broken_case_modules": broken,
    }


def write_json(path: str | os.PathLike, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
