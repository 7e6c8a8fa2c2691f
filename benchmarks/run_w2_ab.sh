#!/usr/bin/env bash
# One device call (~8 min): does an engine flag pay on the H200? The -m gpu tests of pipelined
# decode and async scheduling, a short untimed W2 (a fresh machine compiles kernels on its first
# run), then W2 fp8 + fp8 KV without and with FLAG on the same machine, then W3 fp8 + fp8 KV
# with it. Logs come back as one logs.tar.gz (a device call returns at most 8 files).
#
#   bash benchmarks/run_w2_ab.sh --no-async-scheduling [RESULTS_DIR]
#   bash benchmarks/run_w2_ab.sh --no-pipeline-decode [RESULTS_DIR]
set -u
FLAG=${1:?usage: run_w2_ab.sh ENGINE_FLAG [RESULTS_DIR]}
RESULTS=${2:-${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$RESULTS"
LOGS=$(mktemp -d)
source benchmarks/device_env.sh

timeout 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_async_scheduling.py \
  tests/engine/test_pipeline_decode.py > "$LOGS/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$LOGS/gpu_tests.log")"
grep -E "^(FAILED|E )" "$LOGS/gpu_tests.log" | head -20

report() {  # label json log
  "$PY" -c "import json; print('$1', round(json.load(open('$2'))['output_tok_s']), 'tok/s')" \
    2>/dev/null || tail -5 "$3"
}
W2=(-m slipstream.bench.cli throughput --model llama-3.1-8b --input-len 128 --output-len 128
    --num-requests 4000 --max-batch-size 512 --max-num-tokens 8192 --quantization fp8
    --kv-cache-dtype fp8)
timeout 120 "$PY" "${W2[@]/4000/600}" --label W2_warmup > "$LOGS/W2_warmup.log" 2>&1
for mode in without with; do
  extra=()
  [[ $mode == with ]] && extra+=("$FLAG")
  timeout 130 "$PY" "${W2[@]}" "${extra[@]}" --label "W2_fp8kv_${mode}" \
    --output-json "$RESULTS/W2_fp8kv_$mode.json" > "$LOGS/W2_$mode.log" 2>&1
  report "W2 fp8kv $mode $FLAG" "$RESULTS/W2_fp8kv_$mode.json" "$LOGS/W2_$mode.log"
done
timeout 170 "$PY" -m slipstream.bench.cli throughput --model llama-3.1-8b --input-len 1000 \
  --output-len 1000 --num-requests 1000 --max-batch-size 512 --max-num-tokens 8192 \
  --quantization fp8 --kv-cache-dtype fp8 "$FLAG" --label W3_fp8kv \
  --output-json "$RESULTS/W3_fp8kv_with.json" > "$LOGS/W3.log" 2>&1
report "W3 fp8kv with $FLAG" "$RESULTS/W3_fp8kv_with.json" "$LOGS/W3.log"
tar -czf "$RESULTS/logs.tar.gz" -C "$LOGS" .
