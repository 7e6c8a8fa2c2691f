#!/usr/bin/env bash
# Multi-LoRA on one GPU in one command (about 5 min): the LoRA GPU tests, the LoRA kernels of one
# decode forward against memset + shrink + expand per projection (bench_lora_kernels.py), then
# the engine: W2-like throughput with 0, 8 and 64 adapters and batch-1 decode with and without one
# (bench_lora.py, Llama-3.1-8B shape, random weights). Logs and JSON go to RESULTS_DIR (else
# $OUT, else benchmarks/results/<date>-lora); the tables are printed.
#
#   bash benchmarks/run_lora.sh [RESULTS_DIR]
#   TESTS=0 bash benchmarks/run_lora.sh      # benchmarks only
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
RESULTS=${1:-${OUT:-$HERE/benchmarks/results/$(date -u +%Y%m%d-%H%M%S)-lora}}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
cd "$HERE" && source benchmarks/device_env.sh

if [[ "${TESTS:-1}" != 0 ]]; then  # TESTS=0: the benchmarks alone (a baseline tree)
  echo "=== LoRA GPU tests"
  timeout -s INT -k 15 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rfE \
    tests/kernels/lora tests/lora > "$RESULTS/tests.log" 2>&1
  echo "exit $?"; grep -E "^(FAILED|ERROR)| passed| failed" "$RESULTS/tests.log" | tail -8
fi

echo "=== LoRA kernels of one decode forward"
timeout -k 15 90 "$PY" benchmarks/bench_lora_kernels.py 2>&1 | tee "$RESULTS/kernels.log" | tail -8

echo "=== engine: W2 (1,000 x 128 / 128) and batch-1 decode"
timeout -k 15 300 "$PY" benchmarks/bench_lora.py --num-requests 1000 --adapters 0 8 64 \
  --json "$RESULTS/bench_lora.json" > "$RESULTS/bench_lora.log" 2>&1
echo "exit $?"; tail -8 "$RESULTS/bench_lora.log"
