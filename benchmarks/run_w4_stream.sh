#!/usr/bin/env bash
# One device call (~8 min): the register-streaming CUDA C++ int4 GEMV (kernels/cuda/w4_stream.cu).
# Its -m gpu tests (and the bulk kernel's), probe_w4_stream.py at every decode shape with the
# layer chain, then W1 (int4_awq + int4 head) with SLIPSTREAM_W4_STREAM=1 unless W1=0.
# PROBE_ARGS: extra probe arguments (e.g. --configs ...).
#
#   bash benchmarks/run_w4_stream.sh
set -u
RESULTS=${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh
timeout 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider -x --timeout=180 \
  tests/quantization/test_gemv_int4_stream.py tests/quantization/test_gemv_int4_bulk.py \
  > "$RESULTS/stream_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$RESULTS/stream_tests.log")"
grep -E "^(FAILED|ERROR|E )" "$RESULTS/stream_tests.log" | head -20
timeout 300 "$PY" benchmarks/probe_w4_stream.py --chain --output-json "$RESULTS/stream.json" \
  ${PROBE_ARGS:-} > "$RESULTS/stream.log" 2>&1
echo "probe: exit $?"
grep -v -i warn "$RESULTS/stream.log" | cut -c1-220 | tail -50
if [[ ${W1:-1} != 0 ]]; then
  SLIPSTREAM_W4_STREAM=1 timeout 240 "$PY" benchmarks/bench_quant.py --methods int4_awq+head4 \
    --output-json "$RESULTS/w1_stream.json" > "$RESULTS/w1_stream.log" 2>&1
  echo "W1 stream: exit $?"; grep -E "^(none|int4_awq)" "$RESULTS/w1_stream.log"
fi
