#!/usr/bin/env bash
# One call on a GPU machine: install needle, compile the CUDA kernels, run the CUDA tests,
# run them again under compute-sanitizer memcheck, and benchmark; a short table comes last.
#
#   scripts/gpu_check.sh                      # everything
#   STAGES="test bench" scripts/gpu_check.sh  # a subset, in order: install warm test sanitize bench
#
# Logs go to $OUT (default ./gpu-out); each stage has a time limit so one slow stage cannot
# eat the others' time. Runs offline: the machine needs numpy, ml_dtypes, cuda-bindings,
# scikit-build-core, nanobind and (for the peers) torch and cupy already installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
STAGES=${STAGES:-"install warm test sanitize bench"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export NEEDLE_CACHE_DIR=${NEEDLE_CACHE_DIR:-$OUT/cache}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
stage_time() { local t0=$1; echo $(( $(date +%s) - t0 ))s; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

note "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee -a "$SUMMARY"
$PY - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import importlib.metadata as m, platform
print("python", platform.python_version())
for p in ("cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12", "numpy", "torch", "cupy-cuda13x"):
    try:
        print(p, m.version(p))
    except m.PackageNotFoundError:
        print(p, "-")
from cuda.bindings import nvrtc
print("nvrtc", nvrtc.nvrtcVersion()[1:])
EOF

if has install; then
  t0=$(date +%s)
  if timeout 420 $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1; then
    note "install: ok ($(stage_time $t0))"
  else
    note "install: FAILED ($(stage_time $t0)); using PYTHONPATH=src (cpu() disabled)"
    tail -20 "$OUT/install.log"
    export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
  fi
else
  export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
fi

if has warm; then  # compile the five kernel files in parallel into the disk cache
  t0=$(date +%s)
  $PY - <<'EOF' 2>&1 | tee "$OUT/warm.log" | tail -8
import concurrent.futures as cf, time
def build(family):
    import needle.backend_ndarray as nd
    t = time.time()
    nd.cuda().backend.device.executables.get(family)
    return f"{family}: {time.time() - t:.1f}s"
import needle.backend_ndarray as nd
print(nd.cuda().backend.device.describe() if nd.cuda().enabled() else nd.cuda().reason)
with cf.ProcessPoolExecutor(5) as ex:
    for line in ex.map(build, ["elementwise", "reduce", "matmul", "nn", "layout"]):
        print("compiled", line)
EOF
  note "warm (NVRTC, 5 files in parallel): $(stage_time $t0)"
fi

TESTS="tests/backends tests/hal tests/backend_ndarray tests/ops tests/nn"
if has test; then
  t0=$(date +%s)
  timeout 330 $PY -m pytest -q -p no:cacheprovider --maxfail=40 -k "cuda or hal or test_cuda" \
      $TESTS > "$OUT/test.log" 2>&1
  rc=$?
  note "tests on cuda: rc=$rc ($(stage_time $t0)): $(tail -1 "$OUT/test.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/test.log" | head -25 | tee -a "$SUMMARY"
fi

if has sanitize; then
  t0=$(date +%s)
  timeout 240 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 \
      $PY -m pytest -q -p no:cacheprovider -x tests/backends/test_cuda.py \
      tests/backend_ndarray/test_conformance.py -k "cuda" > "$OUT/sanitize.log" 2>&1
  rc=$?
  note "memcheck: rc=$rc ($(stage_time $t0)): $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitize.log" | tail -2 | tr '\n' ' ')"
fi

if has bench; then
  t0=$(date +%s)
  timeout 300 $PY -m benchmarks --device cuda --json "$OUT/bench.json" > "$OUT/bench.txt" 2> "$OUT/bench.err"
  note "benchmarks: rc=$? ($(stage_time $t0))"
  for v in "NEEDLE_TC_TILE=256" "NEEDLE_CUDA_OPTIONS=-DSGEMM_MIN_BLOCKS=1" "NEEDLE_CUDA_OPTIONS=-DTC_STAGES=3"; do
    env $v timeout 120 $PY -m benchmarks --device cuda --cases 'matmul_*_4096' \
        > "$OUT/bench_variant.txt" 2>/dev/null
    note "variant $v:"
    grep -A1 "^matmul" "$OUT/bench_variant.txt" | grep -E "needle|matmul" | tee -a "$SUMMARY"
  done
  cat "$OUT/bench.txt"
fi
echo
cat "$SUMMARY"
