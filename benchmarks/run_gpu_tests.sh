#!/usr/bin/env bash
# One device call: the -m gpu tests under a deadline that still reports. The tests run under
# pytest-xdist (-n WORKERS, default 8) except those marked gpu_alone (they fill the GPU on
# purpose, so a neighbour could fail with them), which run afterwards by themselves. At the
# deadline pytest gets SIGINT, not SIGTERM, so it still prints the failures and the slowest
# tests so far (a plain timeout loses the failures' names). PATHS picks the tests
# (default: all of tests/; a CPU-only module whose server dependencies the GPU image lacks
# is reported as a collection error without stopping the rest); BUDGET_S (default 540) is the whole call's deadline.
# TEST_TIMEOUT_S (default 300) is one test's limit: raise it for slow cold tests (the GPU model
# tests of tests/models/test_norm_fold.py compile every tuner candidate: up to ~240 s cold).
#
#   PATHS="tests/engine tests/models" bash benchmarks/run_gpu_tests.sh
set -u
RESULTS=${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh
PATHS=${PATHS:-tests}
BUDGET_S=${BUDGET_S:-540}
ALONE_S=${ALONE_S:-90}  # kept back from the parallel part for the gpu_alone tests
start=$(date +%s)
# shellcheck disable=SC2086  # PATHS is a list of paths
timeout -s INT -k 30 $((BUDGET_S - ALONE_S)) "$PY" -m pytest -q -m "gpu and not gpu_alone" \
  -p no:cacheprovider --continue-on-collection-errors -n "${WORKERS:-8}" --timeout="${TEST_TIMEOUT_S:-300}" -rfE --durations=15 $PATHS \
  > "$RESULTS/gpu_tests.log" 2>&1
echo "parallel part: exit $? after $(( $(date +%s) - start )) s"
grep -E "^(FAILED|ERROR)| passed| failed| skipped|Interrupted" "$RESULTS/gpu_tests.log" | tail -20
left=$(( BUDGET_S - ($(date +%s) - start) ))
# shellcheck disable=SC2086
timeout -s INT -k 15 $(( left > 20 ? left - 10 : 10 )) "$PY" -m pytest -q -m gpu_alone \
  -p no:cacheprovider --continue-on-collection-errors --timeout=300 -rfE $PATHS > "$RESULTS/gpu_alone_tests.log" 2>&1
echo "gpu_alone part: exit $?"
grep -E "^(FAILED|ERROR)| passed| failed|Interrupted|no tests ran" "$RESULTS/gpu_alone_tests.log" | tail -5
