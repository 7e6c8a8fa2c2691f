#!/usr/bin/env bash
# One GPU call (< 5 min on an H100): the GPU tests of beam search, pooling and the host KV tier,
# then the beam-search benchmark (width 4, 128 / 128, 256 requests, against greedy) and the
# multi-turn host-tier benchmark (with and without the tier), each printing a short table.
#
#   bash benchmarks/run_beam_pooling_host_tier.sh
set -u
source benchmarks/device_env.sh
"$PY" -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_gpu_beam_pooling_host_tier.py
"$PY" benchmarks/bench_beam_search.py --num-requests 256 --input-len 128 --output-len 128 \
  --beam-width 4
"$PY" benchmarks/bench_host_tier.py --conversations 200 --turns 8 --user-len 80 \
  --output-len 32 --gpu-kv-mib 128 --host-kv-mib 2048
