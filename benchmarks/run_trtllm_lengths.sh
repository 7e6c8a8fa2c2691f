#!/usr/bin/env bash
# TensorRT-LLM's published H200 FP8 throughput lengths on the Llama-3.1-8B shape (fp8 weights,
# fp8 KV cache, no tuning flags: the engine's own limits), one GPU, one device call (~9 min):
# W2 128/128, W4 2048/128, 5000/500, 128/2048 and W3 1000/1000. JSON and logs in RESULTS_DIR, a
# table last with each figure's share of TensorRT-LLM's and of the floor in docs/kernels.md.
#
#   bash benchmarks/run_trtllm_lengths.sh [RESULTS_DIR]
#   ONLY="W4 L5000" bash benchmarks/run_trtllm_lengths.sh     (a subset; BUDGET_S, default 570)
set -u
RESULTS=${1:-${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)-trtllm-lengths}}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh
BUDGET_S=${BUDGET_S:-570}
# name input output requests cap_s TensorRT-LLM floor (docs/kernels.md)
CASES="W2 128 128 2000 100 27911 39820
W4 2048 128 600 110 3538 4425
L5000 5000 500 300 130 3902 4598
L128_2048 128 2048 512 120 26221 33015
W3 1000 1000 600 130 17744 21689"

while read -r name inp out n cap trt floor; do
  [[ -n ${ONLY:-} && " $ONLY " != *" $name "* ]] && continue
  left=$((BUDGET_S - SECONDS)); ((left < 40)) && { echo "$name: skipped (budget)"; continue; }
  timeout -s INT -k 10 $((cap < left ? cap : left)) "$PY" -m slipstream.bench.cli throughput \
    --model llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 --input-len "$inp" \
    --output-len "$out" --num-requests "$n" --label "$name" \
    --output-json "$RESULTS/$name.json" > "$RESULTS/$name.log" 2>&1 \
    || { echo "$name: failed or timed out"; tail -3 "$RESULTS/$name.log"; }
done <<< "$CASES"

"$PY" - "$RESULTS" "$CASES" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print("| workload | output tok/s | limits (seqs / tokens) | vs TensorRT-LLM H200 | share of the floor |")
print("| --- | --- | --- | --- | --- |")
for line in sys.argv[2].splitlines():
    name, i, o, n, _, trt, floor = line.split()
    p = out / f"{name}.json"
    if not p.exists():
        continue
    r = json.loads(p.read_text())
    tok, e = r["output_tok_s"], r["engine"]
    print(f"| {name} {i}/{o} x {n} | {tok:,.0f} | {e['max_batch_size']} / {e['max_num_tokens']} "
          f"| {tok / int(trt):.2f}x | {100 * tok / int(floor):.0f}% |")
PY
