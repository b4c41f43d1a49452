"""How many threads the native CPU backend uses, and how they wait: decided before OpenMP starts.

OpenMP reads its settings from the environment once, when its runtime is loaded with the
extension, so ``configure()`` runs just before that import and only fills in what the user
has not set:

* ``OMP_NUM_THREADS``: the cores this process may actually use, the smaller of its CPU affinity
  mask (``taskset``, container cpusets) and its cgroup CPU quota (``docker --cpus``, Kubernetes
  limits). OpenMP alone counts the affinity mask but not the quota, so in a container limited
  to 2 CPUs of a 64-core host it would start 64 threads that take turns on 2 cores.
* ``OMP_WAIT_POLICY=passive``: a thread that finishes its share sleeps instead of spinning. A
  spinning team is a few microseconds faster per parallel region on an idle machine, but on a
  busy one the spinners take the cores that the preempted team member needs, and every barrier
  waits for it: the demo took 26.5 s instead of 1.5 s with other processes running (issue 19;
  docs/cpu_notes.md has the measurements). A user's ``GOMP_SPINCOUNT`` is kept instead: a
  short spin (3000) halves a small model's decode time on an idle machine and costs ~20% on
  a busy one (docs/cpu_notes.md).

``NEEDLE_CPU_THREADS`` overrides the thread count for needle alone (it is applied as
``OMP_NUM_THREADS`` unless that is set too). Small ops never wake the team: the kernels run
on the calling thread below a per-op size (``parallel_for`` in kernels/runtime.cc).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (all online CPUs where the OS has no masks)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no affinity masks
        return os.cpu_count() or 1


def cgroup_cpu_limit(root: Path = _CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (e.g. 2.5), or None when unlimited.

    Reads cgroup v2 (``cpu.max``: "quota period" or "max period") and falls back to v1
    (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, -1 meaning unlimited).
    """
    for quota_file, period_file in ((root / "cpu.max", None),
                                    (root / "cpu" / "cpu.cfs_quota_us",
                                     root / "cpu" / "cpu.cfs_period_us")):
        try:
            text = quota_file.read_text().split()
            if period_file is not None:
                text.append(period_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if len(text) != 2 or text[0] in ("max", "-1"):
            return None
        try:
            quota, period = float(text[0]), float(text[1])
        except ValueError:
            return None
        return quota / period if quota > 0 and period > 0 else None
    return None


def available_cpus(root: Path = _CGROUP_ROOT) -> int:
    """The cores this process can use at once: affinity mask capped by the cgroup quota."""
    cpus = affinity_cpus()
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit)))
    return max(1, cpus)


def configure(environ: dict | None = None) -> dict[str, str]:
    """Fill in OpenMP's thread count and wait policy where the user left them unset.

    Returns the settings it chose (empty when the user set everything). Must run before the
    extension (and with it the OpenMP runtime) is loaded to take effect.
    """
    env = os.environ if environ is None else environ
    chosen = {}
    if "OMP_NUM_THREADS" not in env:
        wanted = env.get("NEEDLE_CPU_THREADS", "").strip()
        chosen["OMP_NUM_THREADS"] = wanted if wanted.isdigit() and int(wanted) > 0 \
            else str(available_cpus())
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        chosen["OMP_WAIT_POLICY"] = "passive"
    env.update(chosen)
    return chosen
