#!/usr/bin/env bash
# The README's standard figures in one command (one GPU, ~6-9 min cold, less on a warm machine):
# W1 bf16, W1 fp8 + FP8 head, W1 int4_awq + int4 head (batch 1, 128 in / 256 out, Llama-3.1-8B
# shape, dummy weights) and W2 bf16 (4,000 x 128 / 128, batch 512). JSON per workload goes to
# RESULTS_DIR (else $OUT on the device machine, else benchmarks/results/<date>); a table with
# each W1 method's ratio to the W1 bf16 run of this call is printed last.
#
#   bash benchmarks/run_standard.sh [RESULTS_DIR]
#   WORKLOADS="W1_bf16 W1_int4_awq" bash benchmarks/run_standard.sh      # a subset
#   TREE=../before bash benchmarks/run_standard.sh $OUT/before         # another source tree
#
# TREE: the source tree to measure (default: this one); its `slipstream` package is imported.
# W2_REQUESTS (4000), W2_HF=1 adds the HF batch-256 baseline on the first 512 requests,
# BUDGET_S (560): no workload starts past it; each has its own cap as well.
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
RESULTS=${1:-${OUT:-$HERE/benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
TREE=$(cd "${TREE:-$HERE}" && pwd)
cd "$HERE" && source benchmarks/device_env.sh
export PYTHONPATH=$TREE${PYTHONPATH:+:$PYTHONPATH}
BUDGET_S=${BUDGET_S:-560}
WORKLOADS=${WORKLOADS:-"W1_bf16 W1_fp8 W1_int4_awq W2_bf16"}
STATUS=()

run() {  # NAME CAP_S bench args...
  local name=$1 cap=$2; shift 2
  [[ " $WORKLOADS " == *" $name "* ]] || return 0
  local left=$((BUDGET_S - SECONDS)); local limit=$((cap < left ? cap : left))
  if ((limit < 30)); then STATUS+=("$name: SKIPPED (budget)"); return; fi
  echo "=== $name (cap ${limit}s): slipstream bench $*"
  (cd "$TREE" && timeout -k 15 "$limit" "$PY" -m slipstream.bench.cli "$@" --label "$name" \
    --output-json "$RESULTS/$name.json" > "$RESULTS/$name.log" 2>&1)
  local rc=$?
  case $rc in
    0) STATUS+=("$name: ok") ;;
    124|137) STATUS+=("$name: TIMEOUT (cap ${limit}s)") ;;
    *) STATUS+=("$name: FAILED rc=$rc"); tail -5 "$RESULTS/$name.log" ;;
  esac
}

W1=(latency --model llama-3.1-8b --load-format dummy --batch-size 1 --input-len 128
    --output-len 256 --num-iters 3)
run W1_bf16 150 "${W1[@]}"
run W1_fp8 200 "${W1[@]}" --quantization fp8 --quantize-lm-head
run W1_int4_awq 260 "${W1[@]}" --quantization int4_awq --quantize-lm-head int4
W2=(throughput --model llama-3.1-8b --input-len 128 --output-len 128
    --num-requests "${W2_REQUESTS:-4000}" --max-batch-size 512 --max-num-tokens 8192)
[[ ${W2_HF:-0} == 1 ]] && W2+=(--baseline hf --hf-batch-size 256 --hf-num-requests 512)
run W2_bf16 200 "${W2[@]}"

echo
echo "tree: $TREE ($(git -C "$TREE" rev-parse --short HEAD 2>/dev/null || echo "${SLIPSTREAM_COMMIT:-no git}"))"
echo "took ${SECONDS}s; JSON in $RESULTS"
for s in "${STATUS[@]}"; do echo "  $s"; done
"$PY" - "$RESULTS" <<'EOF'
import json, pathlib, sys

results = pathlib.Path(sys.argv[1])
rows = {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}
bf16 = (rows.get("W1_bf16") or {}).get("decode_tok_s", {}).get("median")
print(f"\n{'workload':<14}{'tok/s':>11}{'% SoL':>8}{'x W1 bf16':>11}{'x baseline':>12}{'TTFT ms':>9}")
for name, r in rows.items():
    if "decode_tok_s" in r:  # latency
        tok = r["decode_tok_s"]["median"]
        ratio = f"{tok / bf16:.3f}" if bf16 else "-"
        sol = f"{r['sol_pct']:.1f}" if r.get("sol_pct") else "-"
        print(f"{name:<14}{tok:>11.1f}{sol:>8}{ratio:>11}{'-':>12}{r['ttft_ms']['median']:>9.1f}")
    elif "output_tok_s" in r:  # throughput
        base = r.get("ratio_vs_baseline")
        base = f"{base:.2f}" if base else "-"
        print(f"{name:<14}{r['output_tok_s']:>11.0f}{'-':>8}{'-':>11}{base:>12}"
              f"{r['ttft_ms']['median']:>9.1f}")
EOF
