#!/usr/bin/env bash
# One device call: W1 (bench_quant.py) of one source tree under several environment settings,
# in order on one machine, each row's ratio read against bf16 in its own run. Arguments are
# NAME:VAR=VALUE[,VAR=VALUE...] (NAME: alone = the defaults); the first run also compiles the
# kernels (a fresh machine: ~2.5 min, then ~1 min each). GPU_TESTS: pytest paths run first
# with -m gpu (GPU_K: a -k expression for them; GPU_TESTS_TIMEOUT_S, default 200); W1_METHODS
# (default none,fp8+head,int8_wo+head); BUDGET_S (default 540) skips the variants that would
# start after it; W1_TIMEOUT_S (default 300) caps each variant (a cold 4-method run needs ~400).
#
#   GPU_TESTS="tests/engine/test_gpu_e2e.py" bash benchmarks/run_w1_variants.sh \
#     base: fold:SLIPSTREAM_FOLD_NORMS=1 base2:
set -u
RESULTS=${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
if [[ -n ${GPU_TESTS:-} ]]; then
  # -v: each result's name as it comes (a run the cap cuts short prints no summary).
  timeout "${GPU_TESTS_TIMEOUT_S:-200}" "$PY" -m pytest -v -m gpu -p no:cacheprovider -n 16 \
    $GPU_TESTS ${GPU_K:+-k "$GPU_K"} > "$RESULTS/gpu_tests.log" 2>&1
  echo "gpu tests ($(elapsed) s): $(tail -1 "$RESULTS/gpu_tests.log")"
  grep -E "(FAILED|ERROR) " "$RESULTS/gpu_tests.log" | head
fi
for variant in "$@"; do
  name=${variant%%:*}
  settings=${variant#*:}
  if (( $(elapsed) > ${BUDGET_S:-540} )); then
    echo "$name: skipped (budget)"
    continue
  fi
  env ${settings//,/ } timeout "${W1_TIMEOUT_S:-300}" "$PY" benchmarks/bench_quant.py \
    --methods "${W1_METHODS:-none,fp8+head,int8_wo+head}" --num-iters 2 --show-tuning \
    --output-json "$RESULTS/w1_$name.json" > "$RESULTS/w1_$name.log" 2>&1
  echo "== $name (${settings:-defaults}), rc $?, $(elapsed) s"
  # The final table, or (a run cut short) the rows printed as each method finished.
  grep -E "^(none|int8_wo|fp8|int4_awq)\b" "$RESULTS/w1_$name.log" \
    || grep -E "^= " "$RESULTS/w1_$name.log"
done
