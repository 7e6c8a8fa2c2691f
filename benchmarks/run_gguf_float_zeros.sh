#!/usr/bin/env bash
# GGUF Q4_1 on the int4 kernels with float zero points, one device call (~3-4 min on one H100):
# the float-zero and GGUF GPU tests, then SmolLM2-135M's Q4_1 GGUF (its real metadata, random
# weights: benchmarks/random_gguf.py) decoding at batch 1 in bf16 and as int4_awq (the Q4_1
# blocks on the int4 kernels), as the 2026-12-06 figures were taken (670 against 1,804 tok/s).
# KERNELS=1 adds bench_w4_groups.py at group 32, integer against float zeros per layer and M
# (about 2 more minutes: each shape and zero form is tuned first).
#
#   bash benchmarks/run_gguf_float_zeros.sh [RESULTS_DIR]   (needs .out/smol-skeleton.json)
set -u
RESULTS=${1:-${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh

timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider -n 4 \
  tests/kernels/gemv/test_int4_float_zeros.py tests/models/test_gguf.py \
  > "$RESULTS/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$RESULTS/gpu_tests.log")"
grep -E "^FAILED" "$RESULTS/gpu_tests.log" | head

"$PY" benchmarks/random_gguf.py fill .out/smol-skeleton.json /tmp/smol.gguf > /dev/null
for q in bf16 int4; do
  args=()
  [[ $q == int4 ]] && args=(--quantization int4_awq)
  timeout 100 "$PY" -m slipstream.bench.cli latency --model /tmp/smol.gguf --batch-size 1 \
    --input-len 128 --output-len 256 --num-iters 3 "${args[@]}" --label "smol_gguf_W1_$q" \
    --output-json "$RESULTS/W1_$q.json" > "$RESULTS/W1_$q.log" 2>&1 || echo "W1 $q: failed"
done
if [[ ${KERNELS:-0} == 1 ]]; then
  timeout 200 "$PY" benchmarks/bench_w4_groups.py --ms 1,2,4,16 --groups 32 --zeros int,float \
    --output-json "$RESULTS/w4_zeros.json" > "$RESULTS/w4_zeros.log" 2>&1
  cat "$RESULTS/w4_zeros.log"
fi
"$PY" - "$RESULTS" <<'PY'
import json, sys
from pathlib import Path

rows = {}
for q in ("bf16", "int4"):
    path = Path(sys.argv[1]) / f"W1_{q}.json"
    if path.exists():
        d = json.loads(path.read_text())
        rows[q] = (d["decode_tok_s"]["median"], d["startup_s"].get("llm_init"))
print("| SmolLM2 Q4_1 GGUF, batch 1 | decode tok/s (median) | start-up s |")
print("| --- | --- | --- |")
for q, (tok_s, start) in rows.items():
    print(f"| {q} | {tok_s:,.0f} | {start} |")
if len(rows) == 2:
    print(f"int4 / bf16: {rows['int4'][0] / rows['bf16'][0]:.2f}x (before float zeros: 670 / 1,804 = 0.37x)")
PY
