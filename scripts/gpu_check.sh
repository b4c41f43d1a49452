#!/usr/bin/env bash
# One call on a GPU machine: install needle, compile the CUDA kernels, run the CUDA tests,
# run them again under compute-sanitizer memcheck, and benchmark; a short table comes last.
#
#   scripts/gpu_check.sh                      # everything
#   STAGES="test bench" scripts/gpu_check.sh  # a subset of: install warm test sanitize sass
#                                             # bench profile (always run in that order)
#
# Logs go to $OUT (default ./gpu-out); each stage has a time limit so one slow stage cannot
# eat the others' time. Runs offline: the machine needs numpy, ml_dtypes, cuda-bindings,
# scikit-build-core, nanobind and (for the peers) torch and cupy already installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
STAGES=${STAGES:-"install warm test sanitize sass bench profile"}
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

install() {
  local t0=$(date +%s)
  if timeout 420 $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1; then
    echo "install: ok ($(stage_time $t0))" > "$OUT/install.status"
  else
    echo "install: FAILED ($(stage_time $t0)), see install.log" > "$OUT/install.status"
  fi
}
if has install && [ -n "${INSTALL_BG:-}" ]; then
  # build and install alongside the other stages, which import needle from src/ meanwhile
  install &
  INSTALL_PID=$!
  export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
elif has install; then
  install
  cat "$OUT/install.status" | tee -a "$SUMMARY"
  grep -q FAILED "$OUT/install.status" && export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
else
  export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
fi

if has warm; then  # compile the kernel files in parallel into the disk cache
  t0=$(date +%s)
  $PY - <<'EOF' 2>&1 | tee "$OUT/warm.log" | tail -8
import concurrent.futures as cf, subprocess, time
from needle.backends.cuda.compiler import KERNEL_DIR, precompile
cc = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                    capture_output=True, text=True).stdout.split()[0]
capability = int(cc.replace(".", ""))
families = sorted(p.stem for p in KERNEL_DIR.glob("*.cu"))
# forked workers: nothing here has touched the driver, and NVRTC needs none
with cf.ProcessPoolExecutor(len(families)) as ex:
    t = time.time()
    for line in ex.map(precompile, families, [capability] * len(families)):
        print(f"compiled {line} ({time.time() - t:.1f}s)")
EOF
  note "warm (NVRTC, kernel files in parallel): $(stage_time $t0)"
fi

TESTS=${TESTS:-"tests/backends tests/hal tests/backend_ndarray tests/ops tests/nn"}
if has test; then
  t0=$(date +%s)
  timeout ${TEST_TIMEOUT:-330} $PY -m pytest -q -p no:cacheprovider --maxfail=40 -k "cuda or hal or test_cuda" \
      $TESTS > "$OUT/test.log" 2>&1
  rc=$?
  note "tests on cuda: rc=$rc ($(stage_time $t0)): $(tail -1 "$OUT/test.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/test.log" | head -25 | tee -a "$SUMMARY"
fi

if has sanitize; then
  # SANITIZE_SHARDS=N: the selected tests split round-robin into N processes, each under its
  # own compute-sanitizer, all at once on the one GPU (memcheck's cost is mostly per-launch
  # host work, so shards finish the suite about N times sooner)
  t0=$(date +%s)
  SEL=${SANITIZE_TESTS:-tests/backends/test_cuda.py tests/backends/test_cuda_tma.py tests/backend_ndarray/test_conformance.py}
  SHARDS=${SANITIZE_SHARDS:-1}
  $PY -m pytest -q -p no:cacheprovider --collect-only $SEL -k "cuda and not out_of_memory" \
      2>/dev/null | grep "::" > "$OUT/sanitize_ids.txt"
  rm -f "$OUT"/sanitize_shard_*
  awk -v n="$SHARDS" -v out="$OUT/sanitize_shard_" '{ print > (out (NR % n) ".ids") }' \
      "$OUT/sanitize_ids.txt"
  for f in "$OUT"/sanitize_shard_*.ids; do
    # (the OOM test's failing cuMemAlloc would count as an API error: it is deselected)
    ( mapfile -t ids < "$f"
      timeout ${SANITIZE_TIMEOUT:-240} compute-sanitizer --tool memcheck --leak-check no \
          --error-exitcode 9 $PY -m pytest -v -p no:cacheprovider "${ids[@]}" \
          > "${f%.ids}.log" 2>&1
      echo $? > "${f%.ids}.rc" ) &
  done
  wait
  note "memcheck: $(wc -l < "$OUT/sanitize_ids.txt") tests in $SHARDS shard(s), $(stage_time $t0)"
  for f in "$OUT"/sanitize_shard_*.log; do
    note "  $(basename "$f" .log): rc=$(cat "${f%.log}.rc") $(grep -E 'ERROR SUMMARY' "$f" | tail -1) | $(grep -E '[0-9]+ (passed|failed)' "$f" | tail -1)"
    grep -q "ERROR SUMMARY: 0 errors" "$f" || grep -E -B3 -A14 "^========= [A-Z]" "$f" \
        | grep -v "^=========     Host Frame" | head -60 | tee -a "$SUMMARY"
  done
fi

if has sass; then  # are the matrix instructions we meant there? (HOPPER.md)
  for f in "$NEEDLE_CACHE_DIR"/cuda/*.cubin; do
    n=$(cuobjdump -sass "$f" 2>/dev/null | grep -c -E "HGMMA|HMMA" || true)
    if [ "$n" != "0" ]; then
      note "sass $(basename "$f" | cut -c1-12): HGMMA $(cuobjdump -sass "$f" | grep -c HGMMA), HMMA $(cuobjdump -sass "$f" | grep -c HMMA)"
    fi
  done
fi

if has profile; then  # host or device: where do the MLP step and a 4096² sum spend time?
  for c in mlp sum; do
    timeout 120 $PY scripts/profile_host.py --device cuda --case $c --calls 20 --top 16 2>&1 \
        | tee "$OUT/profile_$c.txt" | head -48
  done
fi

if has bench; then
  t0=$(date +%s)
  timeout ${BENCH_TIMEOUT:-300} $PY -m benchmarks --device cuda --cases "${BENCH_CASES:-*}" \
      --json "$OUT/bench.json" \
      > "$OUT/bench.txt" 2> "$OUT/bench.err"
  note "benchmarks: rc=$? ($(stage_time $t0))"
  for v in ${VARIANTS-} ; do  # e.g. VARIANTS="NEEDLE_TC_TILE=256 NEEDLE_CUDA_OPTIONS=-DTC_STAGES=3"
    env $v timeout 120 $PY -m benchmarks --device cuda --cases 'matmul_*_4096' \
        > "$OUT/bench_variant.txt" 2>/dev/null
    note "variant $v:"
    grep -A1 "^matmul" "$OUT/bench_variant.txt" | grep -E "needle|matmul" | tee -a "$SUMMARY"
  done
  cat "$OUT/bench.txt"
fi
if [ -n "${INSTALL_PID:-}" ]; then
  wait "$INSTALL_PID"
  cat "$OUT/install.status" | tee -a "$SUMMARY"
fi
echo
cat "$SUMMARY"
