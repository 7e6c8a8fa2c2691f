#!/usr/bin/env bash
# One device call (~8 min) to decide async_scheduling's default: its GPU tests, then W2 fp8 +
# fp8 KV without and with --async-scheduling on the same machine (after a short untimed W2:
# a fresh machine's first run compiles kernels), then W3 fp8 + fp8 KV with it.
#
#   bash benchmarks/run_async_check.sh [RESULTS_DIR]      (default: $OUT on the device machine)
set -u
RESULTS=${1:-${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$RESULTS"
LOGS=$(mktemp -d)
source benchmarks/device_env.sh

timeout 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_async_scheduling.py \
  tests/engine/test_pipeline_decode.py > "$LOGS/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$LOGS/gpu_tests.log")"
grep -E "^(FAILED|E )" "$LOGS/gpu_tests.log" | head -20
W2=(-m slipstream.bench.cli throughput --model llama-3.1-8b --input-len 128 --output-len 128
    --num-requests 4000 --max-batch-size 512 --max-num-tokens 8192 --quantization fp8
    --kv-cache-dtype fp8)
timeout 120 "$PY" "${W2[@]/4000/600}" --label W2_warmup > "$LOGS/W2_warmup.log" 2>&1
for mode in sync async; do
  extra=()
  [[ $mode == async ]] && extra+=(--async-scheduling)
  timeout 130 "$PY" "${W2[@]}" "${extra[@]}" --label "W2_fp8kv_$mode" \
    --output-json "$RESULTS/W2_fp8kv_$mode.json" > "$LOGS/W2_$mode.log" 2>&1
  "$PY" -c "import json; d = json.load(open('$RESULTS/W2_fp8kv_$mode.json')); \
print('W2 fp8kv $mode', round(d['output_tok_s']), 'tok/s')" 2>/dev/null || tail -5 "$LOGS/W2_$mode.log"
done
timeout 170 "$PY" -m slipstream.bench.cli throughput --model llama-3.1-8b --input-len 1000 \
  --output-len 1000 --num-requests 1000 --max-batch-size 512 --max-num-tokens 8192 \
  --quantization fp8 --kv-cache-dtype fp8 --async-scheduling --label W3_fp8kv_async \
  --output-json "$RESULTS/W3_fp8kv_async.json" > "$LOGS/W3.log" 2>&1
"$PY" -c "import json; d = json.load(open('$RESULTS/W3_fp8kv_async.json')); \
print('W3 fp8kv async', round(d['output_tok_s']), 'tok/s')" 2>/dev/null || tail -5 "$LOGS/W3.log"
tar -czf "$RESULTS/logs.tar.gz" -C "$LOGS" .
