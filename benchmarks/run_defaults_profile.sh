#!/usr/bin/env bash
# One device call (one GPU, ~4-5 min): the step limits the engine chooses on this GPU (the GPU
# test of tests/engine/test_auto_limits.py), W2 bf16 through `slipstream bench throughput` with
# no tuning flags (the README's W2 row used --max-batch-size 512 --max-num-tokens 8192), and the
# per-step profile of W2 / W3 / W4 (benchmarks/profile_steps.py). JSON and logs go to
# RESULTS_DIR (else $OUT, else benchmarks/results/<date>); a short table is printed last.
#
#   bash benchmarks/run_defaults_profile.sh [RESULTS_DIR]
#   PROFILE_ARGS="--quantization fp8 --kv-cache-dtype fp8" bash benchmarks/run_defaults_profile.sh
#
# W2_REQUESTS (2000; the README's row used 4000), PROFILE_MAX_STEPS (300), BUDGET_S (560): no
# part starts past it.
set -u
RESULTS=${1:-${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh
BUDGET_S=${BUDGET_S:-560}
STATUS=()

part() {  # NAME CAP_S command...
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET_S - SECONDS)); local limit=$((cap < left ? cap : left))
  if ((limit < 30)); then STATUS+=("$name: SKIPPED (budget)"); return; fi
  echo "=== $name (cap ${limit}s)"
  timeout -k 15 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$?
  case $rc in
    0) STATUS+=("$name: ok") ;;
    124|137) STATUS+=("$name: TIMEOUT (cap ${limit}s)") ;;
    *) STATUS+=("$name: FAILED rc=$rc"); tail -5 "$RESULTS/$name.log" ;;
  esac
}

part gpu_test 90 "$PY" -m pytest -q -s -p no:cacheprovider -m gpu \
  tests/engine/test_auto_limits.py
part W2_defaults 200 "$PY" -m slipstream.bench.cli throughput --model llama-3.1-8b \
  --input-len 128 --output-len 128 --num-requests "${W2_REQUESTS:-2000}" --label W2_defaults \
  --output-json "$RESULTS/W2_defaults.json"
# shellcheck disable=SC2086  # PROFILE_ARGS is a list of flags
part profile 260 "$PY" benchmarks/profile_steps.py --model llama-3.1-8b \
  --max-steps "${PROFILE_MAX_STEPS:-300}" ${PROFILE_ARGS:-} --output-json "$RESULTS/profile.json"

echo
echo "took ${SECONDS}s; logs and JSON in $RESULTS"
for s in "${STATUS[@]}"; do echo "  $s"; done
grep -h "chosen" "$RESULTS/gpu_test.log" 2>/dev/null | tail -1
"$PY" - "$RESULTS" <<'EOF'
import json, pathlib, sys

results = pathlib.Path(sys.argv[1])
w2 = results / "W2_defaults.json"
if w2.is_file():
    r = json.loads(w2.read_text())
    e = r["engine"]
    print(f"W2 bf16, no tuning flags: {r['output_tok_s']:,.0f} output tok/s with "
          f"{e['max_batch_size']} seqs / {e['max_num_tokens']} tokens chosen "
          f"({r['num_requests']} requests; README, 4000 requests with 512 / 8192 passed: 16,076)")
profile = results / "profile.json"
if profile.is_file():
    from slipstream.bench.step_profile import table

    print(table(json.loads(profile.read_text())))
EOF
