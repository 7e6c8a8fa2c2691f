#!/usr/bin/env bash
# One device call: decode throughput at several batch sizes for several methods, under one setting
# or two (ENV_A / ENV_B, e.g. ENV_B="SLIPSTREAM_TUNE_GATED=0"; then A and B run back to back per
# case so their ratio is read on the same GPU). Prints one line per case; JSON per run in RESULTS_DIR.
#
#   BATCHES="4 8" METHODS="none fp8+head" ENV_B="SLIPSTREAM_TUNE_GATED=1" \
#     bash benchmarks/run_batch_ab.sh [RESULTS_DIR]
set -u
RESULTS=${1:-${OUT:-benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$RESULTS"
source benchmarks/device_env.sh

method_flags() {  # fp8+head -> --quantization fp8 --quantize-lm-head; none -> nothing
  local base=${1%%+*}
  [[ $base != none ]] && echo -n "--quantization $base "
  [[ $1 == *+head ]] && echo -n "--quantize-lm-head"
}
decode_tok_s() {
  "$PY" -c "import json,sys; print(f\"{json.load(open(sys.argv[1]))['decode_tok_s']['mean']:.1f}\")" "$1" \
    2>/dev/null || echo failed
}
for batch in ${BATCHES:-4}; do
  for method in ${METHODS:-none fp8+head}; do
    line="batch $batch $method:"
    sides="A"; [[ -n ${ENV_A:-}${ENV_B:-} ]] && sides="A B"
    for side in $sides; do
      env_set=${ENV_A:-}; [[ $side == B ]] && env_set=${ENV_B:-}
      json="$RESULTS/lat_b${batch}_${method/+/_}_${side}.json"
      env $env_set timeout 240 "$PY" -m slipstream --log-level INFO bench latency --model llama-3.1-8b \
        --load-format dummy --batch-size "$batch" --input-len 128 --output-len 256 --num-iters 2 \
        $(method_flags "$method") --output-json "$json" > "${json%.json}.log" 2>&1
      line="$line $side $(decode_tok_s "$json")"
    done
    echo "$line"
  done
done
# PACK=1: one tarball instead of the files (the device tool returns at most 8 files a call).
if [[ -n ${PACK:-} ]]; then
  tar czf "$RESULTS.tgz" -C "$RESULTS" . && rm -rf "$RESULTS"
fi
