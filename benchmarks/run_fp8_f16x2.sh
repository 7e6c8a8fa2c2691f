#!/usr/bin/env bash
# One device call (~6 min): do the packed-float16 FP8 GEMV candidates (kernels/gemv_int8.py,
# _fp8_gemv_f16x2_kernel, behind SLIPSTREAM_FP8_F16X2=1) pass on the GPU and pay? Their -m gpu
# tests (every M == 1 candidate on the Llama-3.1-8B shapes), the graph-timed FP8 GEMV per layer
# with them, then W1 bf16 / fp8 without and with them (one machine: compare within the call).
#
#   bash benchmarks/run_fp8_f16x2.sh [RESULTS_DIR]
set -u
RESULTS=${1:-${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh

SLIPSTREAM_FP8_F16X2=1 timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider -n 8 \
  tests/quantization/test_gemv_int8.py > "$RESULTS/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$RESULTS/gpu_tests.log")"
grep -E "^FAILED" "$RESULTS/gpu_tests.log" | head
SLIPSTREAM_FP8_F16X2=1 timeout 120 "$PY" benchmarks/bench_qgemv.py --formats fp8 \
  --output-json "$RESULTS/qgemv_fp8.json" > "$RESULTS/qgemv_fp8.log" 2>&1
tail -7 "$RESULTS/qgemv_fp8.log"
for f16x2 in 0 1; do
  SLIPSTREAM_FP8_F16X2=$f16x2 timeout 120 "$PY" benchmarks/bench_quant.py --methods none,fp8 \
    --output-json "$RESULTS/W1_f16x2_$f16x2.json" > "$RESULTS/W1_f16x2_$f16x2.log" 2>&1
  echo "W1 SLIPSTREAM_FP8_F16X2=$f16x2:"; tail -3 "$RESULTS/W1_f16x2_$f16x2.log"
done
