#!/usr/bin/env bash
# One device call (~4-5 min): the whole-K tile loops (GemvConfig.persist, session 23). The -m gpu
# tests of the GEMV files that cover them (int4: every candidate, with rms_eps, whole-K; int8
# / fp8: every candidate; bf16 / gemv), then every int8 / fp8 one-row candidate timed per
# Llama-3.1-8B shape (bench_qgemv; the JSON lists the loops beside the rest). W1 with them is
# a separate call: python benchmarks/bench_quant.py --methods none,fp8+head,int4_awq+head,int8_wo+head --show-tuning
#
#   bash benchmarks/run_loop_checks.sh
set -u
RESULTS=${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh
start=$(date +%s)
timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider -n 8 \
  tests/quantization/test_gemv_int4.py tests/quantization/test_gemv_int8.py \
  tests/kernels/test_triton_gemv.py \
  > "$RESULTS/gpu_gemv_tests.log" 2>&1
echo "gpu tests ($(( $(date +%s) - start )) s): $(tail -1 "$RESULTS/gpu_gemv_tests.log")"
grep -E "^FAILED" "$RESULTS/gpu_gemv_tests.log" | head -20
timeout 240 "$PY" benchmarks/bench_qgemv.py --formats int8,fp8 --m 1 \
  --output-json "$RESULTS/qgemv_m1.json" 2>&1 | grep -v -E "^(INFO|WARNING)"
echo "done ($(( $(date +%s) - start )) s)"
