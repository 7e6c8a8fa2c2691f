#!/usr/bin/env bash
# One device call: the L2 prefetch's GPU tests, then the batch-1 decode step in context
# (bench_step_parts.py, STEP_CTX default 256) per method (QUANTS, default int4_awq,fp8,none;
# "none" = bf16; quantized ones with the quantized head) at several prefetch budgets (BUDGETS,
# MB, default 0,16,32,48) and with the prefetch issued before the PDL wait (_PF_EARLY=1).
#
#   QUANTS=int4_awq BUDGETS=0,24,32,40 bash benchmarks/run_l2_prefetch.sh
set -u
RESULTS=${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh
timeout -s INT 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rfE \
  tests/kernels/test_l2_prefetch.py tests/kernels/test_attention_rope_fused.py \
  > "$RESULTS/l2_tests.log" 2>&1
echo "gpu tests: exit $?"; grep -E "^(FAILED|ERROR)| passed| failed" "$RESULTS/l2_tests.log" | tail -8
IFS=, read -ra methods <<< "${QUANTS:-int4_awq,fp8,none}"
for quant in "${methods[@]}"; do
  args=(--ctx "${STEP_CTX:-256}" --parts full --l2-budgets "${BUDGETS:-0,16,32,48}"
        --attn-variants "${VARIANTS:-_PF_EARLY=1}" --output-json "$RESULTS/l2_$quant.json")
  [[ $quant != none ]] && args+=(--quantization "$quant" --quantize-lm-head)
  timeout -s INT "${PART_TIMEOUT_S:-150}" "$PY" benchmarks/bench_step_parts.py "${args[@]}" \
    > "$RESULTS/l2_$quant.log" 2>&1
  echo "== $quant rc $?"
  grep -E "^(measured|full)" "$RESULTS/l2_$quant.log" | tail -12
done
