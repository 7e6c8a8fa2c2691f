#!/usr/bin/env bash
# GPU tests of beam search, pooling and the host KV tier, then the benchmarks, each printing a
# short table. Two parts, each < 5 min on an H100:
#
#   bash benchmarks/run_beam_pooling_host_tier.sh beam   # tests + beam search benchmarks
#   bash benchmarks/run_beam_pooling_host_tier.sh tier   # host tier: embedded model, 8B shape
#   bash benchmarks/run_beam_pooling_host_tier.sh        # both
set -u
source benchmarks/device_env.sh
part=${1:-all}
if [[ $part == beam || $part == all ]]; then
  "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_gpu_beam_pooling_host_tier.py \
    tests/kv_cache/test_tier_cost.py
  "$PY" benchmarks/bench_beam_search.py --num-requests 256 --input-len 128 --output-len 128 \
    --beam-width 4
  "$PY" benchmarks/bench_beam_step.py --num-requests 256 --input-len 128 --output-len 32 \
    --beam-width 4
fi
if [[ $part == tier || $part == all ]]; then
  "$PY" benchmarks/bench_host_tier.py --conversations 200 --turns 8 --user-len 80 \
    --output-len 32 --gpu-kv-mib 128 --host-kv-mib 2048
  # An 8B Llama with random weights: 16 conversations x 4 turns of 512 new tokens do not fit
  # a 2 GiB device cache (16k tokens); a 12 GiB host tier holds them all.
  "$PY" benchmarks/bench_host_tier.py --shape llama-3.1-8b --conversations 16 --turns 4 \
    --user-len 512 --output-len 16 --gpu-kv-mib 2048 --host-kv-mib 12288 --max-num-seqs 32 \
    --max-model-len 4096
fi
