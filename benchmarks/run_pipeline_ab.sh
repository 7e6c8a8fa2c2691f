#!/usr/bin/env bash
# One device call (~8 min): fp8 activation-quantizer GPU tests; W2 fp8 + fp8 KV with and
# without pipeline_decode (same machine, so the difference is the pipelining); a kernel
# profile of W2-like steps (fp8 + fp8 KV, batch 512); W3 fp8 + fp8 KV.
#
#   bash benchmarks/run_pipeline_ab.sh [RESULTS_DIR]      (default: $OUT on the device machine)
set -u
RESULTS=${1:-${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$RESULTS"
LOGS=$(mktemp -d)
source benchmarks/device_env.sh

timeout 90 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_quant_act.py \
  tests/engine/test_pipeline_decode.py > "$LOGS/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$LOGS/gpu_tests.log")"
grep -E "^(FAILED|E )" "$LOGS/gpu_tests.log" | head -20
W2=(-m slipstream.bench.cli throughput --model llama-3.1-8b --input-len 128 --output-len 128
    --num-requests 4000 --max-batch-size 512 --max-num-tokens 8192 --quantization fp8
    --kv-cache-dtype fp8)
# A short W2 first: a fresh machine compiles kernels on its first run (the A/B pair must not pay it).
timeout 120 "$PY" "${W2[@]/4000/600}" --label W2_warmup > "$LOGS/W2_warmup.log" 2>&1
for mode in piped unpiped; do
  extra=()
  [[ $mode == unpiped ]] && extra+=(--no-pipeline-decode)
  timeout 130 "$PY" "${W2[@]}" "${extra[@]}" --label "W2_fp8kv_$mode" \
    --output-json "$RESULTS/W2_fp8kv_$mode.json" > "$LOGS/W2_$mode.log" 2>&1
  "$PY" -c "import json; d = json.load(open('$RESULTS/W2_fp8kv_$mode.json')); \
print('W2 fp8kv $mode', round(d['output_tok_s']), 'tok/s')" 2>/dev/null || tail -5 "$LOGS/W2_$mode.log"
done
timeout 120 "$PY" benchmarks/profile_decode.py --batch-size 512 --num-requests 1024 --steps 64 \
  --max-num-tokens 8192 --quantization fp8 --kv-cache-dtype fp8 --top 30 \
  > "$RESULTS/profile_W2_fp8kv.txt" 2>&1
grep -vE "^\s*$" "$RESULTS/profile_W2_fp8kv.txt" | tail -44 | cut -c1-110
timeout 170 "$PY" -m slipstream.bench.cli throughput --model llama-3.1-8b --input-len 1000 \
  --output-len 1000 --num-requests 1000 --max-batch-size 512 --max-num-tokens 8192 \
  --quantization fp8 --kv-cache-dtype fp8 --label W3_fp8kv --output-json "$RESULTS/W3_fp8kv.json" \
  > "$LOGS/W3.log" 2>&1
"$PY" -c "import json; d = json.load(open('$RESULTS/W3_fp8kv.json')); \
print('W3 fp8kv', round(d['output_tok_s']), 'tok/s')" 2>/dev/null || tail -5 "$LOGS/W3.log"
tar -czf "$RESULTS/logs.tar.gz" -C "$LOGS" .
