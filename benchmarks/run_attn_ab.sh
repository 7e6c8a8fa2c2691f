#!/usr/bin/env bash
# One device call (~5 min): split decode attention's tile loops, the default (splits of at most
# 2 tiles load plainly, longer ones through 3 cp.async stages) against the staged loops alone
# (SLIPSTREAM_ATTN_SHORT_CHAIN_TILES=0) and a threshold of 4 tiles. The -m gpu attention tests,
# then bench_attention's graph-timed cases (batch-1 short and long contexts, mid batches at long
# contexts), then the batch-1 step in context (bench_step_parts) for each method in QUANTS
# (default fp8,none; "none" = bf16) at STEP_CTX (default 256) and at LONG_CTX (default 4096)
# under the same variants (those that would start after BUDGET_S, default 450, are skipped).
# Logs and JSON come back as one logs.tar.gz (at most 8 files return).
#
#   bash benchmarks/run_attn_ab.sh
set -u
RESULTS=${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
LOGS=$(mktemp -d)
trap 'tar -czf "$RESULTS/logs.tar.gz" -C "$LOGS" .' EXIT
source benchmarks/device_env.sh
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
timeout 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider -n 8 \
  tests/kernels/test_triton_paged_attention.py tests/kernels/test_attention_rope_fused.py \
  > "$LOGS/gpu_attn_tests.log" 2>&1
echo "gpu tests ($(elapsed) s): $(tail -1 "$LOGS/gpu_attn_tests.log")"
timeout 140 "$PY" benchmarks/bench_attention.py --cases 1x256,1x1024,1x8192,8x4096,32x2048 \
  --kv bf16 --output-json "$LOGS/attention.json" > "$LOGS/attention.log" 2>&1
echo "== bench_attention rc $? ($(elapsed) s)"
grep -v -E "^(INFO|WARNING)" "$LOGS/attention.log" | tail -30
VARIANTS=${VARIANTS:-_SHORT_CHAIN_TILES=0,_SHORT_CHAIN_TILES=4}
IFS=, read -ra methods <<< "${QUANTS:-fp8,none}"
for ctx in "${STEP_CTX:-256}" "${LONG_CTX:-4096}"; do  # both methods at the short context first
  for quant in "${methods[@]}"; do
    if (( $(elapsed) > ${BUDGET_S:-450} )); then  # a device call ends at 600 s
      echo "== $quant ctx $ctx: skipped (budget)"
      continue
    fi
    args=(--ctx "$ctx" --max-model-len $(( ctx > 384 ? ctx : 384 )) --parts full
          --attn-variants "$VARIANTS" --output-json "$LOGS/parts_${quant}_$ctx.json")
    [[ $quant != none ]] && args+=(--quantization "$quant" --quantize-lm-head)
    timeout 140 "$PY" benchmarks/bench_step_parts.py "${args[@]}" > "$LOGS/parts_${quant}_$ctx.log" 2>&1
    echo "== $quant ctx $ctx rc $? ($(elapsed) s)"
    grep -v -E "^(INFO|WARNING|measured)" "$LOGS/parts_${quant}_$ctx.log" | tail -6
  done
done
