#!/usr/bin/env bash
# One device call for the backend-contract change (#12): the CUDA test selection on the new
# layout, then the same benchmark cases on the code before the change (.baseline/, a
# git archive of the parent commit, carried) and after it, in one process each.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NEEDLE_CACHE_DIR=/tmp/nc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
STAGES=warm bash scripts/gpu_check.sh > "$OUT/warm.log" 2>&1; tail -2 "$OUT/warm.log"
PYTHONPATH=$PWD/src timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider \
    --maxfail=20 -k cuda ${TESTS:-tests/backends tests/hal tests/backend_ndarray tests/models} \
    > "$OUT/test.log" 2>&1
echo "tests rc=$?: $(tail -1 "$OUT/test.log")"; grep -E "^(FAILED|ERROR)" "$OUT/test.log" | head -20
CASES=${CASES:-'matmul_*,small_*,mlp_*,sum_*,llm_decode_*'}
if [ -d .baseline/src ]; then
  (cd .baseline && PYTHONPATH=$PWD/src timeout 240 python3 -m benchmarks --device cuda \
      --cases "$CASES" > "$OUT/bench_before.txt" 2>&1; echo "before rc=$?")
fi
PYTHONPATH=$PWD/src timeout 240 python3 -m benchmarks --device cuda --cases "$CASES" \
    > "$OUT/bench_after.txt" 2>&1; echo "after rc=$?"
for f in bench_before bench_after; do echo "== $f"; grep -E "^ceiling|needle|torch " "$OUT/$f.txt" | head -60; done
