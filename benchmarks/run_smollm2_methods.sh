#!/usr/bin/env bash
# The speed of each quantization method on the default model's shapes, one GPU, one call
# (~4-5 min): SmolLM2-135M-Instruct's GGUF with its real metadata and random weights
# (benchmarks/random_gguf.py; the real file is larger than what travels to a device machine),
# batch-1 decode (128 in / 256 out) and W5 (256 mixed requests) for each method, a table last.
# The accuracy of the same methods is docs/quantization.md's table (CPU, the real weights).
#
#   bash benchmarks/run_smollm2_methods.sh [RESULTS_DIR]     (needs .out/smol-skeleton.json)
#   METHODS="none int4_awq" bash benchmarks/run_smollm2_methods.sh
#   W5=0 bash benchmarks/run_smollm2_methods.sh      (batch 1 only)
set -u
RESULTS=${1:-${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)-smollm2}}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh
METHODS=${METHODS:-"none int8_wo fp8 w8a8_sq int4_awq"}
GGUF=/tmp/smol.gguf
[[ -f $GGUF ]] || "$PY" benchmarks/random_gguf.py fill .out/smol-skeleton.json "$GGUF" > /dev/null

for m in $METHODS; do
  q=(); [[ $m != none ]] && q=(--quantization "$m")
  timeout 90 "$PY" -m slipstream.bench.cli latency --model "$GGUF" "${q[@]}" --batch-size 1 \
    --input-len 128 --output-len 256 --num-iters 3 --label "W1_$m" \
    --output-json "$RESULTS/W1_$m.json" > "$RESULTS/W1_$m.log" 2>&1 || echo "W1 $m: failed"
  [[ ${W5:-1} == 1 ]] || continue
  timeout 90 "$PY" -m slipstream.bench.cli throughput --model "$GGUF" "${q[@]}" --dataset w5 \
    --label "W5_$m" --output-json "$RESULTS/W5_$m.json" > "$RESULTS/W5_$m.log" 2>&1 \
    || echo "W5 $m: failed"
done

"$PY" - "$RESULTS" $METHODS <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def read(name):
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None

base = read("W1_none"), read("W5_none")
print("| method | W1 decode tok/s | vs bf16 | W5 output tok/s | vs bf16 |")
print("| --- | --- | --- | --- | --- |")
for m in sys.argv[2:]:
    w1, w5 = read(f"W1_{m}"), read(f"W5_{m}")
    a = w1["decode_tok_s"]["median"] if w1 else None
    b = w5["output_tok_s"] if w5 else None
    ra = f"{a / base[0]['decode_tok_s']['median']:.2f}x" if a and base[0] else "-"
    rb = f"{b / base[1]['output_tok_s']:.2f}x" if b and base[1] else "-"
    fa, fb = (f"{v:,.0f}" if v else "-" for v in (a, b))
    print(f"| {m} | {fa} | {ra} | {fb} | {rb} |")
PY
