#!/usr/bin/env bash
# One device call (~6 min): W1 of two source trees on one machine, alternating A B (ROUNDS
# times, default 2), so the ratio between trees is read on the same GPU. Run from tree B's root;
# tree A is another checkout (e.g. `git archive <old commit>` unpacked next to it), or `.` with
# ENV_A / ENV_B (e.g. ENV_A="SLIPSTREAM_NORM_IN_GEMV=0") to compare settings of one tree.
# GPU_TESTS: pytest paths run first with `-m gpu` (tree B).
#
#   GPU_TESTS="tests/kernels/test_triton_paged_attention.py" ROUNDS=1 \
#     bash benchmarks/run_w1_ab.sh ../old [RESULTS_DIR]
set -u
TREE_A=$(cd "${1:?usage: run_w1_ab.sh TREE_A [RESULTS_DIR]}" && pwd)
RESULTS=${2:-${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh
TREE_B=$PWD

if [[ -n ${GPU_TESTS:-} ]]; then
  timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider -n 8 $GPU_TESTS \
    > "$RESULTS/gpu_tests.log" 2>&1
  echo "gpu tests: $(tail -1 "$RESULTS/gpu_tests.log")"
  grep -E "^FAILED" "$RESULTS/gpu_tests.log" | head
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in A B; do
    dir=$TREE_A; env_set=${ENV_A:-}
    [[ $tree == B ]] && dir=$TREE_B && env_set=${ENV_B:-}
    (cd "$dir" && PYTHONPATH=$dir:${PYTHONPATH#$TREE_B:} env $env_set timeout 300 "$PY" benchmarks/bench_quant.py \
      --methods "${W1_METHODS:-none,fp8}" ${W1_FLAGS:-} --output-json "$RESULTS/W1_${tree}_$round.json" \
      > "$RESULTS/W1_${tree}_$round.log" 2>&1)
    echo "W1 tree $tree round $round:"
    grep -E "^(none|int8_wo|fp8|int4_awq)\b" "$RESULTS/W1_${tree}_$round.log"
  done
done
# PACK=1: one tarball instead of the files (the device tool returns at most 8 files a call).
if [[ -n ${PACK:-} ]]; then
  tar czf "$RESULTS.tgz" -C "$RESULTS" . && rm -rf "$RESULTS"
fi
