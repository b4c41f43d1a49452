#!/usr/bin/env bash
# One call on a machine of several GPUs: the multi-GPU tests, the collectives' contract on
# every GPU, and the figures of docs/distributed.md (all_reduce against torch.distributed,
# data-parallel scaling, tensor-parallel decode); a short table comes last.
#
#   scripts/gpu2_check.sh            # 2 GPUs;  GPUS=4 scripts/gpu2_check.sh for 4
#
# Logs go to $OUT (default ./gpu2-out). NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and
# the others): on shared hosts a program using it can take the GPUs out of service.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu2-out}
GPUS=${GPUS:-2}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NEEDLE_CACHE_DIR=${NEEDLE_CACHE_DIR:-$OUT/cache}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
t0=$(date +%s)
step() {  # step NAME SECONDS command...: run it with a limit, log it, note its status
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? at $(( $(date +%s) - t0 ))s" >> "$SUMMARY"
}
RUN=("$PY" -m needle.cli run --backend nccl -n)  # then the rank count and the script

nvidia-smi --query-gpu=name --format=csv,noheader >> "$SUMMARY" 2>&1
$PY -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
step tests 400 $PY -m pytest -q tests/distributed/test_nccl.py tests/distributed/test_tensor_parallel.py tests/distributed/test_two_gpus.py tests/distributed/test_tp_serve.py
step contract 120 "${RUN[@]}" "$GPUS" tests/distributed/scripts/collectives_contract.py
step allreduce 120 "${RUN[@]}" "$GPUS" benchmarks/distributed_allreduce.py
step latency 120 "${RUN[@]}" "$GPUS" benchmarks/distributed_allreduce_latency.py
step allreduce_torch 120 "$PY" -m torch.distributed.run --nproc_per_node "$GPUS" benchmarks/distributed_allreduce_torch.py
for n in 1 "$GPUS"; do step "dp$n" 150 "${RUN[@]}" "$n" benchmarks/distributed_dp_step.py; done
for n in 1 "$GPUS"; do step "tp$n" 240 "${RUN[@]}" "$n" benchmarks/distributed_tp_decode.py --tokens 64; done
for n in 1 "$GPUS"; do step "serve$n" 240 "${RUN[@]}" "$n" benchmarks/distributed_tp_serve.py; done

{
  echo; tail -1 "$OUT/tests.log"; grep -h "^ok" "$OUT/contract.log" | sort | tr '\n' ' '; echo
  grep -h "^DP=\|^TP=" "$OUT"/dp*.log "$OUT"/tp*.log "$OUT"/serve*.log
  echo "all_reduce busbw GB/s: needle | torch"
  paste <(grep -E "^ +[0-9]" "$OUT/allreduce.log" | awk '{print $1, $4}') \
        <(grep -E "^ +[0-9]" "$OUT/allreduce_torch.log" | awk '{print $4}')
  grep -A8 "^ *bytes" "$OUT/latency.log"
} >> "$SUMMARY"
cat "$SUMMARY"
