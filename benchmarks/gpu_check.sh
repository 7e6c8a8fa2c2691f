#!/usr/bin/env bash
# One device call: GPU tests, kernel benchmark, W1 latency. Logs and JSON go to $OUT.
set -u
export PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
T_TESTS=${T_TESTS:-240} T_KBENCH=${T_KBENCH:-150} T_W1=${T_W1:-100}
timeout "$T_TESTS" python3 -m pytest -q -m gpu tests -p no:cacheprovider -n 4 -rf \
  > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests exit $?"
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -25
timeout "$T_KBENCH" python3 benchmarks/bench_kernels.py --quick --output-json "$OUT/kernels.json" \
  > "$OUT/kernels.log" 2>&1; echo "kernel bench exit $?"
timeout "$T_W1" python3 -m slipstream bench latency --model llama-3.1-8b --load-format dummy \
  --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --output-json "$OUT/W1.json" \
  > "$OUT/W1.log" 2>&1; echo "W1 exit $?"
tail -30 "$OUT/kernels.log"; tail -25 "$OUT/W1.log"
