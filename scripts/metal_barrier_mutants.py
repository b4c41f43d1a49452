"""Barrier mutation testing for the Metal kernels through the MSL emulator (issue #17).

Deletes each ``threadgroup_barrier(...)`` and ``simdgroup_barrier(...)`` call in the Metal
kernel sources, one at a time, runs the emulated tests of that kernel family with the memory
checks on, and reports which deletions the suite catches (killed) and which it does not
(survived). A surviving mutant is a barrier the tests cannot tell is needed: either the
barrier is redundant or the race detector / tests have a blind spot.

    NEEDLE_METAL_EMULATOR=1 is set for the child runs; needs clang++.
    python scripts/metal_barrier_mutants.py            # every barrier
    python scripts/metal_barrier_mutants.py --list     # only list the mutants
    python scripts/metal_barrier_mutants.py --only nn.metal:58

The kernel file is edited in place and restored afterwards (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "src" / "needle" / "backends" / "metal" / "kernels"
BARRIER = re.compile(r"\b(threadgroup_barrier|simdgroup_barrier)\s*\([^;]*\)\s*;")

# the emulated tests that exercise each kernel file's kernels (all on metal())
TESTS = {
    "matmul.metal": ["tests/backend_ndarray/test_matmul.py", "tests/backends/test_metal.py",
                     "tests/backend_ndarray/test_transformer_ops.py"],
    "nn.metal": ["tests/backend_ndarray/test_transformer_ops.py",
                 "tests/backend_ndarray/test_decode_ops.py",
                 "tests/backends/test_attention_head_dims.py", "tests/backends/test_metal.py",
                 "tests/backend_ndarray/test_conformance.py"],
    "reduce.metal": ["tests/backend_ndarray/test_reductions.py",
                     "tests/backend_ndarray/test_conformance.py"],
    "paged.metal": ["tests/backend_ndarray/test_paged.py"],
    "quant.metal": ["tests/backend_ndarray/test_quant.py"],
}
DEFAULT_TESTS = ["tests/backend_ndarray", "tests/backends/test_metal.py",
                 "tests/backends/test_attention_head_dims.py"]


@dataclass
class Mutant:
    file: str
    line: int
    text: str
    start: int
    end: int

    @property
    def name(self) -> str:
        return f"{self.file}:{self.line}"


def mutants() -> list[Mutant]:
    found = []
    for path in sorted(KERNELS.iterdir()):
        if path.suffix not in (".metal", ".h"):
            continue
        source = path.read_text()
        for m in BARRIER.finditer(source):
            line = source.count("\n", 0, m.start()) + 1
            found.append(Mutant(path.name, line, m.group(0), m.start(), m.end()))
    return found


def run_tests(mutant: Mutant, timeout: float) -> tuple[bool, str]:
    """(killed, evidence): run the family's tests on metal() until the first failure."""
    env = dict(os.environ, NEEDLE_METAL_EMULATOR="1")
    env.pop("NEEDLE_METAL_EMULATOR_CHECKS", None)  # the default: bounds and races
    tests = TESTS.get(mutant.file, DEFAULT_TESTS)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "metal",
           *tests]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return True, "timed out (a hang counts as caught)"
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return False, out.strip().splitlines()[-1] if out.strip() else "passed"
    failed = re.search(r"^FAILED (\S+)", out, re.M)
    why = re.search(r"(data race|out-of-bounds|deadlocked|Not equal|Mismatch)[^\n]{0,100}", out)
    return True, (failed.group(1) if failed else "failed") + (f": {why.group(0)}" if why else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", action="append", default=[],
                        help="run only FILE:LINE (repeatable)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant")
    args = parser.parse_args()
    todo = [m for m in mutants() if not args.only or m.name in args.only]
    if args.list:
        for m in todo:
            print(f"{m.name}: {m.text}")
        return 0
    results = []
    for m in todo:
        path = KERNELS / m.file
        original = path.read_text()
        start = time.perf_counter()
        try:
            path.write_text(original[:m.start] + "/* barrier deleted */;" + original[m.end:])
            killed, why = run_tests(m, args.timeout)
        finally:
            path.write_text(original)
        results.append((m, killed, why))
        print(f"{'KILLED  ' if killed else 'SURVIVED'} {m.name:<18} {m.text:<52} "
              f"{time.perf_counter() - start:6.1f}s  {why}", flush=True)
    killed = sum(k for _, k, _ in results)
    print(f"\n{killed}/{len(results)} barrier deletions caught")
    for m, k, _ in results:
        if not k:
            print(f"  survived: {m.name} {m.text}")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
