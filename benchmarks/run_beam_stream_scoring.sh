#!/usr/bin/env bash
# One GPU call (about a minute on an H100): the GPU tests of beam search (with the tokens a
# stream sends before the end), pooling, the host tier and BERT pair scoring, then how early
# streamed beam searches show text (64 searches, width 4, 128 / 128), as a short table.
#
#   bash benchmarks/run_beam_stream_scoring.sh
set -u
source benchmarks/device_env.sh
"$PY" -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_gpu_beam_pooling_host_tier.py \
  tests/pooling/test_gpu_pair_scoring.py
"$PY" benchmarks/bench_beam_streaming.py --num-requests 64 --input-len 128 --output-len 128 \
  --beam-width 4
