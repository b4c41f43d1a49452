"""The native CPU backend on an idle and on a busy machine (issue 19 item 7).

For each thread setting (needle's defaults: a team sized from the usable cores that sleeps when
idle; OpenMP's spinning wait; one thread) and each load (idle; one busy process per core), times
``needle demo --device cpu`` end to end and the tiny-Llama decode benchmark on ``cpu()``.
Prints a table of medians; the figures are in docs/cpu_notes.md.

    python scripts/cpu_busy.py [--repeat 3] [--busy N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

SETTINGS = {
    "needle default (sized team, passive wait)": {},
    "spinning wait (OMP_WAIT_POLICY=active)": {"OMP_WAIT_POLICY": "active"},
    "one thread (OMP_NUM_THREADS=1)": {"OMP_NUM_THREADS": "1"},
    "short spin (GOMP_SPINCOUNT=3000)": {"GOMP_SPINCOUNT": "3000"},
    "passive wait (OMP_WAIT_POLICY=passive)": {"OMP_WAIT_POLICY": "passive"},
}
SHORT = dict(zip(("default", "spin", "one", "short", "passive"), SETTINGS))
BUSY_LOOP = "while True: pass"


@contextmanager
def busy_processes(count: int):
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]
    try:
        time.sleep(0.5 if count else 0)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _env(extra: dict) -> dict:
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return {**base, **extra}


def demo_seconds(extra: dict, timeout: float) -> float:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "needle.cli", "demo", "--device", "cpu",
                        "--no-progress", "--out", out], env=_env(extra), check=True,
                       timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return time.perf_counter() - start


# The benchmarks' tiny Llama (2 layers, hidden 64) on cpu(), greedy, 256 new tokens a run.
DECODE = """
import statistics, sys, time
import needle.backend_ndarray as nd
from benchmarks.cases_llm import TINY, _random_weights
from needle.models import LlamaConfig, LlamaForCausalLM
raw = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
       "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, **TINY}
config = LlamaConfig.from_dict(raw, source="tiny")
weights = _random_weights(config, "float32")
model = LlamaForCausalLM(config, lambda name, shape: nd.NDArray(weights[name], device=nd.cpu()),
                         512, nd.cpu(), "float32")
model.generate([1, 2, 3], max_new_tokens=16, temperature=0)
rates = []
for _ in range(5):
    start = time.perf_counter()
    out = model.generate([1, 2, 3, 4, 5, 6, 7, 8], max_new_tokens=256, temperature=0)
    rates.append(len(out) / (time.perf_counter() - start))
print(statistics.median(rates))
"""


def demo_seconds_or_timeout(extra: dict, timeout: float) -> float:
    try:
        return demo_seconds(extra, timeout)
    except subprocess.TimeoutExpired:
        return float("inf")


def decode_tok_s(extra: dict, timeout: float) -> float:
    try:
        out = subprocess.run([sys.executable, "-c", DECODE], env=_env(extra), check=True,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 0.0
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="demo runs per cell (median)")
    parser.add_argument("--busy", type=int, default=len(os.sched_getaffinity(0)),
                        help="busy processes for the loaded column (default: one per core)")
    parser.add_argument("--timeout", type=float, default=60,
                        help="seconds after which a run is stopped and reported as inf / 0")
    parser.add_argument("--settings", default="default,spin,one",
                        help="comma-separated subset of: default, spin, one, short, passive")
    args = parser.parse_args()
    chosen = [SHORT[s] for s in args.settings.split(",")]
    rows = []
    for name, extra in ((n, SETTINGS[n]) for n in chosen):
        for busy in (0, args.busy):
            with busy_processes(busy):
                demo = statistics.median(demo_seconds_or_timeout(extra, args.timeout)
                                         for _ in range(args.repeat))
                decode = decode_tok_s(extra, args.timeout)
            rows.append((name, busy, demo, decode))
            print(f"  {name}, {busy} busy: demo {demo:.2f} s, decode {decode:.0f} tok/s",
                  flush=True)
    print(f"\n{os.cpu_count()} cpus; demo = needle demo --device cpu (median of {args.repeat});"
          " decode = tiny Llama, 256 greedy tokens on cpu() (median of 5); inf/0: over --timeout")
    print(f"{'setting':45} {'busy procs':>10} {'demo s':>8} {'decode tok/s':>13}")
    for name, busy, demo, decode in rows:
        print(f"{name:45} {busy:>10} {demo:>8.2f} {decode:>13.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
