#!/usr/bin/env bash
# Issue 6 follow-up in one device call (~8 min): the GPU tests of the kernels changed in session 4
# (never run on a GPU: shared-memory pipelined GEMV candidates, fused SiLU + FP8 quantization,
# L2 weight prefetch, fp8-cache attention with two warps), the per-format GEMV sweep, and W1 for
# bf16 / int8_wo / fp8 with the L2 prefetch off and on.
#
#   bash benchmarks/run_quant_checks.sh [RESULTS_DIR]      (default: $OUT on the device machine)
set -u
RESULTS=${1:-${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

timeout 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider -n 8 \
  tests/kernels/test_quant_act.py tests/kernels/test_pdl.py tests/kernels/test_triton_gemv.py \
  tests/kernels/test_triton_paged_attention.py tests/quantization/test_gemv_int8.py \
  tests/quantization/test_methods.py tests/quantization/test_kv_cache.py \
  > "$RESULTS/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$RESULTS/gpu_tests.log")"
timeout 150 "$PY" benchmarks/bench_qgemv.py --formats int8,fp8 --output-json "$RESULTS/qgemv.json" \
  > "$RESULTS/qgemv.log" 2>&1
tail -12 "$RESULTS/qgemv.log"
for pf in 0 1; do
  SLIPSTREAM_L2_PREFETCH=$pf timeout 150 "$PY" benchmarks/bench_quant.py --methods none,int8_wo,fp8 \
    --output-json "$RESULTS/W1_l2prefetch$pf.json" > "$RESULTS/W1_l2prefetch$pf.log" 2>&1
  echo "W1 SLIPSTREAM_L2_PREFETCH=$pf:"; tail -4 "$RESULTS/W1_l2prefetch$pf.log"
done
