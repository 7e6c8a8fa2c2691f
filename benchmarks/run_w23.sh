#!/usr/bin/env bash
# One device call (~6 min): W2 bf16, W2 fp8 + fp8 KV and W3 fp8 + fp8 KV on one machine (the
# issue-6 throughput rows), JSON and logs into RESULTS_DIR.
#
#   bash benchmarks/run_w23.sh [RESULTS_DIR]
set -u
RESULTS=${1:-${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh
COMMON=(-m slipstream.bench.cli throughput --model llama-3.1-8b --max-batch-size 512
        --max-num-tokens 8192)
W2=(--input-len 128 --output-len 128 --num-requests 4000)
W3=(--input-len 1000 --output-len 1000 --num-requests 1000)
FP8=(--quantization fp8 --kv-cache-dtype fp8)
run() {  # label timeout args...
  local label=$1 limit=$2; shift 2
  timeout "$limit" "$PY" "${COMMON[@]}" "$@" --label "$label" \
    --output-json "$RESULTS/$label.json" > "$RESULTS/$label.log" 2>&1
  "$PY" -c "import json; print('$label', round(json.load(open('$RESULTS/$label.json'))['output_tok_s']), 'tok/s')" \
    2>/dev/null || { echo "$label failed:"; tail -5 "$RESULTS/$label.log"; }
}
run W2_bf16 150 "${W2[@]}"
run W2_fp8_fp8kv 150 "${W2[@]}" "${FP8[@]}"
run W3_fp8_fp8kv 200 "${W3[@]}" "${FP8[@]}"
