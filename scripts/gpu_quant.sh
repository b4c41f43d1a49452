#!/usr/bin/env bash
# One call on a GPU machine for quantized weights: install needle, run the quantization tests
# on CUDA (kernels against numpy_ref; quantized checkpoints against transformers), then the
# decode benchmark (benchmarks/quant_decode.py); its table comes last.
#   scripts/gpu_quant.sh            # OUT defaults to ./gpu-out
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NEEDLE_CACHE_DIR=${NEEDLE_CACHE_DIR:-$OUT/cache}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 \
  || { tail -30 "$OUT/install.log"; exit 1; }
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -x -k cuda \
  tests/backend_ndarray/test_quant.py tests/models/test_quantize.py ${EXTRA_TESTS:-} \
  2>&1 | tee "$OUT/tests.log" | tail -15
timeout ${BENCH_TIMEOUT:-300} python3 -m benchmarks.quant_decode --device cuda \
  ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
