#!/usr/bin/env bash
# One device call: where the batch-1 decode step's time goes (bench_step_parts.py), per method,
# every part, then the attention variants in the same process. Methods: QUANTS (default
# none,fp8; "none" = bf16); STEP_CTX (default 256); ATTN_VARIANTS (bench_step_parts'
# --attn-variants); each method capped at PART_TIMEOUT_S (default 200).
#
#   QUANTS=none,fp8,int4_awq bash benchmarks/run_step_parts.sh
set -u
RESULTS=${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh
PARTS=full,no_attention,no_qkv,no_o,no_gate_up,no_down,no_head
VARIANTS=${ATTN_VARIANTS-_SPLIT_BLOCK_N=32+_MIN_TOKENS_PER_SPLIT=32,_SPLIT_BLOCK_N=32+_MIN_TOKENS_PER_SPLIT=32+_SPLIT_WARPS=2,_SPLIT_WARPS=2,_SPLIT_WARPS=8}
IFS=, read -ra methods <<< "${QUANTS:-none,fp8}"
for quant in "${methods[@]}"; do
  args=(--ctx "${STEP_CTX:-256}" --parts "$PARTS" --attn-variants "$VARIANTS"
        --output-json "$RESULTS/parts_$quant.json")
  [[ $quant != none ]] && args+=(--quantization "$quant" --quantize-lm-head)
  timeout "${PART_TIMEOUT_S:-200}" "$PY" benchmarks/bench_step_parts.py "${args[@]}" \
    > "$RESULTS/parts_$quant.log" 2>&1
  echo "== $quant rc $?"
  grep -v -E "^(INFO|WARNING|measured)" "$RESULTS/parts_$quant.log" | tail -12
done
