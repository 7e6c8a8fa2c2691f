#!/usr/bin/env bash
# The quantized paths in one device call (~8 min): the GPU tests of the quantized paths and the
# engine, then W2 for bf16 / fp8 / fp8 + fp8 KV cache and W1 for bf16 / int8_wo / fp8, each
# group in one run (the bars compare within a run). SCALED_MM=1 adds bench_scaled_mm.py (FP8
# GEMM scaling modes at W2 shapes), W4=1 bench_w4.py (int4 kernels per layer at M = 1 and 16);
# W2=0 / W1=0 leave W2 / W1 out; W1_METHODS picks W1's methods (default none,int8_wo,fp8).
#
#   bash benchmarks/run_quant_checks.sh [RESULTS_DIR]      (default: $OUT on the device machine)
set -u
RESULTS=${1:-${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh

timeout 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider -n 8 \
  tests/kernels/norm_act/test_quant_act.py tests/quantization/test_methods.py \
  tests/kernels/gemv/test_int4_gemv.py tests/runner \
  tests/models tests/engine > "$RESULTS/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$RESULTS/gpu_tests.log")"
grep -E "^FAILED" "$RESULTS/gpu_tests.log" | head
if [[ ${SCALED_MM:-0} == 1 ]]; then
  timeout 90 "$PY" benchmarks/bench_scaled_mm.py --output-json "$RESULTS/scaled_mm.json" \
    > "$RESULTS/scaled_mm.log" 2>&1
  tail -15 "$RESULTS/scaled_mm.log"
fi
if [[ ${W4:-0} == 1 ]]; then
  timeout 150 "$PY" benchmarks/bench_w4.py --ms 1,16 --output-json "$RESULTS/w4.json" \
    > "$RESULTS/w4.log" 2>&1
  grep -E "^M=|copy bandwidth|x 32 layers" "$RESULTS/w4.log"
fi
W2_RUNS=(none fp8 fp8kv)
[[ ${W2:-1} == 0 ]] && W2_RUNS=()
for q in "${W2_RUNS[@]}"; do
  args=()
  [[ $q != none ]] && args+=(--quantization fp8)
  [[ $q == fp8kv ]] && args+=(--kv-cache-dtype fp8)
  timeout 150 "$PY" -m slipstream.bench.cli throughput --model llama-3.1-8b --input-len 128 \
    --output-len 128 --num-requests 4000 --max-batch-size 512 --max-num-tokens 8192 "${args[@]}" \
    --label "W2_$q" --output-json "$RESULTS/W2_$q.json" > "$RESULTS/W2_$q.log" 2>&1
  "$PY" -c "import json; d = json.load(open('$RESULTS/W2_$q.json')); \
print('W2 $q', round(d['output_tok_s']), 'tok/s')" 2>/dev/null || echo "W2 $q: failed (see log)"
done
if [[ ${W1:-1} == 1 ]]; then
  timeout 300 "$PY" benchmarks/bench_quant.py --methods "${W1_METHODS:-none,int8_wo,fp8}" \
    --output-json "$RESULTS/W1.json" > "$RESULTS/W1.log" 2>&1
  grep -iE "^(method|none|int8_wo|fp8|int4_awq)\b|x bf16|tok/s" "$RESULTS/W1.log" | tail -8
fi
