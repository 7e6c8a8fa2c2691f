#!/usr/bin/env bash
# MoE on one GPU in one command (< 8 min): the MoE GPU tests, the MoE layer alone against a
# per-expert torch loop (bench_moe.py: Qwen3-30B-A3B bf16 and int4, Mixtral-8x7B fp8 layer shapes at
# 1 / 64 / 512 tokens), then whole models with dummy weights: batch-1 decode (% of the bound for
# the bytes the routed experts take) and W2-like throughput (2,000 x 128 / 128), Qwen3-30B-A3B
# bf16 first, then Mixtral-8x7B fp8 while the budget lasts. JSON and logs go to RESULTS_DIR
# (else $OUT, else benchmarks/results/<date>-moe); a table is printed last.
#
#   bash benchmarks/run_moe.sh [RESULTS_DIR]
#   WORKLOADS="layer qwen3_w1" bash benchmarks/run_moe.sh     # a subset
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
RESULTS=${1:-${OUT:-$HERE/benchmarks/results/$(date -u +%Y%m%d-%H%M%S)-moe}}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
cd "$HERE" && source benchmarks/device_env.sh
BUDGET_S=${BUDGET_S:-450}
WORKLOADS=${WORKLOADS:-"tests layer qwen3_w1 qwen3_w2 mixtral_fp8_w1 mixtral_fp8_w2"}
STATUS=()

run() {  # NAME CAP_S command...
  local name=$1 cap=$2; shift 2
  [[ " $WORKLOADS " == *" $name "* ]] || return 0
  local left=$((BUDGET_S - SECONDS)); local limit=$((cap < left ? cap : left))
  if ((limit < 30)); then STATUS+=("$name: SKIPPED (budget)"); return; fi
  echo "=== $name (cap ${limit}s): $*"
  timeout -k 15 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$?
  case $rc in
    0) STATUS+=("$name: ok") ;;
    124|137) STATUS+=("$name: TIMEOUT (cap ${limit}s)") ;;
    *) STATUS+=("$name: FAILED rc=$rc"); tail -5 "$RESULTS/$name.log" ;;
  esac
}

run tests 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rfE tests/kernels/moe \
  tests/engine/test_moe_hf_parity.py
run layer 120 "$PY" benchmarks/bench_moe.py --shapes qwen3-30b-a3b,mixtral-8x7b-fp8,qwen3-30b-a3b-int4 \
  --tokens 1,64,512 --output-json "$RESULTS/layer.json"
W1=(latency --load-format dummy --batch-size 1 --input-len 128 --output-len 128 --num-iters 2)
W2=(throughput --input-len 128 --output-len 128 --num-requests 2000 --max-batch-size 256
    --max-num-tokens 8192)
bench() {  # NAME CAP_S bench arguments... (run() times out a command, not a shell function)
  local name=$1 cap=$2; shift 2
  run "$name" "$cap" "$PY" -m slipstream.bench.cli "$@" --label "$name" \
    --output-json "$RESULTS/$name.json"
}
bench qwen3_w1 110 "${W1[@]}" --model qwen3-30b-a3b
bench qwen3_w2 110 "${W2[@]}" --model qwen3-30b-a3b
bench mixtral_fp8_w1 130 "${W1[@]}" --model mixtral-8x7b --quantization fp8
bench mixtral_fp8_w2 130 "${W2[@]}" --model mixtral-8x7b --quantization fp8

echo
echo "took ${SECONDS}s on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); in $RESULTS"
for s in "${STATUS[@]}"; do echo "  $s"; done
grep -hE " passed| failed" "$RESULTS/tests.log" 2>/dev/null | tail -1
[[ -f "$RESULTS/layer.log" ]] && sed -n '/^shape/,$p' "$RESULTS/layer.log"
"$PY" - "$RESULTS" <<'PYEOF'
import json, pathlib, sys

rows = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*_w*.json"))}
print(f"\n{'workload':<16}{'tok/s':>10}{'% active-bytes bound':>22}{'TTFT ms':>9}")
for name, r in rows.items():
    if "decode_tok_s" in r:
        sol = f"{r['sol_pct']:.1f}" if r.get("sol_pct") else "-"
        print(f"{name:<16}{r['decode_tok_s']['median']:>10.1f}{sol:>22}{r['ttft_ms']['median']:>9.1f}")
    elif "output_tok_s" in r:
        print(f"{name:<16}{r['output_tok_s']:>10.0f}{'-':>22}{r['ttft_ms']['median']:>9.1f}")
PYEOF
